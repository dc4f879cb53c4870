"""The training run: :func:`train` trains (or resumes) a config in its run directory.

``train.py`` is the command line around it. A run directory receives ``train.lock`` (held while
the run is going, ``k3jax/training/run_lock.py``), ``config.yaml``, ``checkpoints/`` (``k3jax/training/checkpoint.py``),
``metrics.jsonl``, ``tensorboard/`` and, at the end, ``loss.png`` (``k3jax/training/run_log.py``); with
``train.wandb`` on, ``wandb_run_id`` (``k3jax/training/wandb_log.py``), with ``train.profile`` on, ``profile/``
(``k3jax/training/profiling.py``).

Resuming: the latest checkpoint of the run directory is restored (model, optimizer, data position);
metrics logged past it by an abandoned continuation are dropped; a ``train.steps`` that would move
the learning rate at the resumed step is refused unless ``reschedule=True``
(:func:`check_schedule`). The run directory may be a URL (``gs://bucket/run``; ``k3jax/runtime/storage.py``).

Faults (docs/design.md, "Running as a pod job"):

- SIGINT (Ctrl-C) or SIGTERM (a preempted spot VM, a Kubernetes eviction): the step in flight finishes,
  every process agrees on that step (an all-gather of the flag at each step boundary), saves it and
  returns ``interrupted`` with the signal's name; the same command resumes.
- A checkpoint save that fails (disk full, permissions, network): :class:`~k3jax.training.checkpoint.CheckpointSaveError`
  naming the step and the reason; the previous checkpoint is intact and a partial step is never listed.
- ``train.max_nonfinite_steps`` consecutive updates skipped by the NaN guard: :class:`DivergenceError`
  naming the steps (``train.on_nonfinite=stop``), or the weights and optimizer go back to the latest
  checkpoint saved before the first of those steps and training continues with the batches after the bad
  ones (``rollback``; once per checkpoint).
- Bad data records: ``train.data.bad_records`` (``k3jax/data/sources.py``); skipped ones are counted in
  ``metrics.jsonl`` (``skipped_records``).
"""

from __future__ import annotations

import contextlib
import signal
import time

import jax
import numpy as np
import yaml
from flax import nnx
from tqdm import tqdm

from k3jax.runtime import distributed, storage
from k3jax.training import checkpoint
from k3jax.config import Config, to_dict
from k3jax.data.chat import chat_prompt, reply_stop_ids
from k3jax.data.images import make_dataset
from k3jax.data.pipeline import batch_summary
from k3jax.tokenizer import load_tokenizer
from k3jax.inference.generate import generate
from k3jax.optim import learning_rate_schedule
from k3jax.training.run_lock import LOCK_FILE, RunLockedError, lock_run_dir
from k3jax.training.profiling import StepProfiler
from k3jax.training.run_log import RunLog, plot_losses
from k3jax.training.stop_request import StopRequest
from k3jax.sharding import abstract_with_shardings, make_mesh, shard_batch, state_shardings, use_mesh
from k3jax.training.step import (TrainState, abstract_train_state, expert_imbalance_layers, init_train_state,
                                 make_eval_step, make_train_step)

DEMO_PROMPT = "In the beginning"
DEMO_CHAT = "How many chapters does Exodus have?"  # a chat run's closing sample (the bundled chat set asks such)
# The closing sample is drawn (greedy decoding of a small model loops on its most likely phrase).
SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 0.8, 0.95
EVAL_BATCHES = 4


class ScheduleChangeError(RuntimeError):
    """Resuming with another ``train.steps`` would make the learning rate jump."""


class DivergenceError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient (``train.max_nonfinite_steps``)."""


def _print_main(text: str) -> None:
    if distributed.is_main_process():
        print(text, flush=True)


def evaluate(eval_step, state, cfg: Config, tokenizer, mesh) -> float:
    """Mean next-token loss over the first :data:`EVAL_BATCHES` batches of the held-out split."""
    nll = count = 0.0
    # The held-out split is small (it may have fewer documents than there are processes), so every
    # process reads the same global batches and contributes its own slice of rows.
    eval_iter = iter(make_dataset(cfg, tokenizer, split="eval"))
    n_proc, rank = jax.process_count(), jax.process_index()
    for _ in range(EVAL_BATCHES):
        batch = next(eval_iter, None)
        if batch is None:
            break
        local = {k: np.split(np.asarray(v), n_proc)[rank] for k, v in batch.items()}
        n, c = eval_step(state, shard_batch(local, mesh))
        nll, count = nll + float(n), count + float(c)
    return nll / max(count, 1.0)


def init_weights_from(model, source: str, mesh=None) -> dict:
    """Copy the model weights (and router-bias state) of another run's latest checkpoint, or of a Hugging
    Face directory, into ``model`` (its LoRA adapters aside): same architecture required; the
    quantization switches may differ (QAT fine-tuning). Returns the pinned source
    (``checkpoint.resolve_base``), which a LoRA run's checkpoints record."""
    base = checkpoint.resolve_base(source, seed=0)
    checkpoint.load_base(model, base, mesh)
    return base


def check_schedule(saved: Config, cfg: Config, step: int, *, reschedule: bool) -> str | None:
    """Whether ``cfg`` may resume at ``step`` a run checkpointed with config ``saved``, as far as the
    learning-rate schedule goes (it is a function of ``train.steps``).

    A change of ``train.steps`` that leaves the learning rate of the next update (optimizer step
    ``step``) unchanged is allowed: during warmup, a constant or fixed-length decay, WSD's stable
    phase (extending a WSD run moves its decay). One that moves it raises
    :class:`ScheduleChangeError` unless ``reschedule``. Returns a line to report, or None.
    """
    old_steps, new_steps = saved.train.steps, cfg.train.steps
    if old_steps == new_steps:
        return None
    old = float(learning_rate_schedule(cfg.train.optim, old_steps)(step))
    new = float(learning_rate_schedule(cfg.train.optim, new_steps)(step))
    change = f"train.steps {old_steps} -> {new_steps}"
    if np.isclose(old, new, rtol=1e-6, atol=0.0):
        return f"{change}: the learning-rate schedule now spans {new_steps} steps (at step {step} it is unchanged)"
    if not reschedule:
        raise ScheduleChangeError(
            f"{change} on resume recomputes the {cfg.train.optim.schedule} learning-rate schedule: at step {step} "
            f"it would jump from {old:.4g} to {new:.4g}. Pass --reschedule (train(..., reschedule=True)) to accept "
            f"that, or resume with train.steps={old_steps}.")
    return f"{change}: learning rate at step {step} {old:.4g} -> {new:.4g} (--reschedule)"


def _abstract_on(cfg: Config, mesh) -> TrainState:
    """A ``TrainState`` of ShapeDtypeStructs in their rule-derived shardings on ``mesh``: the target a
    checkpoint restores into."""
    graphdef, abstract = abstract_train_state(cfg)
    return nnx.merge(graphdef, abstract_with_shardings(abstract, state_shardings(abstract, mesh)))


def clear_run_dir(out) -> None:
    """Delete the run directory's contents but the lock file (its holder is this process)."""
    if not out.exists():
        return
    for child in out.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and (storage.is_remote(child) or not child.is_symlink()):  # no links in a bucket
            storage.rmtree(child)
        else:
            child.unlink()


def train(cfg: Config, *, fresh: bool = False, reschedule: bool = False, sample_tokens: int = 200) -> dict:
    """Train (or resume) ``cfg`` on the mesh ``cfg.mesh`` over all devices of all processes; returns
    the last logged ``loss``, ``eval_loss`` (NaN without a held-out split), ``sample`` and
    ``interrupted`` (the name of the signal, ``"SIGINT"`` or ``"SIGTERM"``, when stopped by one after
    saving; else None). Process 0 logs and samples; every process steps and saves its shards.

    ``fresh``: delete the run directory's contents first instead of resuming. ``reschedule``: accept a
    learning-rate jump from a changed ``train.steps`` on resume (:func:`check_schedule`).

    Raises :class:`~k3jax.config.ConfigError` for an invalid config (one built in code, which
    ``load_config`` did not check), :class:`~k3jax.training.run_lock.RunLockedError` if another process is training in the run
    directory, :class:`~k3jax.training.checkpoint.CheckpointError` if its checkpoint cannot be resumed,
    :class:`ScheduleChangeError`; while training :class:`~k3jax.training.checkpoint.CheckpointSaveError`,
    :class:`DivergenceError`, :class:`~k3jax.data.sources.BadRecordError`.
    """
    cfg.validate()  # load_config validated it; a Config built or replaced in code may not be
    out = storage.path(cfg.train.out_dir)
    with open_run_dir(out, fresh=fresh):
        mesh = make_mesh(cfg.mesh)
        with use_mesh(mesh):
            return _train(cfg, mesh, out, reschedule, sample_tokens)


@contextlib.contextmanager
def open_run_dir(out, *, fresh: bool):
    """The run directory ``out`` held by this job while the body runs: process 0 takes its lock (one lock
    per job: the other processes of a multi-host run share the directory; a refusal raises
    :class:`~k3jax.training.run_lock.RunLockedError` on every process), empties it when ``fresh``, and no
    process goes on before it has."""
    with contextlib.ExitStack() as lock:
        refused = None
        if distributed.is_main_process():
            try:
                lock.enter_context(lock_run_dir(out))
            except RunLockedError as e:
                refused = e
        if distributed.any_process(refused is not None):
            raise refused or RunLockedError(f"run directory {out} is in use by another process (process 0 says)")
        if fresh and distributed.is_main_process():
            clear_run_dir(out)
        if jax.process_count() > 1:  # nobody reads the run directory before process 0 has cleared it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("k3jax.train: run directory ready")
        storage.mkdir(out)
        yield


@contextlib.contextmanager
def closed_on_failure(bar, log, profiler, mngr):
    """A run's step loop: on any exception in it (a failed save, a divergence, a bad record, a second signal)
    the progress ``bar``, the run ``log``, the ``profiler`` and the checkpoint manager ``mngr`` are closed
    before it propagates. What was saved stays, and nothing waits on a save that failed."""
    try:
        yield
    except BaseException:
        bar.close()
        log.close()
        with contextlib.suppress(Exception):
            profiler.close()
        with contextlib.suppress(Exception):
            mngr.close()
        raise


def ready_state(state, mesh):
    """A train state ready to step: what a checkpoint does not hold (the count of updates skipped by the
    NaN guard) restarts at zero, and on a one-device mesh everything is placed on it."""
    state = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding)
                         if isinstance(x, jax.ShapeDtypeStruct) else x, state)
    if mesh.size == 1:
        # The batches are placed on the (one-device) mesh, and so are the step's outputs: the state
        # starts there too, or the second step would compile the train step again for the new types.
        state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return state


def _roll_back(cfg: Config, mesh, mngr, base, nonfinite: list[int], rolled_back_to: set[int]):
    """``train.max_nonfinite_steps`` consecutive skipped updates: raise :class:`DivergenceError`
    (``train.on_nonfinite=stop``, or a rollback to a checkpoint already rolled back to), or return the
    state of the latest checkpoint saved before the first skipped step (the weights that led into the
    divergence are not trusted; model and optimizer, while the data goes on past the bad batches) and its
    step."""
    tc = cfg.train
    before = [s for s in mngr.all_steps() if s < nonfinite[0]]
    latest = max(before) if before else None
    what = (f"steps {nonfinite[0]}-{nonfinite[-1]}: {len(nonfinite)} consecutive updates skipped for a non-finite "
            f"loss or gradient (train.max_nonfinite_steps={tc.max_nonfinite_steps})")
    if tc.on_nonfinite == "stop" or latest is None or latest in rolled_back_to:
        why = ("" if tc.on_nonfinite == "stop" else
               f"; no checkpoint before step {nonfinite[0]} to roll back to" if latest is None else
               f"; the run already rolled back to checkpoint {latest} once")
        kept = f" The latest checkpoint is step {mngr.latest_step()}." if mngr.latest_step() is not None else ""
        raise DivergenceError(f"{what}{why}.{kept} Lower the learning rate or check the data "
                              f"(train.on_nonfinite=rollback retries from the last checkpoint).")
    rolled_back_to.add(latest)
    ts = _abstract_on(cfg, mesh)
    checkpoint.restore_train_state(mngr, cfg, ts, None, step=latest)
    if tc.lora.enabled:
        checkpoint.load_base(ts.model, base, mesh)
    tqdm.write(f"{what}: rolled back to checkpoint {latest}; training goes on with the batches after step "
               f"{nonfinite[-1]}")
    return ready_state(nnx.split(ts)[1], mesh), latest


def start_state(cfg: Config, mesh, mngr, checkpoints, data_iter, *, reschedule: bool):
    """The run's ``TrainState`` on ``mesh``, the step it starts at and its base (``checkpoint.resolve_base``:
    where its starting weights come from; None unless ``train.init_from`` or ``checkpoint.names_base``):
    restored from the latest checkpoint of ``mngr`` (the run's directory ``checkpoints``; with ``data_iter``'s
    position; :func:`check_schedule` on a changed ``train.steps``), else freshly initialised (from
    ``train.init_from`` when set)."""
    tc = cfg.train
    base = None
    if mngr.latest_step() is not None:
        # Restored straight into the state's shardings: no init program, no second copy of the weights.
        ts = _abstract_on(cfg, mesh)
        start = checkpoint.restore_train_state(mngr, cfg, ts, data_iter)
        if checkpoint.names_base(cfg):  # the step-0 weights, as the checkpoint recorded them
            base = checkpoint.restore_base(mngr, start)
        if tc.lora.enabled:  # the checkpoint holds the adapters: the frozen weights come from its base
            checkpoint.load_base(ts.model, base, mesh)
        note = check_schedule(checkpoint.restore_config(checkpoints, step=start)[0], cfg, start, reschedule=reschedule)
        tqdm.write(f"resumed from {checkpoints} at step {start}" + (f"; {note}" if note else ""))
    else:
        ts, start = init_train_state(cfg, mesh), 0
        if tc.init_from:
            base = init_weights_from(ts.model, tc.init_from, mesh)
            tqdm.write(f"initialised the model from {tc.init_from}")
        elif checkpoint.names_base(cfg):
            base = checkpoint.resolve_base(None, tc.seed)
    return ts, start, base


def _train(cfg: Config, mesh, out, reschedule: bool, sample_tokens: int) -> dict:
    tc = cfg.train
    main_process = distributed.is_main_process()

    tokenizer = load_tokenizer(tc.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {tc.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}")
    dataset = make_dataset(cfg, tokenizer, split="train", process_index=jax.process_index(),
                           process_count=jax.process_count())
    train_iter = iter(dataset)
    skipped_records = getattr(dataset, "bad_records", None)  # train.data.bad_records=skip: counts the skipped
    mngr = checkpoint.manager(out / "checkpoints", max_to_keep=tc.keep_checkpoints,
                              item_names=checkpoint.train_items(cfg))
    ts, start, base = start_state(cfg, mesh, mngr, out / "checkpoints", train_iter, reschedule=reschedule)
    if main_process:
        storage.write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    graphdef, state = nnx.split(ts)
    state = ready_state(state, mesh)
    schedule = learning_rate_schedule(tc.optim, tc.steps)
    step_fn = make_train_step(graphdef, cfg, state_shardings=jax.tree.map(lambda x: x.sharding, state))
    # no held-out split (train.data.eval_fraction = 0): no eval, and no eval step to compile
    eval_fn = make_eval_step(graphdef, cfg) if tc.data.eval_fraction > 0 else None
    moe_layers = expert_imbalance_layers(cfg.model)

    log = RunLog(out, step=start, enabled=main_process, config=cfg)
    if log.rolled_back:
        tqdm.write(f"dropped {log.rolled_back} metrics record(s) logged after step {start} "
                   f"(a continuation that was rolled back)")
    if start == 0 and tc.init_from and eval_fn is not None:
        # a fine-tune's reference point: the base's loss on the held-out split, logged as step 0
        base_loss = evaluate(eval_fn, state, cfg, tokenizer, mesh)
        log.write({"step": 0, "eval_loss": base_loss})
        _print_main(f"eval loss of the base ({tc.init_from}): {base_loss:.4f}")
    record, eval_loss, saved_step, step = {}, float("nan"), start, start
    bar = tqdm(total=tc.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True, disable=not main_process)
    t0, tokens_seen = time.perf_counter(), 0.0
    # Trace the step from empty trace caches: what the eager set-up left in them changes how the
    # step's jitted helpers are shared in its module, hence the persistent compilation cache key.
    jax.clear_caches()
    window = {"tokens": 0, "trained_tokens": 0}  # this process's rows since the last log: trained_fraction

    def counted(b):
        summary = batch_summary(b)
        window["tokens"] += summary["tokens"]
        window["trained_tokens"] += summary["trained_tokens"]
        return b

    batches = (shard_batch(counted(b), mesh) for b in train_iter)
    step_fn = distributed.compiled_together(step_fn, barrier="k3jax_train_step_compiled")
    saver = checkpoint.Saver(mngr, cfg, graphdef, train_iter, base)
    nonfinite: list[int] = []  # the current run of consecutive skipped steps
    rolled_back_to: set[int] = set()  # the checkpoints a rollback went back to (once each)
    skips_logged = 0
    profiler = StepProfiler(tc.profile, out)
    with closed_on_failure(bar, log, profiler, mngr), StopRequest() as stop:
        stop_signal = distributed.agreed_stop(stop.signum)
        while step < tc.steps and not stop_signal:
            profiler.before(step + 1)
            state, metrics = step_fn(state, next(batches))
            step += 1
            profiler.after(step, (state, metrics))
            bar.update(1)
            tokens_seen += float(metrics["tokens"])
            # once per step: every process stops after this one
            stop_signal = distributed.agreed_stop(stop.signum)
            if bool(metrics["finite"]):
                nonfinite.clear()
            else:
                nonfinite.append(step)
                tqdm.write(f"step {step}: non-finite loss or gradient; update skipped")
                if tc.max_nonfinite_steps and len(nonfinite) >= tc.max_nonfinite_steps and not stop_signal:
                    saver.wait()
                    state, step = _roll_back(cfg, mesh, mngr, base, nonfinite, rolled_back_to)
                    log.roll_back(step)
                    nonfinite.clear()
                    bar.n = step
                    bar.refresh()
                    continue
            if step % tc.log_every == 0 or step == tc.steps:
                dt = time.perf_counter() - t0
                imbalance = np.asarray(metrics["expert_imbalance"])
                record = {"step": step, "loss": float(metrics["loss"]), "lr": float(schedule(step - 1)),
                          "grad_norm": float(metrics["grad_norm"]), "tokens_per_s": tokens_seen / dt,
                          "trained_fraction": window["trained_tokens"] / max(window["tokens"], 1),
                          "expert_imbalance": {str(i): float(v) for i, v in zip(moe_layers, imbalance)}}
                if skipped_records is not None:  # this process's records skipped since the last log
                    record["skipped_records"] = skipped_records.count - skips_logged
                    skips_logged = skipped_records.count
                log.write(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                tok_s=f"{record['tokens_per_s']:.0f}",
                                imbalance=f"{imbalance.max():.2f}" if imbalance.size else "-")
                t0, tokens_seen = time.perf_counter(), 0.0
                window.update(tokens=0, trained_tokens=0)
            if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                log.write({"step": step, "eval_loss": evaluate(eval_fn, state, cfg, tokenizer, mesh)})
            if step % tc.checkpoint_every == 0 or step == tc.steps or stop_signal:
                saver.save(step, state)
                saved_step = step
        profiler.close()
        saver.wait()
    bar.close()
    mngr.close()
    if step < tc.steps:
        log.close()
        name = signal.Signals(stop_signal).name
        _print_main(f"{name}: stopped at step {step}; checkpoint {saved_step} saved in {out / 'checkpoints'}. "
                    f"Run the same command to resume.")
        return {"loss": record.get("loss", float("nan")), "eval_loss": eval_loss, "sample": "", "interrupted": name}

    if eval_fn is not None:
        eval_loss = evaluate(eval_fn, state, cfg, tokenizer, mesh)
        log.write({"step": tc.steps, "eval_loss": eval_loss})
    log.close()
    plot = plot_losses(out) if main_process else None
    evaluated = f"eval loss {eval_loss:.4f}" if eval_fn is not None else "no eval (train.data.eval_fraction=0)"
    _print_main(f"step {tc.steps}: loss {record.get('loss', float('nan')):.4f}, {evaluated}; "
                f"metrics in {out / 'metrics.jsonl'}, plot {plot}")

    sample = ""
    if sample_tokens:
        model = nnx.merge(graphdef, state).model
        if tc.data.format == "chat":  # a chat fine-tune answers a message, in the format it was trained on
            prompt, stops = chat_prompt(tokenizer, [{"role": "user", "content": DEMO_CHAT}]), reply_stop_ids(tokenizer)
            shown = f"user: {DEMO_CHAT}\nassistant:"
        else:
            prompt, shown = tokenizer.encode(DEMO_PROMPT), ""
            stops = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        prompt = np.asarray([prompt], np.int32)
        out_tokens = generate(model, prompt, min(sample_tokens, cfg.model.max_seq_len - prompt.shape[1]),
                              temperature=SAMPLE_TEMPERATURE, top_p=SAMPLE_TOP_P, stop_tokens=stops,
                              seed=cfg.train.seed)
        ids = [int(t) for t in np.asarray(out_tokens[0])]
        if shown:  # the reply alone, up to its end-of-turn token
            ids = ids[prompt.shape[1]:]
            ids = ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]
        sample = tokenizer.decode(ids)
        _print_main(f"\n--- sample (temperature {SAMPLE_TEMPERATURE}, top-p {SAMPLE_TOP_P}) ---\n{shown}{sample}\n")
    return {"loss": record.get("loss", float("nan")), "eval_loss": eval_loss, "sample": sample,
            "interrupted": None}


__all__ = ["DivergenceError", "ScheduleChangeError", "check_schedule", "closed_on_failure", "evaluate",
           "init_weights_from", "open_run_dir", "ready_state", "start_state", "train"]

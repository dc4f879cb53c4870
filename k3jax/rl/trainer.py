"""The RL run: ``python train.py --config tiny_rl`` (any config with ``train.rl.loss`` set).

Each step (docs/design.md, "Reinforcement learning"):

1. ``prompts_per_step`` prompt records from the prompt iterator (its position is checkpointed);
2. ``group_size`` completions each, sampled by the serving engine from the trainer's current weights
   (``Engine.set_weights``: in ``train.rl.rollout_layout``) with the sampled log-probabilities and, for an MoE
   model, every token's experts (``k3jax.rl.rollout``);
3. rewards (``k3jax.rl.rewards``), DAPO's overlong penalty, group-relative advantages, dynamic sampling
   (groups whose rewards are all equal carry no signal: their rows get weight 0);
4. the scoring forward on the same weights: the rollout / trainer mismatch (``k3jax.rl.mismatch``), the old
   policy of ``updates_per_rollout > 1``, the KL reference of ``beta > 0`` (``k3jax.rl.reference``: a LoRA
   run's frozen base, a full fine-tune's step-0 weights);
5. ``updates_per_rollout`` optimizer steps on the policy loss (``k3jax.rl.step``), the experts replayed.

Checkpoints, the run lock, Ctrl-C / SIGTERM and resume work as for pre-training
(``k3jax.training.trainer``); the sampling seeds are a function of ``train.seed``, the step and the row, so
a resumed run logs the uninterrupted run's rewards and losses. Steps count optimizer updates.

Several processes (a pod slice, started with the same command on every host, as pre-training): every process
runs the whole step. The prompt iterator and the seeds are the same everywhere, and the engine decides from
the requests alone, reading its tokens, log-probabilities and experts from replicated device outputs, so every
process samples the same completions (the environments' turns are process 0's, sent to all), takes process
0's rewards (``distributed.main_process_result``) and builds the same batch,
of which each places its own devices' shards (``sharding.place_batch``); the scoring forward's outputs are
gathered to every process. Once per step the processes compare digests of their rollouts and stop with
``agreement.RolloutDivergenceError`` naming both when they differ (``k3jax.rl.agreement``). Process 0 writes
the run directory's logs, every process its checkpoint shards.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time

import jax
import numpy as np
import yaml
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from k3jax.config import Config, ConfigError, to_dict
from k3jax.data.chat import reply_stop_ids
from k3jax.model import moe_layers
from k3jax.optim import learning_rate_schedule
from k3jax.rl import objectives
from k3jax.rl.agreement import check_same_rollout
from k3jax.rl.mismatch import logprob_mismatch, routing_disagreement
from k3jax.rl.environments import load_environment
from k3jax.rl.episodes import run_episodes
from k3jax.rl.prompts import PromptIterator, open_prompts, prompt_ids, prompt_text
from k3jax.rl.reference import reference_weights
from k3jax.rl.rewards import load_reward, score_rewards
from k3jax.rl.rollout import rollout_seed, sample, training_rows
from k3jax.rl.step import TOKEN_SUMS, aggregation, make_rl_step, make_score_fn, replays
from k3jax.runtime import distributed, storage
from k3jax.serving.engine import Engine
from k3jax.sharding import make_mesh, place_batch, use_mesh
from k3jax.tokenizer import load_tokenizer
from k3jax.training import checkpoint
from k3jax.training.profiling import StepProfiler
from k3jax.training.run_log import RunLog, plot_losses
from k3jax.training.stop_request import StopRequest
from k3jax.training.trainer import closed_on_failure, open_run_dir, ready_state, start_state


class PromptState:
    """The RL run's data position for the checkpoint: the prompt iterator's state, in the form grain's
    checkpoint handler saves for an iterator that is not a grain dataset (JSON bytes)."""

    def __init__(self, iterator: PromptIterator):
        self.iterator = iterator

    def get_state(self) -> bytes:
        return json.dumps(self.iterator.get_state()).encode()

    def set_state(self, state: bytes) -> None:
        self.iterator.set_state(json.loads(state.decode()))

    def start_prefetch(self) -> None:  # grain's handler calls it after a restore; nothing is prefetched
        return None


class Policy:
    """The reward side of a run: tokenizer, reward functions and the reply's stop ids."""

    def __init__(self, cfg: Config, tokenizer):
        rl = cfg.train.rl
        self.tokenizer = tokenizer
        self.stop_ids = reply_stop_ids(tokenizer)
        self.rewards = {name: load_reward(name, answer_pattern=rl.answer_pattern, format_pattern=rl.format_pattern,
                                          answer_field=rl.answer_field) for name in rl.rewards}
        self.weights = dict(zip(rl.rewards, rl.reward_weights)) if rl.reward_weights else None
        self.environment = load_environment(rl.environment) if rl.environment else None

    def reply(self, tokens: list[int]) -> str:
        """A completion's text: its tokens up to the first stop token."""
        end = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        return self.tokenizer.decode(tokens[:end])

    def score(self, records, completions):
        """-> (total reward ``[N]``, {reward name: ``[N]``}) of completion i of ``records[i]``: the reward
        functions on its (final) reply, plus an episode's environment reward (``environment``) when it gave one.
        Several processes: process 0 scores, every process gets its rewards (a reward that reads a clock or
        runs code need not come out the same on every host)."""
        def scores():
            total, per_fn = self._score(records, completions)
            return {"total": total.tolist(), "per_fn": {k: v.tolist() for k, v in per_fn.items()}}

        got = distributed.main_process_result(scores)
        return np.asarray(got["total"], np.float64), {k: np.asarray(v, np.float64) for k, v in got["per_fn"].items()}

    def _score(self, records, completions):
        total, per_fn = score_rewards(self.rewards, self.weights, [prompt_text(self.tokenizer, r) for r in records],
                                      [c.reply if c.reply is not None else self.reply(c.tokens) for c in completions],
                                      [r.fields for r in records], [r.where for r in records])
        if self.environment is not None:
            env = np.array([c.env_reward or 0.0 for c in completions])
            total, per_fn = total + env, {**per_fn, "environment": env}
        return total, per_fn

    def rollout(self, engine: Engine, records, cfg: Config, *, group_size: int, temperature: float, seed):
        """``group_size`` completions of each record (rows grouped by record): one reply each, or with an
        environment a multi-turn episode each (``k3jax.rl.episodes``); ``seed(row, turn)``."""
        rl = cfg.train.rl
        if self.environment is None:
            prompts = [prompt_ids(self.tokenizer, r) for r in records]
            return sample(engine, prompts, group_size, max_new_tokens=rl.max_new_tokens, temperature=temperature,
                          top_p=rl.top_p, stop_ids=self.stop_ids,
                          seeds=[seed(i, 0) for i in range(len(records) * group_size)])
        return run_episodes(engine, self.tokenizer, records, group_size, self.environment, max_turns=rl.max_turns,
                            row_tokens=min(cfg.train.seq_len + 1, cfg.model.max_seq_len),
                            max_new_tokens=rl.max_new_tokens, temperature=temperature, top_p=rl.top_p,
                            stop_ids=self.stop_ids, seed=seed)


def evaluate(engine: Engine, policy: Policy, prompts, cfg: Config) -> dict[str, float]:
    """Held-out accuracy: one greedy completion of each of the first ``rl.eval_prompts`` held-out prompts;
    the mean of each reward function (``eval/<name>``) and of their weighted total (``eval/reward``)."""
    rl = cfg.train.rl
    records = [prompts[i] for i in range(min(rl.eval_prompts, len(prompts)))]
    completions = policy.rollout(engine, records, cfg, group_size=1, temperature=0.0, seed=lambda row, turn: 0)
    total, per_fn = policy.score(records, completions)
    return {"eval/reward": float(np.mean(total)), **{f"eval/{k}": float(np.mean(v)) for k, v in per_fn.items()}}


def rollout_batch(cfg: Config, policy: Policy, records, completions, rewards: np.ndarray) -> tuple[dict, dict]:
    """The training batch of a rollout (``k3jax.rl.step``'s fields but the scoring forward's) and its
    metrics: rewards shaped by the overlong penalty, group advantages, dynamic sampling's kept groups."""
    rl, m = cfg.train.rl, cfg.model
    preset = objectives.LOSSES[rl.loss]
    lengths = np.array([len(c.tokens) if c.trained is None else int(np.sum(c.trained)) for c in completions])
    shaped = rewards.astype(np.float32)
    if rl.overlong_buffer:
        shaped = shaped + np.asarray(objectives.overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer,
                                                                 rl.overlong_penalty))
    advantages = np.asarray(objectives.group_advantages(shaped, rl.group_size, scale=preset.scale_advantages))
    batch = training_rows(completions, cfg.train.seq_len, m.moe.top_k, len(moe_layers(m)))
    dynamic = rl.dynamic_sampling if rl.dynamic_sampling is not None else rl.loss == "dapo"
    kept = np.ones(rl.prompts_per_step, bool)
    if dynamic:
        kept = np.asarray(objectives.nonzero_variance_groups(shaped, rl.group_size))
        batch["mask"] = batch["mask"] * np.repeat(kept, rl.group_size)[:, None]
    batch["weights"] = np.asarray(objectives.token_weights(batch["mask"], aggregation(cfg), rl.max_new_tokens),
                                  np.float32)
    batch["advantages"] = advantages.astype(np.float32)
    zeros = np.zeros_like(batch["rollout_logp"])
    batch["old_logp"], batch["ref_logp"] = zeros, zeros
    metrics = {"reward_mean": float(np.mean(rewards)), "reward_std": float(np.std(rewards)),
               "response_length": float(np.mean(lengths)),
               "truncation_rate": float(np.mean([c.truncated for c in completions])),
               "kept_groups": float(np.mean(kept))}
    return batch, metrics


def train_rl(cfg: Config, *, fresh: bool = False, reschedule: bool = False) -> dict:
    """Train (or resume) the RL run ``cfg`` in its run directory; returns the last step's metrics record,
    the held-out accuracy before (``eval_before``) and after (``eval_after``) and ``interrupted`` (the
    signal's name when stopped by one after saving, else None). On the mesh ``cfg.mesh`` over all devices of
    all processes; every process samples and scores the whole rollout (module docstring)."""
    cfg.validate()
    if cfg.train.rl.rollout_layout == "serving" and jax.process_count() > 1:
        raise ConfigError("train.rl.rollout_layout: serving runs on one process for now (its per-step copy of the "
                          "weights does not yet run across processes); use training")
    out = storage.path(cfg.train.out_dir)
    with open_run_dir(out, fresh=fresh):
        mesh = make_mesh(cfg.mesh)
        with use_mesh(mesh):
            return _train_rl(cfg, mesh, out, reschedule)


def _train_rl(cfg: Config, mesh, out, reschedule: bool) -> dict:
    tc, rl = cfg.train, cfg.train.rl
    main_process = distributed.is_main_process()
    tokenizer = load_tokenizer(tc.data.tokenizer)
    policy = Policy(cfg, tokenizer)
    train_prompts = open_prompts(rl.prompts, split="train", eval_fraction=rl.eval_fraction, pattern=rl.prompt_pattern)
    eval_prompts = (open_prompts(rl.prompts, split="eval", eval_fraction=rl.eval_fraction, pattern=rl.prompt_pattern)
                    if rl.eval_fraction else None)
    iterator = PromptIterator(train_prompts, rl.prompts_per_step, seed=tc.seed)
    position = PromptState(iterator)
    mngr = checkpoint.manager(out / "checkpoints", max_to_keep=tc.keep_checkpoints,
                              item_names=checkpoint.train_items(cfg))
    ts, start, base = start_state(cfg, mesh, mngr, out / "checkpoints", position, reschedule=reschedule)
    if main_process:
        storage.write_text(out / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    graphdef, state = nnx.split(ts)
    state = ready_state(state, mesh)
    # a full fine-tune's KL reference: its step-0 weights, also on resume (k3jax.rl.reference); else None
    reference = reference_weights(cfg, base, nnx.state(nnx.merge(graphdef, state).model), mesh)
    # The engine decodes on the training mesh from the trainer's arrays (scanned layers): in the serving layout a
    # copy made once per step (no weight moves in its decode steps), in the training layout the arrays themselves.
    # Multi-turn: each turn resumes from its history's cached blocks (k3jax.rl.episodes)
    max_len = min(tc.seq_len + 1, cfg.model.max_seq_len)
    cache_tokens = (0 if policy.environment is None else
                    rl.rows * max_len if rl.prefix_cache_tokens is None else rl.prefix_cache_tokens)
    engine = Engine(nnx.merge(graphdef, state).model, max_batch=rl.rows, max_len=max_len, prefill_batch=rl.rows,
                    mesh=mesh, unroll_layers=False, record_routes=True, layout=rl.rollout_layout,
                    prefix_cache_tokens=cache_tokens)
    engine.release_weights()
    step_fn = make_rl_step(graphdef, cfg, state_shardings=jax.tree.map(lambda x: x.sharding, state))
    score_fn = make_score_fn(graphdef, cfg, reference=reference)
    schedule = learning_rate_schedule(tc.optim, tc.steps)
    log = RunLog(out, step=start, enabled=main_process, config=cfg)
    # several processes: the update compiles everywhere before any runs it (the longest compile)
    step_fn = distributed.compiled_together(step_fn, barrier="k3jax_rl_step_compiled")

    @contextlib.contextmanager
    def engine_on(state):
        """The engine on ``state``'s weights while the body runs (yields the seconds they took to move into its
        layout), then without them: a copy in the serving layout is freed before the update."""
        t = time.perf_counter()
        engine.set_weights(nnx.state(nnx.merge(graphdef, state).model))
        yield time.perf_counter() - t
        engine.release_weights()  # (a failed rollout stops the run: nothing to release)

    result = {"eval_before": None, "eval_after": None, "interrupted": None, "record": {}}
    if start == 0 and eval_prompts is not None:
        with engine_on(state):
            result["eval_before"] = evaluate(engine, policy, eval_prompts, cfg)
        log.write({"step": 0, **result["eval_before"]})
        if main_process:
            tqdm.write(f"held-out reward before RL: {result['eval_before']}")
    step = start
    bar = tqdm(total=tc.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True, disable=not main_process)
    saver = checkpoint.Saver(mngr, cfg, graphdef, position, base)
    replay = replays(cfg)
    profiler = StepProfiler(tc.profile, out)  # traces whole RL steps: rollout, scoring and updates
    with closed_on_failure(bar, log, profiler, mngr), StopRequest() as stop:
        stop_signal = distributed.agreed_stop(stop.signum)
        while step < tc.steps and not stop_signal:
            profiler.before(step + 1)
            record = {}
            prefilled, cached = engine.metrics.prefill_tokens, engine.metrics.prefix_hit_tokens
            with engine_on(state) as transfer_s:
                t0 = time.perf_counter()
                records = next(iterator)
                completions = policy.rollout(engine, records, cfg, group_size=rl.group_size,
                                             temperature=rl.temperature,
                                             seed=lambda row, turn, step=step: rollout_seed(tc.seed, step, row, turn))
                t1 = time.perf_counter()
            group_records = [r for r in records for _ in range(rl.group_size)]
            rewards, per_fn = policy.score(group_records, completions)
            batch, record = rollout_batch(cfg, policy, group_records, completions, rewards)
            record.update({f"reward/{k}": float(np.mean(v)) for k, v in per_fn.items()})
            # prompt tokens the rollout ran, and those a turn resumed from the prefix cache instead
            record["rollout/prefilled_tokens"] = engine.metrics.prefill_tokens - prefilled
            record["rollout/cached_tokens"] = engine.metrics.prefix_hit_tokens - cached
            check_same_rollout(step + 1, batch["tokens"], batch["rollout_logp"], rewards)
            t2 = time.perf_counter()
            # each process reads the whole of every output (gathered from the other processes' devices)
            scored = multihost_utils.process_allgather(score_fn(state, place_batch(batch, mesh)), tiled=True)
            record.update({f"mismatch/{k}": v for k, v in
                           logprob_mismatch(batch["rollout_logp"], scored["logp"], batch["mask"]).items()})
            if "free_logp" in scored:
                record.update({f"mismatch_without_replay/{k}": v for k, v in
                               logprob_mismatch(batch["rollout_logp"], scored["free_logp"], batch["mask"]).items()})
                record["mismatch_without_replay/routing"] = routing_disagreement(
                    batch["routes"], scored["free_routes"], batch["segment_ids"])
            if rl.updates_per_rollout > 1:
                batch["old_logp"] = scored["logp"]
            if rl.beta > 0:
                batch["ref_logp"] = scored["ref_logp"]
            if not replay:
                del batch["routes"]
            t3 = time.perf_counter()
            device_batch = place_batch(batch, mesh)
            for _ in range(rl.updates_per_rollout):
                state, metrics = step_fn(state, device_batch)
                step += 1
                bar.update(1)
                stop_signal = distributed.agreed_stop(stop.signum)  # every process stops after this update
                if step >= tc.steps or stop_signal:
                    break
            metrics = jax.device_get(metrics)
            t4 = time.perf_counter()
            profiler.after(step, state)
            tokens = max(float(metrics["tokens"]), 1.0)
            generated = sum(int(np.sum(c.trained)) if c.trained is not None else len(c.tokens)
                            for c in completions)
            record.update({
                "step": step, "loss": float(metrics["loss"]), "lr": float(schedule(step - 1)),
                "grad_norm": float(metrics["grad_norm"]),
                # no group with reward variance (and no KL): nothing to learn, the weights were kept
                "update_skipped": float(metrics["zero_gradient"]),
                "clip_fraction": float(metrics["clipped_low"] + metrics["clipped_high"]) / tokens,
                **{name: float(metrics[name]) / tokens for name in TOKEN_SUMS},
                "rollout_tokens_per_s": generated / max(t1 - t0, 1e-9),
                "train_tokens_per_s": float(np.sum(batch["segment_ids"])) * rl.updates_per_rollout / max(t4 - t3, 1e-9),
                "time/rollout_s": t1 - t0, "time/reward_s": t2 - t1, "time/score_s": t3 - t2,
                "time/train_s": t4 - t3, "time/weights_transfer_s": transfer_s})
            log.write(record)
            result["record"] = record
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}")
            if rl.eval_every and step % rl.eval_every == 0 and step < tc.steps and eval_prompts is not None:
                with engine_on(state):
                    log.write({"step": step, **evaluate(engine, policy, eval_prompts, cfg)})
            if step % tc.checkpoint_every == 0 or step == tc.steps or stop_signal:
                saver.save(step, state)
        profiler.close()
        saver.wait()
    bar.close()
    mngr.close()
    if step < tc.steps:
        log.close()
        result["interrupted"] = signal.Signals(stop_signal).name
        if main_process:
            tqdm.write(f"{result['interrupted']}: stopped at step {step}; checkpoint saved. Run the same command to "
                       f"resume.")
        return result
    if eval_prompts is not None:
        with engine_on(state):
            result["eval_after"] = evaluate(engine, policy, eval_prompts, cfg)
        log.write({"step": step, **result["eval_after"]})
        if main_process:
            tqdm.write(f"held-out reward after RL: {result['eval_after']}")
    log.close()
    if main_process:
        plot_losses(out)
        print(f"step {step}: reward {result['record'].get('reward_mean', float('nan')):.4f}; metrics in "
              f"{out / 'metrics.jsonl'}", flush=True)
    return result


__all__ = ["PromptState", "evaluate", "train_rl"]

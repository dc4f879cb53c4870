"""Train a k3jax model: ``python train.py [--config NAME_OR_PATH] [key=value ...]``.

With no arguments this is the CPU demo: the ``tiny`` K3 (every K3 mechanism at toy width) trained
on the bundled King James Bible slice with a byte-level tokenizer, checkpointed under
``runs/default``, then sampled. Re-running resumes from the latest checkpoint of the same
``train.out_dir`` (pass ``--fresh`` to start over).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from flax import nnx

from k3jax import checkpoint
from k3jax.config import Config, load_config, to_dict
from k3jax.data.pipeline import make_train_dataset
from k3jax.data.tokenizers import load_tokenizer
from k3jax.generate import generate
from k3jax.model import create_model
from k3jax.optim import learning_rate_schedule, make_optimizer
from k3jax.training import TrainState, make_eval_step, make_train_step

DEMO_PROMPT = "In the beginning"


def _log(record: dict, sink) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    sink.write(line + "\n")
    sink.flush()


def _evaluate(eval_step, state, eval_iter, num_batches: int) -> float:
    nll = count = 0.0
    for _ in range(num_batches):
        try:
            batch = next(eval_iter)
        except StopIteration:
            break
        n, c = eval_step(state, batch)
        nll, count = nll + float(n), count + float(c)
    return nll / max(count, 1.0)


def train(cfg: Config, *, fresh: bool = False, sample_tokens: int = 200) -> dict:
    tc = cfg.train
    out = pathlib.Path(tc.out_dir)
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    tokenizer = load_tokenizer(tc.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer {tc.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
                         f"model.vocab_size={cfg.model.vocab_size}")
    train_ds = make_train_dataset(tc, tokenizer, split="train", process_index=jax.process_index(),
                                  process_count=jax.process_count())
    train_iter = iter(train_ds)

    model = create_model(cfg.model, seed=tc.seed)
    with nnx.use_eager_sharding(False):
        ts = TrainState(model, make_optimizer(tc.optim, model, tc.steps))
    graphdef, state = nnx.split(ts)
    schedule = learning_rate_schedule(tc.optim, tc.steps)

    mngr = checkpoint.manager(out / "checkpoints", max_to_keep=tc.keep_checkpoints,
                              item_names=("config", "model", "optimizer", "data"))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.state(ts.model)),
            optimizer=ocp.args.StandardRestore(nnx.state(ts.optimizer)),
            data=_grain_restore(train_iter)))
        nnx.update(ts.model, restored["model"])
        nnx.update(ts.optimizer, restored["optimizer"])
        graphdef, state = nnx.split(ts)
        print(f"resumed from {out / 'checkpoints'} at step {start}", flush=True)

    step_fn = make_train_step(graphdef, cfg)
    metrics_file = open(out / "metrics.jsonl", "a")
    t0, tokens_seen, loss = time.time(), 0.0, float("nan")
    for step in range(start, tc.steps):
        batch = next(train_iter)
        state, metrics = step_fn(state, batch)
        tokens_seen += float(metrics["tokens"])
        if not bool(metrics["finite"]):
            print(f"step {step + 1}: non-finite loss or gradient; update skipped", flush=True)
        if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
            loss = float(metrics["loss"])
            dt = time.time() - t0
            _log({"step": step + 1, "loss": round(loss, 4), "grad_norm": round(float(metrics["grad_norm"]), 4),
                  "lr": float(schedule(step)), "tokens_per_s": round(tokens_seen / dt, 1)}, metrics_file)
            t0, tokens_seen = time.time(), 0.0
        if (step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps:
            ts = nnx.merge(graphdef, state)
            mngr.save(step + 1, args=ocp.args.Composite(
                config=ocp.args.JsonSave(to_dict(cfg)), model=ocp.args.StandardSave(nnx.state(ts.model)),
                optimizer=ocp.args.StandardSave(nnx.state(ts.optimizer)), data=_grain_save(train_iter)))
    mngr.wait_until_finished()
    mngr.close()

    eval_iter = iter(make_train_dataset(tc, tokenizer, split="eval"))
    eval_loss = _evaluate(make_eval_step(graphdef, cfg), state, eval_iter, num_batches=4)
    _log({"step": tc.steps, "eval_loss": round(eval_loss, 4)}, metrics_file)
    metrics_file.close()

    model = nnx.merge(graphdef, state).model
    sample = ""
    if sample_tokens:
        prompt = np.asarray([tokenizer.encode(DEMO_PROMPT)], np.int32)
        stops = (tokenizer.eos_id,) if tokenizer.eos_id is not None else ()
        out_tokens = generate(model, prompt, min(sample_tokens, cfg.model.max_seq_len - prompt.shape[1]),
                              temperature=0.0, stop_tokens=stops)
        sample = tokenizer.decode([int(t) for t in np.asarray(out_tokens[0])])
        print(f"\n--- sample (greedy) ---\n{sample}\n", flush=True)
    return {"loss": loss, "eval_loss": eval_loss, "sample": sample}


def _grain_save(it):
    import grain

    return grain.checkpoint.CheckpointSave(it)


def _grain_restore(it):
    import grain

    return grain.checkpoint.CheckpointRestore(it)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="config name (configs/<name>.yaml) or YAML path")
    ap.add_argument("--fresh", action="store_true", help="delete train.out_dir first instead of resuming")
    ap.add_argument("--sample-tokens", type=int, default=200, help="tokens to sample after training (0: none)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. train.steps=50")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if jax.default_backend() == "cpu":
        # XLA:CPU spends minutes optimising the train step of even the tiny model; CPU runs are
        # demos and tests, so trade run-time speed for a several-fold faster compile.
        jax.config.update("jax_disable_most_optimizations", True)
    print(f"k3jax: training {cfg.name!r} on {jax.device_count()} {jax.devices()[0].platform} device(s); "
          f"out_dir={cfg.train.out_dir}", flush=True)
    train(cfg, fresh=args.fresh, sample_tokens=args.sample_tokens)


if __name__ == "__main__":
    sys.exit(main())

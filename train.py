"""Train a k3jax model: ``python train.py [--config NAME_OR_PATH] [key=value ...]``.

With no arguments this is the CPU demo: the ``tiny`` K3 (every K3 mechanism at toy width) trained
on the bundled King James Bible slice with a byte-level tokenizer, checkpointed under
``runs/default``, then sampled. Re-running resumes from the latest checkpoint of the same run
directory (``run_dir=...``, an alias of ``train.out_dir=...``; pass ``--fresh`` to start over).
Ctrl-C or SIGTERM (a preempted spot VM, a Kubernetes eviction) finishes the current step, saves a
checkpoint and exits; the same command resumes. ``run_dir`` and ``train.data.source`` may be URLs
(``gs://bucket/run``; ``k3jax/runtime/storage.py``).
The training loop itself is ``k3jax.training.trainer.train``; this file is its command line.

``--config DIR`` fine-tunes a model directory without a config written for it: a Hugging Face model
(K3, Kimi K2 / DeepSeek-V3 layout, Kimi Linear) or a k3jax run or checkpoint directory gives the model
section, ``train.init_from`` is DIR and the run goes to ``runs/<DIR's name>-finetune``; the rest is the
defaults, overrides on top (``k3jax/interop/model_dir.py``).

The run directory receives ``config.yaml``, ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``
and, at the end, ``loss.png`` (``k3jax/training/run_log.py``); ``train.lock`` keeps a second process out.

Exit codes: 0 done, 1 the run could not start or resume (directory in use, checkpoint, a
``train.steps`` change that moves the learning rate: ``--reschedule``), 2 bad arguments or config,
3 stopped by a fault while training, the previous checkpoint intact (a checkpoint save that failed, a bad
data record under ``train.data.bad_records=stop``, a reward function that raised or returned a non-number (RL;
on several hosts the other processes stop with process 0's error), processes whose RL rollouts differ,
``train.max_nonfinite_steps`` skipped updates in a row), 130 stopped by Ctrl-C after saving, 143 stopped by
SIGTERM after saving (128 + 15, what a terminated process reports; a job controller that restarts failed pods
reruns the command, which resumes).
"""

from __future__ import annotations

import argparse
import sys

import k3jax  # noqa: F401 (first: with K3JAX_HOST_MEMORY=keep it sets up host memory before jax starts threads)

import jax

from k3jax.runtime import compile_cache, distributed
from k3jax.training import checkpoint
from k3jax.config import ConfigError, load_config
from k3jax.data.sources import BadRecordError
from k3jax.rl.agreement import RolloutDivergenceError
from k3jax.rl.rewards import RewardError
from k3jax.training.run_lock import RunLockedError
from k3jax.sharding import make_mesh
from k3jax.training.trainer import DivergenceError, ScheduleChangeError, train

EXIT_FAILED = 1  # the run could not start or resume (locked directory, checkpoint, schedule)
EXIT_USAGE = 2  # bad arguments or config (argparse's code)
EXIT_FAULT = 3  # stopped while training: a failed save, a bad record, a diverged run (checkpoint intact)
EXIT_INTERRUPTED = 130  # the shell's code for "stopped by SIGINT"
EXIT_PREEMPTED = 143  # the shell's code for "stopped by SIGTERM": a preempted or evicted run, saved
EXIT_SIGNAL = {"SIGINT": EXIT_INTERRUPTED, "SIGTERM": EXIT_PREEMPTED}


def _expand_aliases(overrides: list[str]) -> list[str]:
    return [f"train.out_dir={o.split('=', 1)[1]}" if o.startswith("run_dir=") else o for o in overrides]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", help="config name (configs/<name>.yaml), YAML path, or a model "
                    "directory to fine-tune (a Hugging Face model, a k3jax run or checkpoint directory)")
    ap.add_argument("--fresh", action="store_true", help="delete the run directory first instead of resuming")
    ap.add_argument("--reschedule", action="store_true",
                    help="on resume, accept the learning-rate jump of a changed train.steps (the schedule is "
                    "recomputed over the new length; without this flag such a resume is refused)")
    ap.add_argument("--sample-tokens", type=int, default=200, help="tokens to sample after training (0: none)")
    ap.add_argument("--distributed", choices=distributed.MODES, default="auto",
                    help="multi-host start-up (jax.distributed.initialize): auto = when the environment "
                    "describes a multi-process job (k3jax/runtime/distributed.py)")
    ap.add_argument("--compile-cache", metavar="DIR", default=None,
                    help=f"persistent XLA compilation cache directory, or 'off' (default: ${compile_cache.ENV_VAR}, "
                    "else ~/.cache/k3jax/jax; k3jax/runtime/compile_cache.py)")
    ap.add_argument("overrides", nargs="*",
                    help="dotted key=value config overrides, e.g. train.steps=50 run_dir=runs/exp1")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, _expand_aliases(args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    compile_cache.enable(args.compile_cache)
    distributed.initialize(args.distributed)
    try:
        axes = {k: v for k, v in make_mesh(cfg.mesh).shape.items() if v > 1}
    except ValueError as e:  # a mesh that does not fit the devices
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if distributed.is_main_process():
        print(f"k3jax: training {cfg.name!r} on {jax.device_count()} {jax.devices()[0].platform} device(s)"
              f"{f' (mesh {axes})' if axes else ''}, {jax.process_count()} process(es); run_dir={cfg.train.out_dir}",
              flush=True)
    try:
        if cfg.train.rl.enabled:  # reinforcement learning: the batches are the model's own rollouts (k3jax/rl)
            from k3jax.rl.trainer import train_rl

            result = train_rl(cfg, fresh=args.fresh, reschedule=args.reschedule)
        else:
            result = train(cfg, fresh=args.fresh, reschedule=args.reschedule, sample_tokens=args.sample_tokens)
    except (checkpoint.CheckpointError, RunLockedError, ScheduleChangeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (checkpoint.CheckpointSaveError, BadRecordError, DivergenceError, RewardError, RolloutDivergenceError,
            distributed.MainProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAULT
    return EXIT_SIGNAL[result["interrupted"]] if result["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())

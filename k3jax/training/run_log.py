"""What a training run leaves in its run directory: ``metrics.jsonl``, TensorBoard events, ``loss.png``;
and, with ``train.wandb`` on, the same scalars in a Weights & Biases run (``k3jax/training/wandb_log.py``).

``metrics.jsonl`` holds one JSON object per logged step (``step``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``expert_imbalance`` = ``{layer: max/mean expert load}``, ...) and one per
evaluation (``step``, ``eval_loss``). A resumed run appends after dropping the records of steps past
the one it resumed from (logged after the last checkpoint of a killed run, or by a continuation that
was rolled back by deleting its checkpoints); TensorBoard hides its events of those steps.

The run directory may be a URL (``gs://bucket/run``, ``k3jax.runtime.storage``): an object store has no appends, so
there ``metrics.jsonl`` and the event files are rewritten whole at each flush (every logged record).
"""

from __future__ import annotations

import io
import json
import pathlib
import sys
from typing import Any

from k3jax.config import Config
from k3jax.runtime import storage
from k3jax.training.wandb_log import WandbRun

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
LOSS_PLOT = "loss.png"


class RunLog:
    """Appends records to ``metrics.jsonl`` and mirrors their scalars to TensorBoard and W&B."""

    def __init__(self, run_dir: str | pathlib.Path, *, step: int, tensorboard: bool = True,
                 enabled: bool = True, config: Config | None = None):
        """``step``: the step the run starts from; records of later steps are dropped (their number is
        ``rolled_back``) and ``loss.png``, if there is one, is redrawn from what remains.
        ``enabled=False``: write nothing (every process but the first of a multi-host run).
        ``config``: the run's config; with ``train.wandb`` on, the records go to its W&B run too."""
        self.run_dir = storage.path(run_dir)
        self.rolled_back = _drop_records_after(self.run_dir, step) if enabled else 0
        if self.rolled_back and (self.run_dir / LOSS_PLOT).exists():
            plot_losses(self.run_dir)
        self._jsonl = storage.open_for_append(self.run_dir / METRICS_FILE) if enabled else None
        self._tb = None
        if tensorboard and enabled:
            SummaryWriter = _summary_writer()
            storage.register_tensorboard(self.run_dir)
            # purge_step: TensorBoard hides the events of steps >= it written before this writer
            self._tb = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR),
                                     purge_step=step + 1 if self.rolled_back else None)
        self._wandb = None
        if enabled and config is not None and config.train.wandb.enabled:
            self._wandb = WandbRun(self.run_dir, config)

    def write(self, record: dict[str, Any]) -> None:
        if self._jsonl is None:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        scalars = dict(_scalars(record))
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, record["step"])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, record["step"])

    def roll_back(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a run that went back to its checkpoint ``step``)."""
        if self._jsonl is None:
            return
        self._jsonl.close()
        _drop_records_after(self.run_dir, step)
        self._jsonl = storage.open_for_append(self.run_dir / METRICS_FILE)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        self._jsonl = self._tb = self._wandb = None


def _summary_writer():
    """``tensorboardX.SummaryWriter``, imported here (a heavy import only the trainer needs) and without
    torch: ``tensorboardX.writer`` imports torch where it is installed, only to accept torch tensors,
    which cost every training start 2.6 s (a third of the import of JAX and k3jax); the run log writes
    Python floats. A process that already imported torch keeps it."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _drop_records_after(run_dir, step: int) -> int:
    """Rewrite ``metrics.jsonl`` without the records of steps after ``step``; returns how many."""
    path = run_dir / METRICS_FILE
    if not path.exists():
        return 0
    lines = [line for line in storage.read_text(path).splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        # atomic: a crash leaves the old or the new file, never half of one
        storage.write_text(path, "".join(line + "\n" for line in kept))
    return len(lines) - len(kept)


def _scalars(record: dict[str, Any], prefix: str = ""):
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/layer_")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``, one per (step, kind), the latest kept, sorted by step."""
    latest: dict[tuple[int, bool], dict] = {}
    path = storage.path(run_dir) / METRICS_FILE
    for line in storage.read_text(path).splitlines() if path.exists() else ():
        rec = json.loads(line)
        latest[(rec["step"], "eval_loss" in rec)] = rec
    return [latest[k] for k in sorted(latest)]


def plot_losses(run_dir: str | pathlib.Path) -> pathlib.Path | None:
    """Write ``loss.png`` (train loss per logged step, eval loss as points); None if nothing to plot."""
    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(storage.path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = storage.path(run_dir) / LOSS_PLOT
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes(out, png.getvalue())
    return out


__all__ = ["LOSS_PLOT", "METRICS_FILE", "RunLog", "TENSORBOARD_DIR", "plot_losses", "read_metrics"]

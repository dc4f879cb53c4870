"""A ``jax.profiler`` trace of a few training steps (``train.profile``): steps ``first_step`` to
``first_step + steps - 1`` (counted from 1, as ``metrics.jsonl``'s ``step``), written to
``<run_dir>/profile/plugins/profile/<time>/<host>.xplane.pb``: ``tensorboard --logdir <run_dir>/profile``
shows it in the profile plugin, and XProf / Perfetto open the file. Every process traces its own devices.

The trace stops after the last traced step's outputs are ready (JAX dispatches asynchronously: without
the wait the trace would end before the device work it launched). A run resumed inside the window traces
the window's remaining steps; one resumed past it traces nothing.
"""

from __future__ import annotations

import jax
from tqdm import tqdm

from k3jax.config import ProfileConfig
from k3jax.runtime import distributed, storage

PROFILE_DIR = "profile"


class StepProfiler:
    """Call :meth:`before` with the number of the step about to run, :meth:`after` once it has run (with
    its outputs) and :meth:`close` when the loop ends, however it ends. One trace per run (a rollback to
    an earlier checkpoint does not trace its window again)."""

    def __init__(self, cfg: ProfileConfig, run_dir):
        self.first, self.last = cfg.first_step, cfg.first_step + cfg.steps - 1
        self.pending = cfg.enabled  # a trace still to take
        self.directory = str(storage.path(run_dir) / PROFILE_DIR)
        self.started: int | None = None  # the first traced step, while tracing

    def before(self, step: int) -> None:
        if self.pending and self.first <= step <= self.last:
            jax.profiler.start_trace(self.directory)
            self.pending, self.started = False, step

    def after(self, step: int, outputs) -> None:
        """``step``: the step that has just run (an RL rollout's updates may pass several at once)."""
        if self.started is not None and step >= self.last:
            jax.block_until_ready(outputs)
            self._stop(f"steps {self.started}-{step}")

    def close(self) -> None:
        """End a trace the loop left running (a run stopped inside the window)."""
        if self.started is not None:
            self._stop(f"steps from {self.started}")

    def _stop(self, what: str) -> None:
        jax.profiler.stop_trace()
        self.started = None
        if distributed.is_main_process():
            tqdm.write(f"profile of {what} written to {self.directory} (tensorboard --logdir {self.directory})")


__all__ = ["PROFILE_DIR", "StepProfiler"]

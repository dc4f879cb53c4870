"""Stopping a run between steps: the first SIGINT / SIGTERM asks the training loop (pre-training, fine-tuning,
reinforcement learning) to finish its step and save a checkpoint; a second one interrupts at once."""

from __future__ import annotations

import contextlib
import signal
import threading

from tqdm import tqdm

# The signals that stop a run at the next step boundary with a checkpoint: Ctrl-C, and what a preempted
# Cloud TPU spot VM or a Kubernetes eviction sends (about 30 s before SIGKILL).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest(contextlib.AbstractContextManager):
    """Turns the first SIGINT / SIGTERM into a request honoured between steps (so the state is never
    caught half-donated); a second one interrupts at once."""

    def __init__(self):
        self.signum = 0  # the signal's number once requested
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        tqdm.write(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (send it again "
                   f"to abort)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)


__all__ = ["STOP_SIGNALS", "StopRequest"]

"""``jax.profiler`` traces of the serving engine's next N steps (``infer.py --serve --profile-steps N``,
``POST /start_profile``): viewable in TensorBoard's profile plugin or Perfetto, each trace in a timestamped
``plugins/profile/<time>/`` directory of the profile directory, its ``*.xplane.pb`` naming the engine's
programs (``jit_decode``, ``jit_prefill``, ...).

A step is one iteration of the engine's loop (a prefill piece and / or a decode step queued, the previous
step's tokens read). The trace starts on the engine thread before the first of the N iterations and stops
after the last (the decode step that one queued may still be running on the device: its end is cut off);
an idle engine runs none, so a scheduled trace waits for requests. Only this process is traced (process 0 of a multi-host server: the one that serves the API).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import threading

import jax

log = logging.getLogger(__name__)


class StepProfiler:
    """Traces of the engine's steps into ``directory``: :meth:`schedule` asks for the next ``steps``;
    :meth:`step` wraps each engine iteration (``Engine.step_scope``)."""

    def __init__(self, directory: str | pathlib.Path):
        self.directory = pathlib.Path(directory)
        self._lock = threading.Lock()
        self._scheduled = 0  # steps asked for, not started
        self._left = 0  # steps left in the running trace
        self._tracing = False  # jax.profiler's trace is on
        self._before: set = set()  # the xplane files there before the running trace
        self.traces: list[str] = []  # the xplane files written so far

    @property
    def state(self) -> str:
        """``idle``, ``scheduled`` (waiting for the engine's next step) or ``tracing``."""
        with self._lock:
            return "tracing" if self._left or self._tracing else "scheduled" if self._scheduled else "idle"

    def schedule(self, steps: int) -> None:
        """Trace the engine's next ``steps`` steps (ValueError: not >= 1; RuntimeError: a trace is already
        scheduled or running)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        with self._lock:
            if self._scheduled or self._left or self._tracing:
                raise RuntimeError("a profile is already scheduled or running")
            self._scheduled = steps

    @contextlib.contextmanager
    def step(self):
        """One engine iteration: starts a scheduled trace before it, stops the trace after its last step. A
        profiler that fails (another trace running, an unwritable directory) logs it and leaves the step alone."""
        with self._lock:
            start, self._scheduled = self._scheduled, 0
            if start:
                self._left = start
        if start and not self._start(start):
            with self._lock:
                self._left = 0
        try:
            yield
        finally:
            with self._lock:
                if self._left:
                    self._left -= 1
                stop = self._left == 0 and self._tracing
            if stop:
                self._stop()

    def _start(self, steps: int) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._before = set(self.directory.glob("plugins/profile/*/*.xplane.pb"))
            jax.profiler.start_trace(str(self.directory))
        except Exception:
            log.exception("profiling the engine's steps failed to start")
            return False
        with self._lock:
            self._tracing = True
        log.info("profiling the next %d engine steps into %s", steps, self.directory)
        return True

    def _stop(self) -> None:
        try:
            jax.profiler.stop_trace()
        except Exception:
            log.exception("profiling the engine's steps failed to stop")
        written = sorted(str(p) for p in set(self.directory.glob("plugins/profile/*/*.xplane.pb")) - self._before)
        with self._lock:
            self.traces += written
            self._tracing = False
        log.info("profile written: %s", ", ".join(written) or self.directory)

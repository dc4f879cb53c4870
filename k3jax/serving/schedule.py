"""What the engine's step loop takes in at the start of each iteration, and where it comes from.

The engine (``k3jax.serving.engine``) is a deterministic function of what it is told: the requests
admitted (prompt token ids, sampling parameters with their seed drawn), the requests cancelled (and
why), and when to stop. Given the same of these at the same iterations, every process makes the same
decisions (which prompts prefill together in which pieces, which pool rows they take, which rows each
decode step runs, when the slots move, which rows free), and the tokens that end a request (stop
tokens, ``max_tokens``) are read from the same replicated device outputs. So a schedule is those
events, and the step programs follow from it.

- :class:`LocalScheduler` (one process): the requests submitted and cancelled since the last
  iteration, waiting for one when the engine is idle.
- :class:`LeaderScheduler` (process 0 of several, the one that takes the HTTP requests): the same,
  encoded as int32 arrays and broadcast to the other processes every iteration
  (``multihost_utils.broadcast_one_to_all``: a fixed-size header, then the events padded to a power of
  two, so each size compiles once). Idle, it still broadcasts an empty schedule every ``idle_sync_s``,
  so no process waits in one collective for long and a lost process is noticed while idle too.
- :class:`FollowerScheduler` (every other process): receives them and runs the same iteration on mirror
  requests that report to nobody.

The header also carries process 0's digest of the engine's state (its rows' requests, the pool's write
position, the queue) after the previous iteration; a follower whose own digest differs stops with an
error naming both, instead of running other programs than process 0 (which would hang the slice).

Several processes cannot survive a failed step (a lost process, a collective that failed): the
requests in flight end with an error and the process exits (:meth:`failed`), so the job stops instead
of hanging. One process fails the requests in flight and keeps serving.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import zlib

import numpy as np

from k3jax.serving.request import SamplingParams, Sequence

# Why a request is cancelled (``Engine.cancel``), as sent on the wire.
CANCEL_REASONS = ("cancelled", "stop", "abort", "error", "length")
_HEADER = 6  # int32s: tag, stop, admitted, cancelled, payload length, digest
_TAG = 0x4B33_5331  # "K3S1": a header from this protocol version
_MIN_PAYLOAD = 256  # int32s: the smallest payload bucket
FAILED_EXIT_CODE = 3  # a process of a multi-process server that stopped because a step failed
FAILURE_GRACE_S = 1.0  # the failed requests' error replies are sent before the process exits
IDLE_SYNC_S = 1.0  # an idle leader's broadcast interval: a lost process is noticed within it


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One iteration's input: requests to queue (arrival order), ``(request id, reason)`` cancellations,
    and whether to stop."""
    admitted: tuple = ()
    cancelled: tuple[tuple[int, str], ...] = ()
    stop: bool = False


class LocalScheduler:
    """One process: the events of the requests submitted and cancelled by other threads (module
    docstring)."""

    fatal = False  # a failed step fails the requests in flight; the engine keeps serving

    def __init__(self):
        self._cond = threading.Condition()
        self._admitted: list[Sequence] = []
        self._cancelled: list[tuple[int, str]] = []
        self.stopping = False

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self.stopping:
                raise RuntimeError("the engine is stopped")
            self._admitted.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence, reason: str) -> None:
        if reason not in CANCEL_REASONS:
            raise ValueError(f"cancel reason must be one of {CANCEL_REASONS}, got {reason!r}")
        with self._cond:
            self._cancelled.append((seq.id, reason))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify()

    def pending(self) -> int:
        """Requests submitted that the engine has not taken yet."""
        return len(self._admitted)

    def _take(self, busy: bool, wait_s: float | None) -> Schedule:
        with self._cond:
            if not busy:
                self._cond.wait_for(lambda: self._admitted or self._cancelled or self.stopping, wait_s)
            out = Schedule(tuple(self._admitted), tuple(self._cancelled), self.stopping)
            self._admitted, self._cancelled = [], []
            return out

    def next(self, busy: bool, digest: int) -> Schedule:
        """This iteration's schedule; when the engine is not ``busy``, wait for something to do."""
        return self._take(busy, None)

    def failed(self, error: BaseException) -> None:
        """A step failed (after the engine has failed its requests in flight)."""

    def close(self) -> None:
        """The loop has stopped (after the schedule that said so)."""


def state_digest(*parts) -> int:
    """A 31-bit digest of the engine's host state (integers and lists of them)."""
    flat = np.asarray([x for p in parts for x in (p if isinstance(p, (list, tuple)) else [p])], np.int64)
    return zlib.crc32(flat.tobytes()) & 0x7FFF_FFFF


def encode(schedule: Schedule, digest: int) -> tuple[np.ndarray, np.ndarray]:
    """``(header int32 [6], payload int32 [2^k >= 256] or [0])`` of a schedule. Per admitted request: id,
    prompt length, max_tokens, temperature and top_p (float32 bits), seed (uint32 bits), logprobs (-1:
    none), prompt_logprobs, the number of stop ids, the stop ids, the prompt; per cancellation: id and
    the reason's index in ``CANCEL_REASONS``."""
    words: list[int] = []
    for seq in schedule.admitted:
        p = seq.params
        floats = np.asarray([p.temperature, p.top_p], np.float32).view(np.int32)
        words += [seq.id, len(seq.prompt), p.max_tokens, int(floats[0]), int(floats[1]),
                  int(np.uint32(seq.seed % 2**32).view(np.int32)), -1 if p.logprobs is None else p.logprobs,
                  int(p.prompt_logprobs), len(p.stop_ids), *p.stop_ids, *seq.prompt]
    for rid, reason in schedule.cancelled:
        words += [rid, CANCEL_REASONS.index(reason)]
    header = np.asarray([_TAG, int(schedule.stop), len(schedule.admitted), len(schedule.cancelled), len(words),
                         digest], np.int32)
    if not words:
        return header, np.zeros(0, np.int32)
    payload = np.zeros(max(_MIN_PAYLOAD, 1 << (len(words) - 1).bit_length()), np.int32)
    payload[:len(words)] = words
    return header, payload


def payload_size(header: np.ndarray) -> int:
    """The padded payload length that follows ``header`` (0: none)."""
    n = int(header[4])
    return 0 if n == 0 else max(_MIN_PAYLOAD, 1 << (n - 1).bit_length())


def decode(header: np.ndarray, payload: np.ndarray, make_sequence) -> tuple[Schedule, int]:
    """``encode``'s inverse: (schedule, the sender's digest); ``make_sequence(id, prompt, params, seed)``
    builds each admitted request."""
    if int(header[0]) != _TAG:
        raise RuntimeError(f"a schedule header without this protocol's tag ({int(header[0]):#x}): the processes "
                           f"run different k3jax versions?")
    stop, n_admitted, n_cancelled, _, digest = (int(v) for v in header[1:6])
    words, at = payload.tolist(), 0
    admitted = []
    for _ in range(n_admitted):
        rid, n, max_tokens, t_bits, p_bits, seed_bits, logprobs, prompt_lp, n_stop = words[at:at + 9]
        at += 9
        stops = tuple(words[at:at + n_stop])
        at += n_stop
        prompt = words[at:at + n]
        at += n
        temperature, top_p = (float(v) for v in np.asarray([t_bits, p_bits], np.int32).view(np.float32))
        seed = int(np.int32(seed_bits).view(np.uint32))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop_ids=stops, logprobs=None if logprobs < 0 else logprobs,
                                prompt_logprobs=bool(prompt_lp))
        admitted.append(make_sequence(rid, prompt, params, seed))
    cancelled = []
    for _ in range(n_cancelled):
        rid, reason = words[at:at + 2]
        at += 2
        cancelled.append((rid, CANCEL_REASONS[reason]))
    return Schedule(tuple(admitted), tuple(cancelled), bool(stop)), digest


def _broadcast(header: np.ndarray, payload_for) -> tuple[np.ndarray, np.ndarray]:
    """Process 0's header, then its payload (``payload_for(header)``: this process's array of the
    header's payload size), on every process."""
    from jax.experimental import multihost_utils

    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    payload = payload_for(header)
    if payload.size:
        payload = np.asarray(multihost_utils.broadcast_one_to_all(payload))
    return header, payload


class _Distributed(LocalScheduler):
    fatal = True  # a failed step may leave the processes in different places: stop the job

    def __init__(self, idle_sync_s: float):
        super().__init__()
        import jax

        self.process, self.processes = jax.process_index(), jax.process_count()
        self.idle_sync_s = idle_sync_s

    def failed(self, error: BaseException) -> None:
        """Exit the process (``FAILED_EXIT_CODE``) after ``FAILURE_GRACE_S``: its state can no longer be
        kept in step with the others', and ``jax.distributed``'s shutdown at exit would wait for a lost
        process."""
        msg = (f"k3jax serving: process {self.process} of {self.processes} stops: a step of the multi-process "
               f"server failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
               f"another process has probably died (see its log). Exiting with code {FAILED_EXIT_CODE}.")
        print(msg, file=sys.stderr, flush=True)
        time.sleep(FAILURE_GRACE_S)
        sys.stdout.flush()
        os._exit(FAILED_EXIT_CODE)


    def close(self) -> None:
        """Leave the job together (``jax.distributed.shutdown``: a barrier of every process), before
        process 0 exits: its exit takes the coordination service with it, and JAX aborts a process
        still connected to it."""
        import jax

        jax.distributed.shutdown()


class LeaderScheduler(_Distributed):
    """Process 0 of a multi-process server: the local events, broadcast every iteration (module docstring)."""

    def next(self, busy: bool, digest: int) -> Schedule:
        schedule = self._take(busy, self.idle_sync_s)
        header, payload = encode(schedule, digest)
        _broadcast(header, lambda _: payload)
        return schedule


class FollowerScheduler(_Distributed):
    """Another process of a multi-process server: process 0's schedule (module docstring)."""

    def submit(self, seq: Sequence) -> None:
        raise RuntimeError(f"process {self.process} takes no requests: process 0 serves the API")

    def next(self, busy: bool, digest: int) -> Schedule:
        header, payload = _broadcast(np.zeros(_HEADER, np.int32), lambda h: np.zeros(payload_size(h), np.int32))
        schedule, leader_digest = decode(header, payload, mirror_sequence)
        if leader_digest != digest:
            raise RuntimeError(f"process {self.process}'s engine state (digest {digest}) differs from process 0's "
                               f"({leader_digest}): the processes would run different programs")
        self.stopping = schedule.stop
        return schedule


def _ignore(*_) -> None:
    """A mirror request's callbacks: process 0 answers the client."""


def mirror_sequence(rid: int, prompt: list[int], params, seed: int) -> Sequence:
    """A follower's copy of process 0's request ``rid``: the same prompt, parameters and seed, reporting to
    nobody."""
    seq = Sequence(prompt, params, _ignore, _ignore)
    seq.id, seq.seed = rid, seed
    return seq


def make_scheduler(idle_sync_s: float = IDLE_SYNC_S) -> LocalScheduler:
    """The scheduler of this process: local in a single-process job, else process 0 leads and the others
    follow (``idle_sync_s``: the leader's broadcast interval while idle)."""
    import jax

    if jax.process_count() == 1:
        return LocalScheduler()
    return LeaderScheduler(idle_sync_s) if jax.process_index() == 0 else FollowerScheduler(idle_sync_s)


__all__ = ["CANCEL_REASONS", "FAILED_EXIT_CODE", "FollowerScheduler", "LeaderScheduler", "LocalScheduler",
           "Schedule", "decode", "encode", "make_scheduler", "mirror_sequence", "state_digest"]

"""Continuous batching: a fixed pool of cache rows decoded together by one background thread.

The pool is one ``ModelCache`` of ``max_batch`` rows and ``max_len`` slots, advanced by the same
``model(tokens, cache=...)`` forward that training and ``k3jax.generate`` use, one token for every
row per step. Rows share the cache's write position (``cache.length``): each row holds its tokens
in the slots just before it, the slots before those marked invalid, exactly as ``generate``
left-pads a ragged batch. A request's lifecycle:

1. ``submit`` puts it in a bounded queue (full: ``QueueFull``, which the API answers with 503).
2. When rows are free, the waiting prompts (up to ``prefill_batch`` of them, no more than the free
   rows) are prefilled together into a small cache, one call ("piece") between two decode steps, so
   a long prompt does not stall the running streams. Each prompt runs from its start in whole
   ``prefill_chunk`` pieces, then its remainder (< ``prefill_chunk`` tokens) in pieces of its binary
   digits (``prefill_chunk``/2 or less, powers of two); in a piece a row runs that many tokens or
   none (a skipped row's KDA states are kept: ``cache.keep_rows``; its MLA slots are invalid). So
   every prompt's chunk boundaries fall at multiples of ``prefill_chunk`` from its start, where the
   prefix cache takes and resumes snapshots. A lone prompt runs in batch-1 programs, several in the
   ``prefill_batch``-row ones (unused rows idle): a burst of new requests joins the batch in one
   prefill instead of one prefill each.
3. Each prefilled row is written into a free pool row with its valid slots packed to end at the
   pool's write position (``cache.pack_row``, ``cache.write_row``); when the position is too small
   for the prompt, or reaches the end of the slots, every row is moved at once (``cache.shift_slots``,
   exact).
4. Each decode step samples every row's next token from its last logits (per-row temperature,
   top-p and key) and feeds it back; the host reads the tokens, streams them, and frees a row as
   soon as its request stops, reaches ``max_tokens`` or is cancelled. Steps are pipelined: step
   t+1 is queued on the device (JAX dispatches asynchronously) before the host reads step t's
   tokens, so streaming them overlaps the next step. A row is never queued for more steps than its
   ``max_tokens``; a row that stops (stop token, cancel) has at most one step in flight, whose
   token is dropped, and its next owner's ``write_row`` replaces everything the row held.

Log-probabilities (``k3jax.serving.logprobs``) come from the same steps: a decode step returns the
sampled tokens' and the top-``MAX_LOGPROBS`` log-probabilities of every row it ran, a prefill chunk
those of every prompt position's next prompt token (for requests that ask for the prompt's:
``SamplingParams.prompt_logprobs``, OpenAI's ``echo``). Both are skipped on the device when no row
asks. A request with ``max_tokens=0`` and ``prompt_logprobs`` only scores its prompt: it ends after
its prefill without taking a pool row.

A step runs the smallest of the decode programs (for 1, 2, 4, ... rows, and ``max_batch``) that
covers the last busy row, on the pool's leading rows (``cache.first_rows``); requests take the
lowest free row, so a few concurrent requests cost a few rows' work, not the whole pool's.

Prefix cache (``prefix_cache_tokens`` > 0): blocks of prompt and generated tokens snapshotted as
prefill and decoding complete them, resumed by later prompts (``k3jax.serving.prefix_cache``).

The device programs (``k3jax.serving.programs``) have fixed shapes (pool, chunk, row index and shifts
are traced), so each compiles once (in ``warmup``), whatever requests come and go. A request is a
``k3jax.serving.request.Sequence``; the prefill's pieces are planned by ``k3jax.serving.prefill``.

Several hosts: the loop takes its input, each iteration, from a scheduler
(``k3jax.serving.schedule``): the requests submitted and cancelled since the last one. In one process
they come from the API's threads; in a multi-process job process 0 broadcasts them every iteration
and every process runs the same iteration (every decision above is a function of them and of the
replicated sampled tokens), so all run the same programs in the same order.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.cache import cache_bytes
from k3jax.runtime.host_memory import keep_host_memory, keeps_host_memory
from k3jax.model import K3Model, unroll_layers as unrolled
from k3jax.serving.logprobs import MAX_LOGPROBS, read_logprobs
from k3jax.serving.metrics import Metrics
from k3jax.serving.prefill import Prefill, piece_widths, plan_pieces, take_prompts
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.programs import Programs
from k3jax.serving.request import Sequence
from k3jax.serving.schedule import LocalScheduler, Schedule, make_scheduler, state_digest
from k3jax.sharding import LAYOUTS, place_state, use_mesh
from pallas_kernels.platform import target_platform

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """Every cache row is busy and the waiting queue is full."""


class Engine:
    """The slot pool and its decode loop (see the module docstring). ``mesh``: the device mesh the
    model is laid out on (None or one device: unsharded). ``unroll_layers``: run the model with its
    layers unrolled (``k3jax.model.unroll_layers``: a copy of the scanned weights, a longer compile,
    faster steps on CPU); None = on CPU when unsharded. ``prefix_cache_tokens``: the prefix cache's
    budget (0: no prefix cache); ``prefix_cache_block``: its block, a multiple of ``prefill_chunk``
    (default: one chunk). ``prefill_chunk`` is at most ``max_len``. ``scheduler``: where each iteration's
    input comes from (default ``schedule.make_scheduler()``: local in one process, process 0's broadcast
    in several). ``record_routes``: every request records its tokens' experts and sampled log-probabilities
    (``Sequence.prompt_routes``, ``routes``, ``sampled_logprobs``: the rollouts of ``k3jax.rl``); its prefix
    cache's blocks keep their tokens' routes, so a prompt that resumes from them still has every token's.
    ``layout``: the mesh layout
    of the weights, caches and programs, a key of ``k3jax.sharding.LAYOUTS``: ``serving`` (weights split
    once over the mesh, decode steps move activations only) or ``training`` (the trainer's own layout: an RL
    rollout decodes on the trainer's arrays without moving them). Weights in another layout are moved into it
    once, when the engine is built and by :meth:`set_weights` (the time is logged)."""

    def __init__(self, model: K3Model, *, max_batch: int = 8, max_len: int | None = None, prefill_chunk: int = 64,
                 prefill_batch: int = 8, max_queue: int = 64, mesh=None, metrics: Metrics | None = None,
                 unroll_layers: bool | None = None, prefix_cache_tokens: int = 0,
                 prefix_cache_block: int | None = None, scheduler: LocalScheduler | None = None,
                 record_routes: bool = False, layout: str = "serving"):
        cfg = model.cfg
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.max_len = int(max_len or cfg.max_seq_len)
        if not 2 <= self.max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in [2, model.max_seq_len={cfg.max_seq_len}], got {self.max_len}")
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk),
                            ("prefill_batch", prefill_batch)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_batch, self.prefill_chunk, self.max_queue = max_batch, min(prefill_chunk, self.max_len), max_queue
        self._widths = piece_widths(self.prefill_chunk)
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        block = prefix_cache_block or self.prefill_chunk
        if block % self.prefill_chunk:
            raise ValueError(f"prefix_cache_block ({block}) must be a multiple of prefill_chunk ({self.prefill_chunk})")
        self.prefix_cache = PrefixCache(block, prefix_cache_tokens) if prefix_cache_tokens else None
        self.prefill_batch = min(prefill_batch, max_batch)
        self.vocab_size = cfg.vocab_size
        self.record_routes = record_routes
        self.metrics = metrics or Metrics()
        self.metrics.max_slots = max_batch
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        if unroll_layers is None:  # XLA:CPU copies a scanned layer's weights out of the stack at every step
            unroll_layers = self.mesh is None and target_platform() == "cpu"
        self._build(unrolled(model) if unroll_layers else model)
        if self.prefix_cache is not None:
            self.prefix_cache_block_bytes = cache_bytes(jax.eval_shape(self._programs.empty_block))
            log.info("prefix cache: blocks of %d tokens, %.1f MiB each (KDA snapshot included), %d blocks at most",
                     block, self.prefix_cache_block_bytes / 2**20, prefix_cache_tokens // block)
        self._reset()
        self._queue: collections.deque[Sequence] = collections.deque()  # admitted, waiting for a row (engine thread)
        self._live: dict[int, Sequence] = {}  # id -> every admitted request not finished (engine thread)
        self._scheduler = scheduler if scheduler is not None else make_scheduler()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        # Whether start() made glibc keep freed memory (k3jax/runtime/host_memory.py; stop() undoes it), else every
        # step page-faults its temporaries in afresh (~20 ms of a 60 ms decode step at batch 32 on `small`).
        self._sets_host_memory = False
        self._seeds = itertools.count(int.from_bytes(os.urandom(4), "little"))
        # Entered around each iteration of the engine thread's loop: a profiler's hook
        # (k3jax.serving.profiling.StepProfiler.step traces the next N steps).
        self.step_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def _build(self, model: K3Model):
        graphdef, state = nnx.split(model)
        self._state = self._in_layout(state)
        self._weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)  # what set_weights takes
        self._programs = Programs(graphdef, model.cfg, model.plan, max_batch=self.max_batch, max_len=self.max_len,
                                  prefill_chunk=self.prefill_chunk, prefill_batch=self.prefill_batch,
                                  widths=self._widths, mesh=self.mesh, record_routes=self.record_routes,
                                  block=self.prefix_cache.block if self.prefix_cache is not None else None,
                                  layouts=LAYOUTS[self.layout])
        self.decode_programs = self._programs.decode  # by row count: 1, 2, 4, ... and the whole pool

    def _in_layout(self, state):
        """``state`` on the engine's mesh in its layout's storage (the same for its decode and prefill tables),
        moved there once if it is not (the time is logged)."""
        if self.mesh is None:
            return state
        t0 = time.perf_counter()
        placed, moved = place_state(state, self.mesh, LAYOUTS[self.layout][0].rules)
        if moved:
            log.info("weights moved into the %s layout in %.3f s", self.layout, time.perf_counter() - t0)
        return placed

    def _reset(self):
        """Empty pool; every row free."""
        with use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            self._pool = self._programs.empty_pool()
            self._logits, self._keys = self._programs.init_rows()
        self._rows: list[Sequence | None] = [None] * self.max_batch
        self._filled = np.zeros(self.max_batch, np.int64)  # tokens of each row in the pool (queued steps too)
        self._queued = np.zeros(self.max_batch, np.int64)  # decode steps queued for each row's request
        # per queued step: (tokens [B], their token_logprobs arrays, each row's request)
        self._inflight: collections.deque = collections.deque()
        self._temperature = np.zeros(self.max_batch, np.float32)
        self._top_p = np.ones(self.max_batch, np.float32)
        self._wants = np.zeros(self.max_batch, bool)  # the row's request wants log-probabilities
        self._length = 0  # the pool's write position (host copy of pool.length)
        self._prefill: Prefill | None = None

    def warmup(self) -> None:
        """Compile every device program now (a prefill, an insert, a move of the slots, a decode
        step on a dummy request), not at the first requests; then empty the pool."""
        metrics, self.metrics = self.metrics, Metrics()  # the dummy work is not served traffic
        with use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            for rows in self._programs.empty_prefill:  # the batch-1 and the batched prefill programs
                cache, last = self._programs.empty_prefill[rows](), self._programs.zero_last[rows]()
                for w in self._widths:  # p + p - 1 <= max_len + p slots
                    last, cache, _, _ = self._programs.prefill[rows, w](
                        self._state, cache, last, np.zeros((rows, w), np.int32), np.ones((rows, w), bool),
                        np.zeros((rows, w), np.int32), np.bool_(True))
                if self.prefix_cache is not None:
                    block = self._programs.read_block[rows](cache, np.int32(0), np.int32(0))
                    cache = self._programs.write_block[rows](cache, np.int32(0), np.int32(0), block)
                    if self._programs.read_pool_block is not None:
                        self._programs.read_pool_block(self._pool, np.int32(0), np.int32(0))
                self._pool, self._logits, self._keys = self._programs.insert(
                    self._pool, self._logits, self._keys, np.int32(0), cache, np.int32(0), last, np.uint32(0))
            self._realign(0)
            for rows in self.decode_programs:
                self._decode(rows, np.arange(self.max_batch) < rows)
            jax.block_until_ready(self._pool)
            self._reset()
        self.metrics = metrics

    def set_weights(self, state) -> None:
        """Decode from now on with ``state`` (``nnx.state`` of a model of the engine's structure: the trainer's
        current weights in reinforcement learning), on the mesh the engine was built for. Arrays already in
        the engine's layout are used as they are (no copy: an RL engine in the trainer's layout); the others are
        copied into it (the time is logged). Only between requests: the engine must be idle."""
        self._require_idle("set_weights")
        old, new = jax.tree.structure(self._weights), jax.tree.structure(state)
        if old != new:
            raise ValueError("set_weights: the state's structure differs from the engine's model (an engine for "
                             "new weights must be built with unroll_layers=False and the same adapters)")
        for a, b in zip(jax.tree.leaves(self._weights), jax.tree.leaves(state)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"set_weights: a weight of shape {b.shape} {b.dtype} replaces one of {a.shape} "
                                 f"{a.dtype}")
        self._state = self._in_layout(state)
        if self.prefix_cache is not None:  # its snapshots are the old weights' caches
            self.prefix_cache.clear()
            self.metrics.prefix_cache_size(0)

    def _require_idle(self, action: str) -> None:
        if self.active_count() or self.queue_length() or self._inflight:
            raise RuntimeError(f"{action} while requests are in flight")

    def release_weights(self) -> None:
        """Let go of the weights (an RL trainer's, between rollouts): a copy the engine made in its own layout
        frees its device memory. The engine runs nothing until the next :meth:`set_weights`."""
        self._require_idle("release_weights")
        self._state = None

    # --- the client side (any thread) ----------------------------------------------------------------
    def check(self, prompt_len: int, max_tokens: int, scoring: bool = False) -> None:
        """Raise ValueError when a request cannot fit in a row (``scoring``: it wants its prompt's
        log-probabilities, so it may generate nothing)."""
        if prompt_len < 1:
            raise ValueError("the prompt is empty")
        if max_tokens < (0 if scoring else 1):
            raise ValueError(f"max_tokens must be >= {0 if scoring else 1}, got {max_tokens}")
        if prompt_len + max_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                             f"{self.max_len} tokens")

    def submit(self, seq: Sequence) -> None:
        """Queue a request (``ValueError`` when it cannot fit, ``QueueFull`` when the queue is full)."""
        self.check(len(seq.prompt), seq.params.max_tokens, seq.params.prompt_logprobs)
        k = seq.params.logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {k}")
        bad = [t for t in seq.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self._scheduler.stopping:
            raise RuntimeError("the engine is stopped")
        if self.queue_length() >= self.max_queue and not self._has_free_row():
            raise QueueFull(f"{self.queue_length()} requests are waiting for one of {self.max_batch} slots")
        seq.id = next(self._ids) % 2**31
        if seq.seed is None:
            seq.seed = next(self._seeds)
        self._scheduler.submit(seq)
        self.metrics.gauges(self.active_count(), self.queue_length())

    def run(self, seqs: list[Sequence]) -> None:
        """Serve ``seqs`` to the end on the calling thread, for an engine that is not started (no engine
        thread): all are admitted at once, so the prefills and decode steps they run, and hence every token,
        depend on the requests alone (reinforcement learning's rollouts, repeated exactly on resume). A
        request that cannot fit raises ValueError before any runs; a failed device call raises."""
        if self._thread is not None:
            raise RuntimeError("Engine.run is for an engine without its thread (do not start() it)")
        if self._state is None:
            raise RuntimeError("the engine's weights were released: set_weights first")
        for seq in seqs:
            self.check(len(seq.prompt), seq.params.max_tokens, seq.params.prompt_logprobs)
        with use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            for seq in seqs:
                seq.id = next(self._ids) % 2**31
                if seq.seed is None:
                    seq.seed = next(self._seeds)
                self._queue.append(seq)
                self._live[seq.id] = seq
            while any(seq.finish_reason is None for seq in seqs):
                self._iteration()
            while self._inflight:  # a step queued before its rows stopped: read, for nobody
                self._read_step()

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """Stop a request (queued, prefilling or decoding); its row is freed before the next step.
        ``reason``: what it counts as in the metrics (``stop`` when the API found a stop string)."""
        if seq.id >= 0:  # (never submitted: nothing to stop)
            self._scheduler.cancel(seq, reason)

    def active_count(self) -> int:
        return sum(r is not None for r in self._rows) + (len(self._prefill.seqs) if self._prefill else 0)

    def queue_length(self) -> int:
        """Requests waiting for a row (the scheduler's not yet taken included)."""
        return len(self._queue) + self._scheduler.pending()

    def _has_free_row(self) -> bool:
        return self.active_count() + self.queue_length() < self.max_batch

    def start(self) -> "Engine":
        """Start the decode loop (once; later calls do nothing)."""
        if self._thread is not None:
            return self
        # glibc keeps freed memory while the engine runs, unless the process already does (k3jax/runtime/host_memory.py)
        self._sets_host_memory = target_platform(self.mesh) == "cpu" and not keeps_host_memory() and keep_host_memory()
        self.warmup()
        self._thread = threading.Thread(target=self._run, name="k3jax-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (process 0 of several: every process's) and wait for it."""
        self._scheduler.stop()
        self.wait()

    def wait(self) -> None:
        """Wait until the loop has stopped (a follower process: when process 0 stops it)."""
        if self._thread is not None:
            self._thread.join()
            if self._sets_host_memory:  # the process may go on to other work (a test suite)
                keep_host_memory(False)
                self._sets_host_memory = False

    # --- the engine thread ---------------------------------------------------------------------------
    def _run(self):
        with use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            while True:
                busy = bool(self._queue or self._prefill or any(self._rows) or self._inflight)
                try:
                    schedule = self._scheduler.next(busy, self._digest())
                    self._admit(schedule)
                    if schedule.stop:
                        break
                    if busy or self._queue:
                        with self.step_scope():
                            self._iteration()
                except Exception as error:  # a failed device call (or a lost process): fail what is in flight
                    log.exception("engine step failed; failing the requests in flight")
                    if self.prefix_cache is not None:  # a failed computation may have left poisoned snapshots
                        self.prefix_cache.clear()
                    for seq in [*self._rows, *(self._prefill.seqs if self._prefill else ()),
                                *(self._queue if self._scheduler.fatal else ())]:
                        if seq is not None:
                            self._finish(seq, "error")
                    self._scheduler.failed(error)  # several processes: exits
                    self._reset()
            for seq in [*self._rows, *(self._prefill.seqs if self._prefill else ()), *self._queue]:
                if seq is not None:
                    self._finish(seq, "cancelled")
        self._scheduler.close()

    def _admit(self, schedule: Schedule):
        """Queue the schedule's new requests and mark its cancelled ones (a request already finished, or
        never taken, is not in ``_live``)."""
        for seq in schedule.admitted:
            self._queue.append(seq)
            self._live[seq.id] = seq
        for rid, reason in schedule.cancelled:
            seq = self._live.get(rid)
            if seq is not None:
                seq.cancelled = seq.cancelled or reason

    def _digest(self) -> int:
        """The host state every process must agree on before an iteration (``schedule.state_digest``)."""
        return state_digest(self._length, [-1 if s is None else s.id for s in self._rows],
                            [-1 if s is None else s.id for s in (self._prefill.seqs if self._prefill else ())],
                            [s.id for s in self._queue])

    def _iteration(self):
        self._reap_cancelled()
        free = self._rows.count(None)
        if self._prefill is None and free:
            seqs, hits = self._take_prompts(min(free, self.prefill_batch))
            if seqs:
                self._start_prefill(seqs, hits)
        if self._prefill is not None:
            self._prefill_chunk()
            # nothing decoding: no stream to keep waiting, run the whole prompt
            while self._prefill is not None and not any(self._rows):
                self._prefill_chunk()
        queued = self._queue_step()
        # read the previous step's tokens while this one runs; with none queued, read what is left
        while len(self._inflight) > queued:
            self._read_step()
        self.metrics.gauges(self.active_count(), len(self._queue))

    def _reap_cancelled(self):
        for r, seq in enumerate(self._rows):
            if seq is not None and seq.cancelled:
                self._rows[r] = None
                self._finish(seq, seq.cancelled)
        if self._prefill is not None:
            for i, seq in enumerate(self._prefill.seqs):
                if seq is not None and seq.cancelled:
                    self._prefill.seqs[i] = None  # its prefill row runs on as padding, never inserted
                    self._finish(seq, seq.cancelled)
            if not any(self._prefill.seqs):
                self._prefill = None
        cancelled = [s for s in self._queue if s.cancelled]
        for seq in cancelled:
            self._queue.remove(seq)
        for seq in cancelled:
            self._finish(seq, seq.cancelled)

    def _cached_prefix(self, seq: Sequence) -> list:
        """The prefix cache's nodes for ``seq``'s longest cached prefix (none for a request that scores its
        prompt: every prompt position must run); at least the prompt's last token is left to run."""
        if self.prefix_cache is None or seq.params.prompt_logprobs:
            return []
        return self.prefix_cache.lookup(seq.prompt, len(seq.prompt) - 1)

    def _take_prompts(self, n: int) -> tuple[list[Sequence], list[list]]:
        """Up to ``n`` waiting requests to prefill together, and each one's cached prefix nodes
        (``prefill.take_prompts``)."""
        block = self.prefix_cache.block if self.prefix_cache is not None else 0
        return take_prompts(self._queue, n, self._cached_prefix, block, self.prefill_chunk, self.max_len)

    def _start_prefill(self, seqs: list[Sequence], hits: list[list]):
        """Prefill ``seqs`` (1 <= len <= prefill_batch, no more than the free rows) together, each after
        its cached prefix (``hits``: its prefix cache nodes, root first). Row i's cached prefix of h_i
        tokens is written to end at slot H = max h_i; the pieces follow."""
        rows = 1 if len(seqs) == 1 else self.prefill_batch
        block = self.prefix_cache.block if self.prefix_cache is not None else 0
        done = [len(nodes) * block for nodes in hits]  # per row: prompt tokens already in the cache
        start = max(done)
        cache = self._programs.empty_prefill[rows]()
        for i, nodes in enumerate(hits):
            for j, node in enumerate(nodes):
                cache = self._programs.write_block[rows](cache, np.int32(i),
                                                         np.int32(start - done[i] + j * block), node.value)
        if start:
            cache = cache._replace(length=jnp.asarray(start, jnp.int32))
        if self.prefix_cache is not None:
            for seq, h in zip(seqs, done):
                if not seq.params.prompt_logprobs:
                    self.metrics.prefix_lookup(h)
        pieces = plan_pieces([seq.prompt for seq in seqs], done, rows, self._widths, block)
        self._prefill = Prefill(list(seqs), [seq.prompt for seq in seqs], pieces, cache,
                                self._programs.zero_last[rows](), start,
                                scores=any(s.params.prompt_logprobs for s in seqs),
                                cached_routes=[[node.routes for node in nodes] for nodes in hits])

    def _prefill_chunk(self):
        """Run the prefill's next piece; after its last, hand the rows to the pool."""
        job = self._prefill
        piece = job.pieces[job.done]
        rows, width = piece.tokens.shape
        job.last, job.cache, scored, routes = self._programs.prefill[rows, width](
            self._state, job.cache, job.last, piece.tokens, piece.valid, piece.targets, np.bool_(job.scores))
        if self.record_routes:
            job.routes.append(routes)
        job.length += width
        self.metrics.prefilled(width * sum(a >= 0 for a in piece.starts))
        if job.scores:
            job.scored.append(scored)
        for row, end in piece.snapshots:  # the row's last block ends here: its slots are the last ones
            if not self.prefix_cache.has(job.prompts[row], end):
                job.snapshots.append((row, end, self._programs.read_block[rows](
                    job.cache, np.int32(row), np.int32(job.length - self.prefix_cache.block))))
        job.done += 1
        if job.done == len(job.pieces):
            if job.scores:
                job.set_prompt_logprobs()
            routes = job.row_routes() if self.record_routes else None
            if routes is not None:
                for seq, row_routes in zip(job.seqs, routes):
                    if seq is not None:
                        seq.prompt_routes = row_routes
            if job.snapshots:
                block = self.prefix_cache.block
                for row, end, snapshot in job.snapshots:
                    self.prefix_cache.insert(job.prompts[row], end, snapshot,
                                             None if routes is None else routes[row][end - block:end])
                self.metrics.prefix_cache_size(self.prefix_cache.tokens)
            for src_row, seq in enumerate(job.seqs):
                if seq is None:
                    continue
                if seq.params.max_tokens == 0:  # scored, nothing to generate
                    self.metrics.tokens(prompt=len(seq.prompt))
                    self._finish(seq, "length")
                else:
                    self._insert(job, src_row)
            self._prefill = None

    def _insert(self, job: Prefill, src_row: int):
        seq = job.seqs[src_row]
        n = len(seq.prompt)
        if self._length < n:  # the row's tokens must all precede the write position
            self._realign(n - self._length)
        row = self._rows.index(None)
        params = seq.params
        seed = seq.seed
        self._pool, self._logits, self._keys = self._programs.insert(self._pool, self._logits, self._keys, np.int32(row),
                                                               job.cache, np.int32(src_row), job.last,
                                                               np.uint32(seed % 2**32))
        self._rows[row], self._filled[row], self._queued[row] = seq, n, 0
        self._temperature[row], self._top_p[row] = params.temperature, params.top_p
        self._wants[row] = params.logprobs is not None
        self.metrics.tokens(prompt=n)

    def _realign(self, shift: int):
        self._pool = self._programs.realign(self._pool, np.int32(shift))
        self._length += shift
        self.metrics.realigned()

    def _queue_step(self) -> bool:
        """Queue a decode step of every row whose request may still need a token (fewer steps queued
        than its ``max_tokens``); False when there is none."""
        rows = [seq if seq is not None and self._queued[r] < seq.params.max_tokens else None
                for r, seq in enumerate(self._rows)]
        active = np.array([seq is not None for seq in rows])
        if not active.any():
            return False
        if self._length >= self.max_len:  # out of slots: move every row back to the start
            self._realign(int(self._filled[active].max()) - self._length)
        last = int(np.flatnonzero(active)[-1])
        tokens, scored, rollout = self._decode(min(r for r in self.decode_programs if r > last), active)
        self._filled[active] += 1
        self._queued[active] += 1
        self._inflight.append((tokens, scored, rollout, rows, self._snapshot_generated(active)))
        return True

    def _snapshot_generated(self, active: np.ndarray) -> list:
        """The pool rows whose tokens (prompt and generated) now end a prefix-cache block, each with its
        snapshot there (``cache.read_block``: the block's slots end at the write position): ``[(row, end,
        snapshot)]``, inserted into the cache once the step's tokens are read. A conversation's next turn,
        whose prompt repeats this one and its reply, then resumes after the reply."""
        programs = self._programs
        if self.prefix_cache is None or programs.read_pool_block is None:
            return []
        block = self.prefix_cache.block
        start = np.int32(self._length - block)
        return [(r, int(self._filled[r]), programs.read_pool_block(self._pool, np.int32(r), start))
                for r in np.flatnonzero(active) if self._filled[r] % block == 0]

    def _decode(self, rows: int, active: np.ndarray):
        """Queue the ``rows``-row decode program (every active row below ``rows``); -> its tokens, their
        log-probabilities (token_logprobs' arrays) and what a recording engine keeps (sampled log-probabilities
        ``[rows]``, routes ``[rows, M, k]``)."""
        tokens, scored, rollout, self._logits, self._keys, self._pool = self.decode_programs[rows](
            self._state, self._pool, self._logits, self._keys, self._temperature, self._top_p, active, self._wants)
        self._length += 1
        return tokens, scored, rollout

    def _read_step(self):
        """Wait for the oldest queued step's tokens and hand each to its request (one that ended
        since the step was queued gets nothing)."""
        tokens, scored, rollout, rows, snapshots = self._inflight.popleft()
        tokens = np.asarray(tokens)
        if self.record_routes:
            sampled, routes = (np.asarray(a) for a in rollout)
        if any(seq is not None and seq.params.logprobs is not None for seq in rows):
            own, top, ids = (np.asarray(a) for a in scored)
        now = time.monotonic()
        generated = 0
        for r, seq in enumerate(rows):
            if seq is None or seq.finish_reason is not None:
                continue
            token = int(tokens[r])
            seq.generated.append(token)
            if self.record_routes:
                seq.sampled_logprobs.append(float(sampled[r]))
                seq.routes.append(routes[r])
            generated += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.metrics.first_token(now - seq.arrival)
            reason = None
            if token in seq.params.stop_ids:
                reason = "stop"
            else:
                k = seq.params.logprobs
                seq.on_token(token, None if k is None else read_logprobs(own[r], top[r], ids[r], k))
                if len(seq.generated) >= seq.params.max_tokens:
                    reason = "length"
            if reason is not None:
                self._rows[r] = None
                self._finish(seq, reason)
        if snapshots:
            self.prefix_cache.insert_generated([(rows[r].prompt + rows[r].generated, end, snapshot,
                                                 self._block_routes(rows[r], end))
                                                for r, end, snapshot in snapshots])
            self.metrics.prefix_cache_size(self.prefix_cache.tokens)
        self.metrics.tokens(generated=generated)
        self.metrics.step(self.active_count(), len(self._queue))

    def _block_routes(self, seq: Sequence, end: int) -> np.ndarray | None:
        """A recording engine's routes ``[block, M, k]`` of the prefix-cache block of ``seq``'s prompt and
        generated tokens that ends at ``end`` (None when not recording)."""
        if not self.record_routes:
            return None
        start, n = end - self.prefix_cache.block, len(seq.prompt)
        prompt_part = seq.prompt_routes[start:min(end, n)]
        generated_part = seq.routes[max(start - n, 0):end - n]
        return np.concatenate([prompt_part, *(r[None] for r in generated_part)], axis=0)

    def _finish(self, seq: Sequence, reason: str):
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        self._live.pop(seq.id, None)
        self.metrics.request_done(reason)
        try:
            seq.on_finish(reason)
        except Exception:
            log.exception("on_finish callback failed")


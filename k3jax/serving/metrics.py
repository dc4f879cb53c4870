"""Server metrics in the Prometheus text exposition format (``GET /metrics``).

Counters (requests, prompt, prefilled and generated tokens, decode steps, cache realignments, XLA
compiles, prefix cache hits / misses / cached tokens), gauges (queue length, active slots, token rates
over the last ``RATE_WINDOW_S`` seconds, tokens in the prefix cache) and a time-to-first-token histogram. Written by the engine thread and the HTTP handlers under one lock.
"""

from __future__ import annotations

import collections
import threading
import time

import jax

RATE_WINDOW_S = 10.0
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = 0


def _count_compile(event: str, duration_s: float, **_) -> None:
    global _compiles
    if event == _BACKEND_COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_count() -> int:
    """XLA backend compiles in this process since k3jax.serving was imported (every jitted program,
    not only the server's: a server that recompiles as requests come and go shows it here)."""
    return _compiles


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = collections.Counter()  # by outcome: stop, length, cancelled, rejected, error
        self.prompt_tokens = 0
        self.prefill_tokens = 0  # prompt tokens run through the model (not those of cached prefixes)
        self.prefix_hits = self.prefix_misses = self.prefix_hit_tokens = 0
        self.prefix_cache_tokens = 0
        self.generated_tokens = 0
        self.decode_steps = 0
        self.realignments = 0
        self.queue_length = 0
        self.active_slots = 0
        self.max_slots = 0
        self._ttft_buckets = [0] * len(TTFT_BUCKETS_S)
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._recent = collections.deque()  # (time, prompt tokens, generated tokens)

    def request_done(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generated_tokens += generated
            now = time.monotonic()
            self._recent.append((now, prompt, generated))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def prefilled(self, tokens: int) -> None:
        with self._lock:
            self.prefill_tokens += tokens

    def prefix_lookup(self, cached_tokens: int) -> None:
        """A prompt looked up in the prefix cache: ``cached_tokens`` of it found (0: a miss)."""
        with self._lock:
            self.prefix_hits += cached_tokens > 0
            self.prefix_misses += cached_tokens == 0
            self.prefix_hit_tokens += cached_tokens

    def prefix_cache_size(self, tokens: int) -> None:
        with self._lock:
            self.prefix_cache_tokens = tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self._ttft_sum += seconds
            self._ttft_count += 1
            for i, edge in enumerate(TTFT_BUCKETS_S):
                if seconds <= edge:
                    self._ttft_buckets[i] += 1

    def step(self, active: int, queued: int) -> None:
        with self._lock:
            self.decode_steps += 1
            self.active_slots, self.queue_length = active, queued

    def realigned(self) -> None:
        with self._lock:
            self.realignments += 1

    def gauges(self, active: int, queued: int) -> None:
        with self._lock:
            self.active_slots, self.queue_length = active, queued

    def render(self) -> str:
        """The Prometheus text format."""
        with self._lock:
            now = time.monotonic()
            recent = [r for r in self._recent if r[0] >= now - RATE_WINDOW_S]
            lines = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP k3jax_{name} {help_}")
                lines.append(f"# TYPE k3jax_{name} {kind}")
                for labels, value in samples:
                    lines.append(f"k3jax_{name}{labels} {value}")

            metric("requests_total", "counter", "Finished requests by outcome.",
                   [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())] or [("", 0)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of the requests served (cached prefixes "
                   "included).", [("", self.prompt_tokens)])
            metric("prefill_tokens_total", "counter", "Prompt tokens run through the model (cached prefixes not).",
                   [("", self.prefill_tokens)])
            metric("prefix_cache_hits_total", "counter", "Prompts that resumed from a cached prefix.",
                   [("", self.prefix_hits)])
            metric("prefix_cache_misses_total", "counter", "Prompts looked up in the prefix cache without a hit.",
                   [("", self.prefix_misses)])
            metric("prefix_cache_hit_tokens_total", "counter", "Prompt tokens not prefilled: read from the cache.",
                   [("", self.prefix_hit_tokens)])
            metric("prefix_cache_tokens", "gauge", "Tokens held in the prefix cache.", [("", self.prefix_cache_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
            metric("prompt_tokens_per_second", "gauge", f"Prompt tokens/s over the last {RATE_WINDOW_S:g} s.",
                   [("", round(sum(r[1] for r in recent) / RATE_WINDOW_S, 3))])
            metric("generation_tokens_per_second", "gauge", f"Generated tokens/s over the last {RATE_WINDOW_S:g} s.",
                   [("", round(sum(r[2] for r in recent) / RATE_WINDOW_S, 3))])
            metric("queue_length", "gauge", "Requests waiting for a cache slot.", [("", self.queue_length)])
            metric("active_slots", "gauge", "Cache slots in use (prefilling or decoding).", [("", self.active_slots)])
            metric("max_slots", "gauge", "Cache slots in the pool (--max-batch).", [("", self.max_slots)])
            metric("decode_steps_total", "counter", "Batched decode steps run.", [("", self.decode_steps)])
            metric("cache_realignments_total", "counter", "Shifts of the batched cache's slots.",
                   [("", self.realignments)])
            metric("xla_compiles_total", "counter", "XLA compiles in the server process.", [("", compile_count())])
            buckets = []  # the counts are cumulative already (first_token adds to every bucket >= t)
            for edge, n in zip(TTFT_BUCKETS_S, self._ttft_buckets):
                buckets.append((f'_bucket{{le="{edge:g}"}}', n))
            buckets.append(('_bucket{le="+Inf"}', self._ttft_count))
            buckets += [("_sum", round(self._ttft_sum, 6)), ("_count", self._ttft_count)]
            metric("time_to_first_token_seconds", "histogram", "Seconds from arrival to the first generated token.",
                   buckets)
            return "\n".join(lines) + "\n"

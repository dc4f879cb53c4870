"""The engine's prefix cache (k3jax/serving/prefix_cache.py, engine.py): greedy outputs and their
log-probabilities with the cache equal those without it, for prompts sharing none, part, all of a
cached prefix, up to and across a block (KDA snapshot) boundary, prefilled alone or together with
different cached prefix lengths, under eviction; a hit runs only the prompt's uncached tokens (counted
in /metrics); generated tokens are cached too (a next turn resumes after the reply); a request that scores
its prompt (echo) is never served from the cache. Also the block
trie's LRU eviction on its own and the server's options."""

from __future__ import annotations

import argparse
import contextlib
import threading

import numpy as np
import pytest

from k3jax.serving.engine import Engine
from k3jax.serving.request import SamplingParams, Sequence
from k3jax.serving.prefix_cache import PrefixCache
from k3jax.serving.server import add_arguments, engine_options
from test_serving import small_model

pytestmark = pytest.mark.usefixtures("fast_xla")

MAX_LEN, CHUNK, BLOCK, NEW = 48, 4, 8, 5  # a block is two chunks: snapshots every other chunk


@pytest.fixture(scope="module")
def engine():
    eng = Engine(small_model(), max_batch=4, max_len=MAX_LEN, prefill_chunk=CHUNK, prefill_batch=4, max_queue=16,
                 prefix_cache_tokens=32 * BLOCK, prefix_cache_block=BLOCK)
    eng.start()
    yield eng
    eng.stop()


def run(engine: Engine, prompts, **params) -> list[tuple[list[int], list[float], list]]:
    """Submit ``prompts`` at once (greedy, NEW tokens, the top-2 log-probabilities); -> per prompt its
    tokens, their log-probabilities and its prompt log-probabilities (None unless asked)."""
    seqs = []
    for prompt in prompts:
        done, logprobs = threading.Event(), []
        seq = Sequence(prompt, SamplingParams(**{"max_tokens": NEW, "logprobs": 2, **params}),
                       lambda t, lp, logprobs=logprobs: logprobs.append(lp.logprob), lambda r, done=done: done.set())
        seq.done, seq.logprobs = done, logprobs
        engine.submit(seq)
        seqs.append(seq)
    for seq in seqs:
        assert seq.done.wait(120) and seq.finish_reason in ("length", "stop"), seq.finish_reason
    return [(seq.generated, seq.logprobs, seq.prompt_logprobs) for seq in seqs]


@contextlib.contextmanager
def cache_off(engine: Engine):
    """The engine without its prefix cache (set while it is idle: no prefill in progress)."""
    cache, engine.prefix_cache = engine.prefix_cache, None
    try:
        yield
    finally:
        engine.prefix_cache = cache


@contextlib.contextmanager
def fresh_cache(engine: Engine, tokens: int):
    cache, engine.prefix_cache = engine.prefix_cache, PrefixCache(BLOCK, tokens)
    try:
        yield engine.prefix_cache
    finally:
        engine.prefix_cache = cache


def assert_same(got, want):
    for (tokens, logprobs, _), (ref_tokens, ref_logprobs, _) in zip(got, want, strict=True):
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, rtol=1e-4, atol=1e-4)


def counters(engine: Engine) -> tuple[int, int, int, int]:
    m = engine.metrics
    return m.prefill_tokens, m.prefix_hit_tokens, m.prefix_hits, m.prefix_misses


def test_hits_equal_the_uncached_outputs_and_prefill_only_new_tokens(engine):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 30).tolist()  # cached: blocks ending at 8, 16, 24
    cases = [  # (prompt, cached prefix length expected once `base` ran)
        (base, 0),
        (rng.integers(0, 256, 21).tolist(), 0),  # shares nothing
        (base[:5] + [7, 7, 7, 7, 7], 0),  # shares less than a block
        (base[:13] + [1, 2, 3], 8),  # diverges inside the second block: resumes at the first snapshot
        (base[:16], 8),  # ends on a snapshot boundary: its last token must run, so the block before
        (base[:17], 16),  # one token past it
        (base, 24),  # all of it: the tokens after the last boundary run again
        (base + rng.integers(0, 256, 9).tolist(), 24),  # the cached prompt and more (several pieces)
    ]
    with fresh_cache(engine, 32 * BLOCK):
        with cache_off(engine):
            want = [run(engine, [p])[0] for p, _ in cases]
        for (prompt, hit), ref in zip(cases, want):
            before = counters(engine)
            got = run(engine, [prompt])
            after = counters(engine)
            assert_same(got, [ref])
            assert after[0] - before[0] == len(prompt) - hit, "a hit must prefill only the uncached tokens"
            assert after[1] - before[1] == hit
            assert (after[2] - before[2], after[3] - before[3]) == ((1, 0) if hit else (0, 1))
        text = engine.metrics.render()
        for name in ("prefix_cache_hits_total", "prefix_cache_misses_total", "prefix_cache_hit_tokens_total",
                     "prefix_cache_tokens", "prefill_tokens_total"):
            assert f"k3jax_{name} " in text


def test_batched_prefill_mixes_cached_prefix_lengths_under_eviction(engine):
    """Prompts prefilled together resume from different cached lengths (their rows' slots have gaps
    until the row is packed into the pool); a budget of 3 blocks makes later inserts evict."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 27).tolist(), rng.integers(0, 256, 19).tolist()
    burst = [a[:9] + [4, 4], a + [9], b[:18] + [3, 3, 3], rng.integers(0, 256, 6).tolist()]
    later = [a, b, a[:17]]
    with cache_off(engine):
        want = [run(engine, [p], max_tokens=3)[0] for p in [a[:20], b[:10]]]
        want += [run(engine, [p])[0] for p in [*burst, *later]]
    with fresh_cache(engine, 3 * BLOCK) as cache:
        # caches a's first two blocks and b's first (3 tokens generated: no reply completes a block)
        got = run(engine, [a[:20], b[:10]], max_tokens=3)
        assert cache.tokens == 3 * BLOCK
        assert [len(cache.lookup(p, len(p) - 1)) for p in (a, b)] == [2, 1]
        before = counters(engine)
        got += run(engine, burst)  # hits of 8, 16, 8 and a miss in one prefill
        assert counters(engine)[1] - before[1] == 8 + 16 + 8
        assert cache.tokens <= 3 * BLOCK
        got += [run(engine, [p])[0] for p in later]
        assert cache.tokens <= 3 * BLOCK
    assert_same(got, want)


def test_a_next_turn_resumes_after_the_previous_reply(engine):
    """Generated tokens are cached as decoding completes their blocks: a prompt that repeats an earlier
    prompt and its reply (a conversation's next turn) hits the blocks that end inside the reply, and its
    outputs equal the uncached ones."""
    rng = np.random.default_rng(2)
    first = rng.integers(0, 256, 11).tolist()  # with NEW = 5 generated: blocks end at 8 (prompt) and 16 (reply)
    with cache_off(engine):
        reply = run(engine, [first], max_tokens=2 * BLOCK)[0][0]
        turn = first + reply + [5, 6, 7]
        want = run(engine, [turn])
    with fresh_cache(engine, 32 * BLOCK) as cache:
        assert run(engine, [first], max_tokens=2 * BLOCK)[0][0] == reply
        assert len(cache.lookup(turn, len(turn) - 1)) == (len(first) + len(reply)) // BLOCK  # 3 blocks: to 24
        before = counters(engine)
        got = run(engine, [turn])
        assert counters(engine)[1] - before[1] == 3 * BLOCK
    assert_same(got, want)


def test_echo_requests_score_every_prompt_position(engine):
    """A request for its prompt's log-probabilities runs its whole prompt even when it is cached (and
    is not counted as a lookup); its scores equal the uncached ones."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 256, 26).tolist()
    with cache_off(engine):
        want = run(engine, [prompt], max_tokens=0, prompt_logprobs=True)[0][2]
    with fresh_cache(engine, 32 * BLOCK) as cache:
        run(engine, [prompt])
        assert len(cache.lookup(prompt, len(prompt) - 1)) == 3
        before = counters(engine)
        got = run(engine, [prompt], max_tokens=0, prompt_logprobs=True)[0][2]
        after = counters(engine)
    assert after[0] - before[0] == len(prompt) and after[1:] == before[1:]
    assert got[0] is None and want[0] is None and len(got) == len(want) == len(prompt)
    for g, w in zip(got[1:], want[1:]):
        assert g.top_ids == w.top_ids
        np.testing.assert_allclose([g.logprob, *g.top_logprobs], [w.logprob, *w.top_logprobs], rtol=1e-4, atol=1e-4)


def test_block_trie_evicts_least_recently_used_leaves():
    cache = PrefixCache(2, 6)  # three blocks of two tokens
    a, b, c = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9], [7, 7, 7]
    assert not cache.insert(a, 4, "a2")  # its first block is not cached
    assert cache.insert(a, 2, "a1") and cache.insert(a, 4, "a2") and cache.insert(b, 4, "b2")
    assert not cache.insert(b, 4, "again")  # cached already
    assert [n.value for n in cache.lookup(a, 5)] == ["a1", "a2"] and cache.tokens == 6
    assert [n.value for n in cache.lookup(b, 3)] == ["a1"]  # limited to 3 tokens: one block
    cache.lookup(b, 4)  # b's block is now the most recently used leaf; a1 is inner: never evicted first
    assert cache.insert(c, 2, "c1")
    assert cache.has(a, 2) and not cache.has(a, 4) and cache.has(b, 4) and cache.has(c, 2) and cache.tokens == 6
    assert not cache.insert(a, 6, "a3")  # its parent went
    small = PrefixCache(2, 4)
    assert small.insert(a, 2, "a1") and small.insert(a, 4, "a2")
    assert not small.insert(a, 6, "a3")  # the only leaf is its own parent: nothing to evict
    assert [n.value for n in small.lookup(a, 6)] == ["a1", "a2"]
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache(4, 3)


def test_server_options():
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    on = engine_options(ap.parse_args(["--prefix-cache-tokens", "1024", "--prefix-cache-block", "512"]))
    assert on["prefix_cache_tokens"] == 1024 and on["prefix_cache_block"] == 512
    assert engine_options(ap.parse_args(["--no-prefix-cache"]))["prefix_cache_tokens"] == 0
    with pytest.raises(ValueError, match="multiple of prefill_chunk"):
        Engine(small_model(), max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache_tokens=64, prefix_cache_block=6)

"""A prompt prefilled into a decoding cache in chunks, for the tests that compare a sharded prefill with a
single-device one (tests/children/slot_split_cache.py, tests/children/cached_prefill_parallel.py)."""

import jax
import jax.numpy as jnp

from k3jax.sharding import cache_shardings


def prefill_in_chunks(step, state, tokens, token_valid, cache, lengths):
    """``step(state, tokens, token_valid, cache) -> (logits, cache)`` over consecutive chunks of ``lengths``
    tokens of ``tokens [B, T]`` / ``token_valid [B, T]`` -> (the chunks' logits ``[B, T, V]``, the cache)."""
    logits, at = [], 0
    for n in lengths:
        out, cache = step(state, tokens[:, at:at + n], token_valid[:, at:at + n], cache)
        logits.append(out)
        at += n
    return jnp.concatenate(logits, axis=1), cache


def prefill_padded_rows(model, step, lengths, capacity, padding, batch, state, mesh=None):
    """``batch`` random prompts of ``sum(lengths)`` tokens (drawn from the key ``batch``), every row after
    the first left-padded by ``padding`` slots, prefilled by :func:`prefill_in_chunks` into a fresh cache
    of ``capacity`` slots, placed on ``mesh`` by the cache rules when one is given -> (logits, cache)."""
    tokens = jax.random.randint(jax.random.key(batch), (batch, sum(lengths)), 0, model.cfg.vocab_size)
    token_valid = jnp.ones(tokens.shape, bool).at[1:, :padding].set(False)
    cache = model.init_cache(batch, capacity)
    if mesh is not None:
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
    return prefill_in_chunks(step, state, tokens, token_valid, cache, lengths)

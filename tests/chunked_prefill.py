"""A prompt prefilled into a decoding cache in chunks, for the tests that compare a sharded prefill with a
single-device one (tests/children/slot_split_cache.py, tests/children/cached_prefill_parallel.py)."""

import jax.numpy as jnp


def prefill_in_chunks(step, state, tokens, token_valid, cache, lengths):
    """``step(state, tokens, token_valid, cache) -> (logits, cache)`` over consecutive chunks of ``lengths``
    tokens of ``tokens [B, T]`` / ``token_valid [B, T]`` -> (the chunks' logits ``[B, T, V]``, the cache)."""
    logits, at = [], 0
    for n in lengths:
        out, cache = step(state, tokens[:, at:at + n], token_valid[:, at:at + n], cache)
        logits.append(out)
        at += n
    return jnp.concatenate(logits, axis=1), cache

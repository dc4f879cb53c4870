"""Autoregressive generation: ``k3jax.generate(model, prompt_tokens, max_new_tokens, ...)``.

The whole loop runs inside one jitted ``lax.while_loop``. This first version recomputes the forward
pass over a fixed-size token buffer at every step (correct by causality, quadratic in length); the
inference issue replaces its body with cached prefill + decode behind the same API.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model
from k3jax.sampling import sample_logits


def generate(model: K3Model, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=(), seed: int = 0,
             prompt_lengths=None) -> jax.Array:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    prompt_tokens: ``[B, T]`` int (right-padded when prompts differ in length; give
    ``prompt_lengths [B]``). Returns ``[B, T + max_new_tokens]``: each row is its prompt followed by
    its continuation: row i holds its ``prompt_lengths[i]`` prompt tokens, then up to
    ``max_new_tokens`` generated ones, then padding (the first stop token, or 0 when none is given).
    Generation of a row ends after it emits a stop token (kept). Greedy at ``temperature=0``.
    """
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    if prompt.ndim != 2:
        raise ValueError(f"prompt_tokens must be [B, T], got shape {prompt.shape}")
    b, t = prompt.shape
    lengths = jnp.full((b,), t, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
    if int(jnp.min(lengths)) < 1:
        raise ValueError("every prompt needs at least one token")
    total = t + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
                         f"max_seq_len={model.cfg.max_seq_len}")
    vocab = model.cfg.vocab_size
    if int(jnp.max(prompt)) >= vocab or int(jnp.min(prompt)) < 0:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    graphdef, state = nnx.split(model)
    stops = tuple(int(s) for s in stop_tokens)
    return _generate(graphdef, state, prompt, lengths, jax.random.key(seed), max_new_tokens=max_new_tokens,
                     temperature=float(temperature), top_k=top_k, top_p=top_p, stops=stops)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "stops"))
def _generate(graphdef, state, prompt, lengths, key, *, max_new_tokens, temperature, top_k, top_p, stops):
    model = nnx.merge(graphdef, state)
    b, t = prompt.shape
    total = t + max_new_tokens
    pad = stops[0] if stops else 0
    buf = jnp.full((b, total), pad, jnp.int32)
    positions = jnp.arange(t, dtype=jnp.int32)
    buf = buf.at[:, :t].set(jnp.where(positions[None] < lengths[:, None], prompt, pad))
    stop_ids = jnp.asarray(stops if stops else (-1,), jnp.int32)

    limit = lengths + max_new_tokens

    def cond(carry):
        return ~jnp.all(carry[2])

    def body(carry):
        buf, cur, done, key = carry  # cur [B]: next position to write per row
        key, sub = jax.random.split(key)
        logits, _ = model(buf)
        last = jnp.take_along_axis(logits, (cur - 1)[:, None, None], axis=1)[:, 0]
        tok = sample_logits(last, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        write = ~done
        buf = jnp.where(write[:, None] & (jnp.arange(total)[None] == cur[:, None]), tok[:, None], buf)
        done = done | (write & jnp.isin(tok, stop_ids)) | (cur + 1 >= limit)
        return buf, cur + 1, done, key

    done0 = jnp.full((b,), max_new_tokens <= 0)
    return jax.lax.while_loop(cond, body, (buf, lengths, done0, key))[0]

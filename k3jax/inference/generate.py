"""Autoregressive generation: ``k3jax.generate(model, prompt_tokens, max_new_tokens, ...)``.

One jitted program: a cached prefill of the (left-aligned) prompts, then a ``lax.while_loop`` of
single-token decode steps through the same ``model(tokens, cache=...)`` forward that training uses;
no Python round trip per token. ``stream`` receives each step's tokens through a host callback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.model import K3Model
from k3jax.inference.sampling import sample_logits


def generate(model: K3Model, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=(), seed: int = 0,
             prompt_lengths=None, stream=None, images=None) -> jax.Array:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    prompt_tokens: ``[B, T]`` int (right-padded when prompts differ in length; give
    ``prompt_lengths [B]``). Returns ``[B, T + max_new_tokens]``: each row is its prompt followed by
    its continuation: row i holds its ``prompt_lengths[i]`` prompt tokens, then up to
    ``max_new_tokens`` generated ones, then padding (the first stop token, or 0 when none is given).
    Generation of a row ends after it emits a stop token (kept). Greedy at ``temperature=0``.
    ``stream(step, tokens [B], active [B])`` (optional) is called on the host after every step, in
    step order on one device; on a multi-device model the calls may arrive out of order (XLA keeps
    ordered host callbacks to one device), so a consumer that prints orders them by ``step``.
    ``images`` (vision models): the prompts' packed images (``k3jax.vision.inputs.pack_images``, one
    row per prompt) or their projected features ``[B, M, d]``, spliced in at the prompts'
    ``<|media_pad|>`` tokens during the prefill.
    """
    prompt = jnp.asarray(prompt_tokens)
    if not jnp.issubdtype(prompt.dtype, jnp.integer):  # a cast would truncate 3.7 to token 3 silently
        raise ValueError(f"prompt_tokens must be integer token ids, got dtype {prompt.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    prompt = prompt.astype(jnp.int32)
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
    one_device = all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(state) if hasattr(x, "sharding"))
    return _generate(graphdef, state, prompt, lengths, jax.random.key(seed), images, max_new_tokens=max_new_tokens,
                     temperature=float(temperature), top_k=top_k, top_p=top_p, stops=stops, stream=stream,
                     ordered_stream=one_device)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p", "stops",
                                             "stream", "ordered_stream"))
def _generate(graphdef, state, prompt, lengths, key, images, *, max_new_tokens, temperature, top_k, top_p, stops, stream,
              ordered_stream):
    model = nnx.merge(graphdef, state)
    b, t = prompt.shape
    total = t + max_new_tokens
    pad = stops[0] if stops else 0
    stop_ids = jnp.asarray(stops if stops else (-1,), jnp.int32)
    columns = jnp.arange(t, dtype=jnp.int32)
    in_prompt = columns[None] < lengths[:, None]
    out = jnp.full((b, total), pad, jnp.int32).at[:, :t].set(jnp.where(in_prompt, prompt, pad))
    # Left-align: row i's prompt occupies the last lengths[i] of T slots, so all rows decode in lockstep.
    shift = t - lengths
    src = jnp.clip(columns[None] - shift[:, None], 0, t - 1)
    left = jnp.take_along_axis(prompt, src, axis=1)
    valid = columns[None] >= shift[:, None]
    cache = model.init_cache(b, total)
    logits, cache = model(jnp.where(valid, left, 0), cache=cache, token_valid=valid, images=images)
    last = logits[:, -1]

    def cond(carry):
        return (carry[0] < max_new_tokens) & ~jnp.all(carry[3])

    def body(carry):
        i, out, last, done, cache, key = carry
        key, sub = jax.random.split(key)
        tok = sample_logits(last, sub, temperature=temperature, top_k=top_k, top_p=top_p)
        active = ~done
        tok = jnp.where(active, tok, pad)
        out = jnp.where(active[:, None] & (jnp.arange(total)[None] == (lengths + i)[:, None]), tok[:, None], out)
        if stream is not None:
            jax.debug.callback(stream, i, tok, active, ordered=ordered_stream)
        done = done | jnp.isin(tok, stop_ids)
        logits, cache = model(tok[:, None], cache=cache)
        return i + 1, out, logits[:, -1], done, cache, key

    done = jnp.zeros((b,), bool)
    return jax.lax.while_loop(cond, body, (jnp.int32(0), out, last, done, cache, key))[1]

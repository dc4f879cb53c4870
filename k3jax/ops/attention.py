"""Causal softmax attention with packed-document masking (the MLA core)."""

import jax
import jax.numpy as jnp


def attention_mask(q_index: jax.Array, kv_index: jax.Array, q_segment_ids: jax.Array | None = None,
                   kv_segment_ids: jax.Array | None = None, kv_valid: jax.Array | None = None) -> jax.Array:
    """Boolean ``[B, T, S]``: key j is visible to query i iff ``kv_index[j] <= q_index[i]``, both
    belong to the same segment, and (for caches) key j holds a written entry."""
    mask = kv_index[:, None, :] <= q_index[:, :, None]
    if q_segment_ids is not None:
        mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if kv_valid is not None:
        mask &= kv_valid[:, None, :]
    return mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """Softmax attention with float32 scores.

    q ``[B, T, H, D]``, k ``[B, S, H, D]`` (or ``[B, S, 1, D]``, shared by all heads), v ``[B, S, H, Dv]``
    (or ``[B, S, 1, Dv]``), mask ``[B, T, S]`` bool. Returns ``[B, T, H, Dv]`` in ``v.dtype``. A query
    row with no visible key (cannot happen for causal self-attention) returns zeros.
    """
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.broadcast_to(k, k.shape[:2] + q.shape[2:]),
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - jax.lax.stop_gradient(row_max))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    v_full = jnp.broadcast_to(v, v.shape[:2] + (q.shape[2], v.shape[-1]))
    return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v_full,
                      preferred_element_type=jnp.float32).astype(v.dtype)

"""Causal softmax attention with packed-document masking (the MLA core)."""

import chex
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


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, q_shaped=(), kv_shaped=()) -> None:
    """Trace-time shape checks of the attention entry points (a mismatch would otherwise surface as an
    einsum or broadcast error deep inside XLA): q ``[B, T, H, D]``, k ``[B, S, H or 1, D]``, v
    ``[B, S, H or 1, Dv]``; the arrays of ``q_shaped`` are ``[B, T]`` and those of ``kv_shaped``
    ``[B, S]`` (None entries skipped)."""
    chex.assert_rank([q, k, v], 4)
    b, t, h, d = q.shape
    s = k.shape[1]
    chex.assert_shape(k, (b, s, {1, h}, d))
    chex.assert_shape(v, (b, s, {1, h}, None))
    for x in q_shaped:
        if x is not None:
            chex.assert_shape(x, (b, t))
    for x in kv_shaped:
        if x is not None:
            chex.assert_shape(x, (b, s))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float) -> jax.Array:
    """Softmax attention with float32 scores.

    q ``[B, T, H, D]``, k ``[B, S, H, D]`` (or ``[B, S, 1, D]``, shared by all heads), v ``[B, S, H, Dv]``
    (or ``[B, S, 1, Dv]``), mask ``[B, T, S]`` bool. Returns ``[B, T, H, Dv]`` in ``v.dtype``. A query
    row with no visible key (cannot happen for causal self-attention) returns zeros.
    """
    _check_shapes(q, k, v)
    chex.assert_shape(mask, (q.shape[0], q.shape[1], k.shape[1]))
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


# Default block sizes of `chunked_attention` (the MLA layer's choice). One block's float32 scores are
# B·H·Q_CHUNK·KV_CHUNK·4 bytes: 192 MiB per sequence for K3's 96 heads, small next to the weights,
# and large enough that the per-block loop overhead is negligible on TPU/GPU.
Q_CHUNK = 512
KV_CHUNK = 1024


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """q ``[B, C, H, D]``, k ``[B, S, H, D]`` or ``[B, S, 1, D]`` -> float32 ``[B, H, C, S]``.

    A shared key (MQA, the absorbed MLA cache) is contracted as is: broadcasting it to H heads first
    would materialise ``[B, S, H, D]``, H times the cache."""
    if k.shape[2] == 1:
        return jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0], preferred_element_type=jnp.float32) * scale
    return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """p ``[B, H, C, S]``, v ``[B, S, H, Dv]`` or ``[B, S, 1, Dv]`` -> float32 ``[B, C, H, Dv]``."""
    if v.shape[2] == 1:
        return jnp.einsum("bhts,bsd->bthd", p, v[:, :, 0], preferred_element_type=jnp.float32)
    return jnp.einsum("bhts,bshd->bthd", p, v, preferred_element_type=jnp.float32)


def _pad_to(x: jax.Array, length: int, axis: int, value=0) -> jax.Array:
    pad = length - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``[B, N*block, ...]`` -> ``[N, B, block, ...]`` (the leading axis is scanned over)."""
    return jnp.moveaxis(x.reshape((x.shape[0], -1, block) + x.shape[2:]), 1, 0)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array, kv_index: jax.Array, *,
                      scale: float, q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                      kv_valid: jax.Array | None = None, q_chunk: int = Q_CHUNK, kv_chunk: int = KV_CHUNK
                      ) -> jax.Array:
    """Masked softmax attention in bounded memory: ``attention(q, k, v, attention_mask(...))`` computed
    block by block, so neither the ``[B, H, T, S]`` scores nor the ``[B, T, S]`` mask exist whole.

    q ``[B, T, H, D]``; k ``[B, S, H, D]`` or ``[B, S, 1, D]`` (shared by all heads, never broadcast);
    v ``[B, S, H, Dv]`` or ``[B, S, 1, Dv]``; q_index ``[B, T]`` / kv_index ``[B, S]`` int positions
    (key j visible to query i iff ``kv_index[j] <= q_index[i]``); optional segment ids ``[B, T]`` /
    ``[B, S]`` and ``kv_valid [B, S]`` bool, as in :func:`attention_mask`. Returns ``[B, T, H, Dv]``
    in ``v.dtype``; a query with no visible key gets zeros.

    The queries are cut into blocks of ``q_chunk`` (``lax.map``; each block rematerialised in the
    backward pass, so the gradient holds one query block's intermediates at a time) and each block
    runs an online softmax over key blocks of ``kv_chunk`` (``lax.scan``). A key block that no query
    of the block can see (the causal future, unwritten cache slots) is skipped with ``lax.cond``,
    which halves the work of a causal prefill. Peak memory: forward ``O(B·H·q_chunk·kv_chunk)``,
    backward ``O(B·H·q_chunk·S)``. With ``T <= q_chunk`` and ``S <= kv_chunk`` this is one block, no
    loop: short sequences and decode steps pay nothing. T and S need not be multiples of the chunks.
    """
    _check_shapes(q, k, v, (q_index, q_segment_ids), (kv_index, kv_segment_ids, kv_valid))
    b, t, h, _ = q.shape
    s, dv = k.shape[1], v.shape[-1]
    cq, ck = min(q_chunk, t), min(kv_chunk, s)
    nq, nk = -(-t // cq), -(-s // ck)
    if kv_valid is None:
        kv_valid = jnp.ones((b, s), bool)
    # Padded keys are invalid; padded queries get the lowest index (they see nothing) and are dropped.
    k_pad, v_pad = _pad_to(k, nk * ck, 1), _pad_to(v, nk * ck, 1)
    kv_index_pad, kv_valid_pad = _pad_to(kv_index, nk * ck, 1), _pad_to(kv_valid, nk * ck, 1, False)
    kv_seg_pad = None if kv_segment_ids is None else _pad_to(kv_segment_ids, nk * ck, 1)
    kv_xs = (_blocks(k_pad, ck), _blocks(v_pad, ck), _blocks(kv_index_pad, ck), _blocks(kv_valid_pad, ck),
             None if kv_seg_pad is None else _blocks(kv_seg_pad, ck))

    def key_block(carry, kv, q_c, q_index_c, q_seg_c):
        """One online-softmax step: carry (max ``[B, H, C]``, sum ``[B, H, C]``, acc ``[B, C, H, Dv]``)."""
        k_c, v_c, kv_index_c, kv_valid_c, kv_seg_c = kv
        mask = attention_mask(q_index_c, kv_index_c, q_seg_c, kv_seg_c, kv_valid_c)  # [B, C, Ck]

        def update(carry):
            row_max, row_sum, acc = carry
            scores = jnp.where(mask[:, None], _scores(q_c, k_c, scale), -jnp.inf)
            # The shift cancels in acc / row_sum, so it carries no gradient (as in `attention`).
            new_max = jnp.maximum(row_max, jax.lax.stop_gradient(jnp.max(scores, axis=-1)))
            shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
            p = jnp.exp(scores - shift[..., None])
            rescale = jnp.exp(row_max - shift)  # 0 while row_max is -inf
            acc = acc * jnp.moveaxis(rescale, 1, 2)[..., None] + _weighted_values(p.astype(v_c.dtype), v_c)
            return new_max, row_sum * rescale + jnp.sum(p, axis=-1), acc

        return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry), None

    def query_block(q_c, q_index_c, q_seg_c):
        """q_c ``[B, C, H, D]`` -> ``[B, C, H, Dv]`` in ``v.dtype``."""
        c = q_c.shape[1]
        # *_like(q_c): inside a shard_map the carry must have q's device-varying type (cond / scan)
        carry = (jnp.full_like(q_c, -jnp.inf, jnp.float32, shape=(b, h, c)),
                 jnp.zeros_like(q_c, jnp.float32, shape=(b, h, c)),
                 jnp.zeros_like(q_c, jnp.float32, shape=(b, c, h, dv)))
        step = lambda carry, kv: key_block(carry, kv, q_c, q_index_c, q_seg_c)  # noqa: E731
        if nk == 1:
            carry, _ = step(carry, jax.tree.map(lambda x: x[0], kv_xs))
        else:
            carry, _ = jax.lax.scan(step, carry, kv_xs)
        _, row_sum, acc = carry
        denom = jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
        return (acc / jnp.moveaxis(denom, 1, 2)[..., None]).astype(v.dtype)

    if nq == 1:
        return query_block(q, q_index, q_segment_ids)
    lowest = jnp.iinfo(q_index.dtype).min
    q_xs = (_blocks(_pad_to(q, nq * cq, 1), cq), _blocks(_pad_to(q_index, nq * cq, 1, lowest), cq),
            None if q_segment_ids is None else _blocks(_pad_to(q_segment_ids, nq * cq, 1), cq))
    # prevent_cse=False: inside a scan the CSE barrier is unnecessary and only costs (jax.checkpoint docs)
    block_remat = jax.checkpoint(query_block, prevent_cse=False)
    out = jax.lax.map(lambda xs: block_remat(*xs), q_xs)  # [Nq, B, Cq, H, Dv]
    return jnp.moveaxis(out, 0, 1).reshape(b, nq * cq, h, dv)[:, :t]

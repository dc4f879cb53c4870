"""Causal softmax attention with packed-document masking (the MLA core)."""

import functools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.cache import read_slots
from k3jax.ops.saved_names import ATTENTION_RESIDUALS
from pallas_kernels.varying import match_varying


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
    einsum or broadcast error deep inside XLA): q ``[B, T, H, D]``, k ``[B, S, H or 1, D]`` or ``[B, S, D]``
    (or a tuple of such parts whose features add up to D), v ``[B, S, H or 1, Dv]`` or ``[B, S, Dv]``; the
    arrays of ``q_shaped`` are ``[B, T]`` and those of ``kv_shaped`` ``[B, S]`` (None entries skipped)."""
    chex.assert_rank(q, 4)
    b, t, h, d = q.shape
    parts = k if isinstance(k, tuple) else (k,)
    s = parts[0].shape[1]
    for x, width in [(x, x.shape[-1]) for x in parts] + [(v, None)]:
        chex.assert_rank(x, {3, 4})
        chex.assert_shape(x, (b, s, width) if x.ndim == 3 else (b, s, {1, h}, width))
    if sum(x.shape[-1] for x in parts) != d:
        raise AssertionError(f"key shape: the features of {[x.shape for x in parts]} do not add up to q's {d}")
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
    chex.assert_rank([k, v], 4)
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


def _qk(q: jax.Array, k: jax.Array) -> jax.Array:
    """q ``[B, C, H, D]``, k ``[B, S, H, D]``, ``[B, S, 1, D]`` or ``[B, S, D]`` -> float32 ``[B, H, C, S]``.

    A shared key (MQA, the absorbed MLA cache) is contracted as is: broadcasting it to H heads first
    would materialise ``[B, S, H, D]``, H times the cache."""
    if k.ndim == 3 or k.shape[2] == 1:
        return jnp.einsum("bthd,bsd->bhts", q, k if k.ndim == 3 else k[:, :, 0], preferred_element_type=jnp.float32)
    return jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)


def _scores(q: jax.Array, k, scale: float) -> jax.Array:
    """q ``[B, C, H, D]``, k as in :func:`_qk`, or a tuple of such parts splitting the D features -> float32
    ``scale * q.k`` ``[B, H, C, S]``. Parts (the absorbed MLA's ``c_kv`` and ``k_rope``, stored apart) are
    contracted each with its features of q and summed: their concatenation would copy the cache."""
    if not isinstance(k, tuple):
        return _qk(q, k) * scale
    scores, at = None, 0
    for part in k:
        width = part.shape[-1]
        term = _qk(q[..., at:at + width], part)
        scores, at = term if scores is None else scores + term, at + width
    return scores * scale


def _weighted_values(p: jax.Array, v: jax.Array) -> jax.Array:
    """p ``[B, H, C, S]``, v ``[B, S, H, Dv]``, ``[B, S, 1, Dv]`` or ``[B, S, Dv]`` -> float32 ``[B, C, H, Dv]``."""
    if v.ndim == 3 or v.shape[2] == 1:
        return jnp.einsum("bhts,bsd->bthd", p, v if v.ndim == 3 else v[:, :, 0], preferred_element_type=jnp.float32)
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


def chunked_attention(q: jax.Array, k, v: jax.Array, q_index: jax.Array, kv_index: jax.Array, *,
                      scale: float, q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                      kv_valid: jax.Array | None = None, kv_layer=None, q_chunk: int = Q_CHUNK,
                      kv_chunk: int = KV_CHUNK) -> jax.Array:
    """Masked softmax attention in bounded memory: ``attention(q, k, v, attention_mask(...))`` computed
    block by block, so neither the ``[B, H, T, S]`` scores nor the ``[B, T, S]`` mask exist whole.

    q ``[B, T, H, D]``; k ``[B, S, H, D]``, or ``[B, S, 1, D]`` / ``[B, S, D]`` (shared by all heads, never
    broadcast), or a tuple of such parts that split the D features (scores summed over the parts: the
    absorbed MLA's ``c_kv`` and ``k_rope`` as stored); v ``[B, S, H, Dv]``, ``[B, S, 1, Dv]`` or ``[B, S, Dv]``
    (it may be a key part: read twice, never copied); q_index ``[B, T]`` / kv_index ``[B, S]`` int positions
    (key j visible to query i iff ``kv_index[j] <= q_index[i]``); optional segment ids ``[B, T]`` /
    ``[B, S]`` and ``kv_valid [B, S]`` bool, as in :func:`attention_mask`. ``kv_layer`` (an int, traced or
    not): k and v lead with a layer axis (``[L, B, S, ...]``, a scanned layer group's stacked cache) and
    the attention reads layer ``kv_layer``'s slots. Returns ``[B, T, H, Dv]`` in ``v.dtype``; a query with
    no visible key gets zeros.

    The queries are cut into blocks of ``q_chunk`` (``lax.map``; each block rematerialised in the
    backward pass, so the gradient holds one query block's intermediates at a time) and each block
    runs an online softmax over key blocks of ``kv_chunk`` (``lax.scan``), each read with a dynamic slice
    of k and v as they are stored (a decode step reads its cache once and copies none of it). A key block
    that no query of the block can see (the causal future, unwritten cache slots) is neither read nor
    attended (``lax.cond``), which halves the work of a causal prefill. Peak memory: forward
    ``O(B·H·q_chunk·kv_chunk)``, backward ``O(B·H·q_chunk·S)``. With ``T <= q_chunk`` and ``S <= kv_chunk``
    this is one block, no loop: short sequences and decode steps pay nothing. T and S need not be
    multiples of the chunks.
    """
    return chunked_attention_with_lse(q, k, v, q_index, kv_index, scale=scale, q_segment_ids=q_segment_ids,
                                      kv_segment_ids=kv_segment_ids, kv_valid=kv_valid, kv_layer=kv_layer,
                                      q_chunk=q_chunk, kv_chunk=kv_chunk, out_dtype=v.dtype)[0]


def chunked_attention_with_lse(q: jax.Array, k, v: jax.Array, q_index: jax.Array, kv_index: jax.Array, *,
                               scale: float, q_segment_ids: jax.Array | None = None,
                               kv_segment_ids: jax.Array | None = None, kv_valid: jax.Array | None = None,
                               kv_layer=None, q_chunk: int = Q_CHUNK, kv_chunk: int = KV_CHUNK,
                               out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """:func:`chunked_attention` (same arguments and blocks) that also returns each query's log-sum-exp
    of its visible scores: (o ``[B, T, H, Dv]`` in ``out_dtype``, lse ``[B, T, H]`` float32; a query
    with no visible key gets zeros and -inf).

    Attention over disjoint key sets combines exactly from these (flash-decoding, split keys):
    ``lse = logsumexp_i lse_i`` and ``o = sum_i exp(lse_i - lse) o_i``, hence the float32 default.
    """
    parts = k if isinstance(k, tuple) else (k,)
    if kv_layer is None:
        _check_shapes(q, k, v, (q_index, q_segment_ids), (kv_index, kv_segment_ids, kv_valid))
    else:  # the shapes of one layer's slice
        one = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
        _check_shapes(q, tuple(map(one, parts)) if isinstance(k, tuple) else one(k), one(v),
                      (q_index, q_segment_ids), (kv_index, kv_segment_ids, kv_valid))
    b, t, h, _ = q.shape
    s, dv = kv_index.shape[1], v.shape[-1]
    cq, ck = min(q_chunk, t), min(kv_chunk, s)
    nq, nk = -(-t // cq), -(-s // ck)
    if kv_valid is None:
        kv_valid = jnp.ones((b, s), bool)

    def key_block(carry, i, q_c, q_index_c, q_seg_c):
        """Online-softmax step over key block ``i``: carry (max ``[B, H, C]``, sum ``[B, H, C]``, acc
        ``[B, C, H, Dv]``). The block holds slots ``[i * ck, (i + 1) * ck)``; when S is not a multiple of
        ``ck`` the last block ends at slot S instead, its slots before ``i * ck`` (the previous block's)
        masked: the keys are read where they lie, never padded."""
        first = i * ck
        start = jnp.minimum(first, s - ck) if s % ck else first
        kv_index_c, kv_valid_c = read_slots(kv_index, start, ck), read_slots(kv_valid, start, ck)
        if s % ck:
            kv_valid_c &= (start + jnp.arange(ck) >= first)[None]
        kv_seg_c = None if kv_segment_ids is None else read_slots(kv_segment_ids, start, ck)
        mask = attention_mask(q_index_c, kv_index_c, q_seg_c, kv_seg_c, kv_valid_c)  # [B, C, Ck]

        def update(carry):
            row_max, row_sum, acc = carry
            k_c = tuple(read_slots(x, start, ck, kv_layer) for x in parts)
            v_c = read_slots(v, start, ck, kv_layer)
            scores = jnp.where(mask[:, None], _scores(q_c, k_c if isinstance(k, tuple) else k_c[0], scale), -jnp.inf)
            # The shift cancels in acc / row_sum, so it carries no gradient (as in `attention`).
            new_max = jnp.maximum(row_max, jax.lax.stop_gradient(jnp.max(scores, axis=-1)))
            shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
            p = jnp.exp(scores - shift[..., None])
            rescale = jnp.exp(row_max - shift)  # 0 while row_max is -inf
            acc = acc * jnp.moveaxis(rescale, 1, 2)[..., None] + _weighted_values(p.astype(v_c.dtype), v_c)
            return new_max, row_sum * rescale + jnp.sum(p, axis=-1), acc

        return jax.lax.cond(jnp.any(mask), update, lambda c: c, carry), None

    def query_block(q_c, q_index_c, q_seg_c):
        """q_c ``[B, C, H, D]`` -> (``[B, C, H, Dv]`` in ``out_dtype``, lse ``[B, C, H]`` float32)."""
        c = q_c.shape[1]
        # *_like(q_c): inside a shard_map the carry must have q's device-varying type (cond / scan)
        carry = (jnp.full_like(q_c, -jnp.inf, jnp.float32, shape=(b, h, c)),
                 jnp.zeros_like(q_c, jnp.float32, shape=(b, h, c)),
                 jnp.zeros_like(q_c, jnp.float32, shape=(b, c, h, dv)))
        step = lambda carry, i: key_block(carry, i, q_c, q_index_c, q_seg_c)  # noqa: E731
        if nk == 1:
            carry, _ = step(carry, 0)
        else:
            carry, _ = jax.lax.scan(step, carry, jnp.arange(nk, dtype=jnp.int32))
        row_max, row_sum, acc = carry
        denom = jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
        lse = jnp.where(jnp.isfinite(row_max), row_max + jnp.log(denom), -jnp.inf)  # row_max: -inf if nothing seen
        return (acc / jnp.moveaxis(denom, 1, 2)[..., None]).astype(out_dtype), jnp.moveaxis(lse, 1, 2)

    if nq == 1:
        return query_block(q, q_index, q_segment_ids)
    # padded queries get the lowest index (they see nothing) and are dropped
    lowest = jnp.iinfo(q_index.dtype).min
    q_xs = (_blocks(_pad_to(q, nq * cq, 1), cq), _blocks(_pad_to(q_index, nq * cq, 1, lowest), cq),
            None if q_segment_ids is None else _blocks(_pad_to(q_segment_ids, nq * cq, 1), cq))
    # prevent_cse=False: inside a scan the CSE barrier is unnecessary and only costs (jax.checkpoint docs)
    block_remat = jax.checkpoint(query_block, prevent_cse=False)
    out, lse = jax.lax.map(lambda xs: block_remat(*xs), q_xs)  # [Nq, B, Cq, H, Dv], [Nq, B, Cq, H]
    return (jnp.moveaxis(out, 0, 1).reshape(b, nq * cq, h, dv)[:, :t],
            jnp.moveaxis(lse, 0, 1).reshape(b, nq * cq, h)[:, :t])


# Expand = (kv block [B, C, L], params) -> (keys [B, C, H, D], values [B, C, H, Dv])
Expand = Callable[[jax.Array, Any], tuple[jax.Array, jax.Array]]


def _vary_together(tree):
    """The leaves of ``tree`` made device-varying over every manual mesh axis any of them varies over
    (inside ``jax.shard_map``; a no-op elsewhere). A ``custom_vjp`` returns cotangents of its inputs'
    types and its loops' carries must keep one type, so a weight shared by the devices is made varying
    before the call (JAX then sums its gradient over them)."""
    ref = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        ref = match_varying(ref, x)
    return jax.tree.map(lambda x: match_varying(x, ref), tree)


def latent_attention(q: jax.Array, kv: jax.Array, params, q_index: jax.Array, kv_index: jax.Array, *,
                     expand: Expand, scale: float, q_segment_ids: jax.Array | None = None,
                     kv_segment_ids: jax.Array | None = None, q_chunk: int = Q_CHUNK,
                     kv_chunk: int = KV_CHUNK) -> jax.Array:
    """Causal, segment-masked softmax attention whose keys and values are expanded from a compact
    per-token KV one key block at a time, forward and backward (flash-attention style, custom VJP):
    the ``[B, S, H, D]`` keys and values of the whole sequence never exist.

    q ``[B, T, H, D]``; kv ``[B, S, L]`` (MLA: the normalised ``c_kv | k_rope``, L = 576 for K3 where
    the expanded keys and values are 96 x 320 = 30720 values per token); ``params`` (a pytree: MLA's
    ``kv_b``) and ``expand(kv_block, params) -> (k [B, C, H, D], v [B, C, H, Dv])``, a fixed function of
    static configuration; q_index ``[B, T]`` / kv_index ``[B, S]`` int positions (key j visible to
    query i iff ``kv_index[j] <= q_index[i]``), optional segment ids ``[B, T]`` / ``[B, S]`` (as in
    :func:`attention_mask`). Returns ``[B, T, H, Dv]`` in v's dtype; a query with no visible key gets
    zeros. Gradients flow to q, kv and params.

    Both passes loop over key blocks of ``kv_chunk`` (each expanded once per pass, and its expansion's
    VJP applied once in the backward) and, inside, over query blocks of ``q_chunk``. A key block that
    lies entirely in the future of every query (a sequence shard's later shards) is neither expanded
    nor attended; a (query block, key block) pair with nothing visible (the causal future, other
    documents) is skipped (``lax.cond``). Memory: the online-softmax state ``[B, T, H, Dv + 2]`` float32
    (forward) or the query gradient ``[B, T, H, D]`` float32 (backward), plus one key block's keys and
    values and one block pair's ``[B, H, q_chunk, kv_chunk]`` scores; saved for the backward: q, kv, the
    output and the log-sum-exp ``[B, T, H]``.
    """
    chex.assert_rank([q, kv], [4, 3])
    b, t = q.shape[:2]
    s = kv.shape[1]
    chex.assert_shape([x for x in (q_index, q_segment_ids) if x is not None], (b, t))
    chex.assert_shape([x for x in (kv_index, kv_segment_ids) if x is not None], (b, s))
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("latent_attention: give both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is None:  # one segment
        q_segment_ids, kv_segment_ids = jnp.zeros_like(q_index), jnp.zeros_like(kv_index)
    cq, ck = min(q_chunk, t), min(kv_chunk, s)
    nq, nk = -(-t // cq), -(-s // ck)
    # padded queries sit before every key, padded keys after every query: never visible
    q_xs = (_blocks(_pad_to(q, nq * cq, 1), cq),
            _blocks(_pad_to(q_index, nq * cq, 1, jnp.iinfo(q_index.dtype).min), cq),
            _blocks(_pad_to(q_segment_ids, nq * cq, 1), cq))
    kv_xs = (_blocks(_pad_to(kv, nk * ck, 1), ck),
             _blocks(_pad_to(kv_index, nk * ck, 1, jnp.iinfo(kv_index.dtype).max), ck),
             _blocks(_pad_to(kv_segment_ids, nk * ck, 1), ck))
    q_xs, kv_xs, params = _vary_together((q_xs, kv_xs, params))
    o_blocks = _latent_attention(q_xs, kv_xs, params, expand, scale)  # [Nq, B, Cq, H, Dv]
    return jnp.moveaxis(o_blocks, 0, 1).reshape((b, nq * cq) + o_blocks.shape[3:])[:, :t]


def _block_pairs_visible(q_index_c, q_seg_c, kv_index_c, kv_seg_c):
    """``[B, Cq, Ck]`` mask of one block pair and whether any entry is set."""
    mask = attention_mask(q_index_c, kv_index_c, q_seg_c, kv_seg_c)
    return mask, jnp.any(mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _latent_attention(q_xs, kv_xs, params, expand, scale):
    return _latent_attention_fwd(q_xs, kv_xs, params, expand, scale)[0]


def _latent_attention_fwd(q_xs, kv_xs, params, expand, scale):
    """q_xs: query blocks ``[Nq, B, Cq, H, D]`` with their positions and segments ``[Nq, B, Cq]``; kv_xs:
    kv blocks ``[Nk, B, Ck, L]`` with ``[Nk, B, Ck]`` positions and segments. -> (o ``[Nq, B, Cq, H, Dv]``,
    residuals)."""
    # The positions and segments are tied to the queries and the latent. Inside a differentiated
    # ``lax.scan`` over layers they are loop-invariant while q and kv are not, and JAX hoists the
    # loop-invariant part of the linearized body out of the loop (``_scan_known_hoisting``): the block
    # pairs' masks ``[Nk, Nq, B, H, Cq, Ck]`` of every key block and query block at once (full K3 on a
    # 1M-token row: 1 TB per device). Tied, they are built one block pair at a time as written.
    q_xs, kv_xs = jax.lax.optimization_barrier((q_xs, kv_xs))
    qb, q_index, q_seg = q_xs
    nq, b, cq, h, _ = qb.shape
    k0, v0 = jax.eval_shape(expand, kv_xs[0][0], params)
    dv = v0.shape[-1]
    last_query = jnp.max(q_index)

    def key_block(state, kv_x):
        kv_c, kv_index_c, kv_seg_c = kv_x

        def attend(state):
            k_c, v_c = expand(kv_c, params)

            def query_block(_, x):
                q_c, q_index_c, q_seg_c, row_max, row_sum, acc = x
                mask, any_visible = _block_pairs_visible(q_index_c, q_seg_c, kv_index_c, kv_seg_c)

                def update(carry):
                    row_max, row_sum, acc = carry
                    scores = jnp.where(mask[:, None], _scores(q_c, k_c, scale), -jnp.inf)  # [B, H, Cq, Ck]
                    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
                    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with nothing visible yet
                    p = jnp.exp(scores - shift[..., None])
                    rescale = jnp.exp(row_max - shift)  # 0 while row_max is -inf
                    acc = acc * jnp.moveaxis(rescale, 1, 2)[..., None] + _weighted_values(p.astype(v_c.dtype), v_c)
                    return new_max, row_sum * rescale + jnp.sum(p, axis=-1), acc

                return None, jax.lax.cond(any_visible, update, lambda c: c, (row_max, row_sum, acc))

            _, state = jax.lax.scan(query_block, None, (qb, q_index, q_seg, *state))
            return state

        # a key block after every query (a later sequence shard's) is neither expanded nor attended
        return jax.lax.cond(jnp.min(kv_index_c) <= last_query, attend, lambda c: c, state), None

    # *_like(qb): the carries keep the inputs' device-varying type inside a shard_map
    state = (jnp.full_like(qb, -jnp.inf, jnp.float32, shape=(nq, b, h, cq)),
             jnp.zeros_like(qb, jnp.float32, shape=(nq, b, h, cq)),
             jnp.zeros_like(qb, jnp.float32, shape=(nq, b, cq, h, dv)))
    (row_max, row_sum, acc), _ = jax.lax.scan(key_block, state, kv_xs)
    seen = row_sum > 0
    o = (acc / jnp.moveaxis(jnp.where(seen, row_sum, 1.0), 2, 3)[..., None]).astype(v0.dtype)
    lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)  # [Nq, B, H, Cq]
    # named: a remat policy that keeps them spares the backward this whole pass (saved_names)
    o, lse = checkpoint_name(o, ATTENTION_RESIDUALS), checkpoint_name(lse, ATTENTION_RESIDUALS)
    return o, (q_xs, kv_xs, params, o, lse)


def _latent_attention_bwd(expand, scale, res, do):
    """Flash-attention backward: per key block, the keys and values are re-expanded, the block's key and
    value gradients summed over the query blocks, and pulled back through the expansion once."""
    q_xs, kv_xs, params, o, lse = res
    qb, q_index, q_seg = q_xs
    last_query = jnp.max(q_index)
    # D_i = sum_d dO_i o_i, [Nq, B, H, Cq]: the softmax's row term
    delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), 2, 3)
    lse_shift = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def key_block(carry, kv_x):
        kv_c, kv_index_c, kv_seg_c = kv_x

        def attend(carry):
            dq, dparams = carry
            (k_c, v_c), pullback = jax.vjp(expand, kv_c, params)

            def query_block(dkv, x):
                q_c, q_index_c, q_seg_c, do_c, lse_c, delta_c, dq_c = x
                mask, any_visible = _block_pairs_visible(q_index_c, q_seg_c, kv_index_c, kv_seg_c)

                def update(args):
                    (dk, dv), dq_c = args
                    p = jnp.where(mask[:, None], jnp.exp(_scores(q_c, k_c, scale) - lse_c[..., None]), 0.0)
                    dv = dv + jnp.einsum("bhts,bthd->bshd", p.astype(do_c.dtype), do_c,
                                         preferred_element_type=jnp.float32)
                    dp = jnp.einsum("bthd,bshd->bhts", do_c, v_c, preferred_element_type=jnp.float32)
                    ds = (p * (dp - delta_c[..., None]) * scale).astype(q_c.dtype)  # d(q.k), [B, H, Cq, Ck]
                    dq_c = dq_c + jnp.einsum("bhts,bshd->bthd", ds, k_c, preferred_element_type=jnp.float32)
                    dk = dk + jnp.einsum("bhts,bthd->bshd", ds, q_c, preferred_element_type=jnp.float32)
                    return (dk, dv), dq_c

                dkv, dq_c = jax.lax.cond(any_visible, update, lambda a: a, (dkv, dq_c))
                return dkv, dq_c

            zeros = (jnp.zeros_like(k_c, jnp.float32), jnp.zeros_like(v_c, jnp.float32))
            (dk, dv), dq = jax.lax.scan(query_block, zeros, (qb, q_index, q_seg, do, lse_shift, delta, dq))
            dkv_c, dparams_c = pullback((dk.astype(k_c.dtype), dv.astype(v_c.dtype)))
            dparams = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), dparams, dparams_c)
            return (dq, dparams), dkv_c

        skip = lambda carry: (carry, jnp.zeros_like(kv_c))  # noqa: E731
        return jax.lax.cond(jnp.min(kv_index_c) <= last_query, attend, skip, carry)

    dq0 = jnp.zeros_like(qb, jnp.float32)
    dparams0 = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)
    (dq, dparams), dkv = jax.lax.scan(key_block, (dq0, dparams0), kv_xs)
    dparams = jax.tree.map(lambda g, p: g.astype(p.dtype), dparams, params)
    none_like = lambda xs: (xs[0],) + (None,) * (len(xs) - 1)  # noqa: E731 - integer positions and segments
    return none_like((dq.astype(qb.dtype), *q_xs[1:])), none_like((dkv, *kv_xs[1:])), dparams


_latent_attention.defvjp(_latent_attention_fwd, _latent_attention_bwd)

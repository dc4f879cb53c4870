"""Decoding caches: what each layer keeps between calls of ``model(tokens, cache=...)``.

Layout (a pytree; B = batch, S = max_len, H heads):

- KDA layer: ``KDACache(state [B, H, K, V] float32, conv_q / conv_k / conv_v [B, W-1, H*K])`` — the
  fixed-size delta-rule state and the last ``W-1`` inputs of each short convolution. Its size does
  not depend on the context length.
- MLA layer: ``MLACache(ckv [B, S, kv_lora], k_rope [B, S, rope])`` — only the normalised compressed
  latent and the shared (already rotated) rope key: 576 values per token for K3. Decoding absorbs the
  key up-projection into the query and attends over this latent directly (MQA over 576 dims).
- Block AttnRes needs nothing: its sources at a position are functions of that position only.
- Model: ``ModelCache(prefix, groups, suffix, length, positions, valid)``: per-layer caches in the
  model's layer plan (the scanned groups' caches stacked with a leading group axis), ``length`` = slots
  written so far (the same for every row), ``positions [B]`` = next position of each row (real
  tokens seen), ``valid [B, S]`` = which slots hold real tokens.

Batches of prompts with different lengths are **left-padded**: padding slots are marked invalid and
are no-ops for every layer, so all rows then decode in lockstep at the same slot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layer_plan import LayerPlan


class KDACache(NamedTuple):
    state: jax.Array  # [B, H, K, V] float32
    conv_q: jax.Array  # [B, W-1, H*K]
    conv_k: jax.Array
    conv_v: jax.Array


class MLACache(NamedTuple):
    ckv: jax.Array  # [B, S, kv_lora]
    k_rope: jax.Array  # [B, S, rope]


class ModelCache(NamedTuple):
    prefix: tuple
    groups: tuple  # one stacked cache per slot of the repeating group
    suffix: tuple
    length: jax.Array  # [] int32
    positions: jax.Array  # [B] int32
    valid: jax.Array  # [B, S] bool

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]


def read_slots(x: jax.Array, start, size: int, layer=None) -> jax.Array:
    """Slots ``[start, start + size)`` of ``x [B, S, ...]``, or of layer ``layer`` of a scanned group's stacked
    ``x [L, B, S, ...]`` (``start`` / ``layer`` traced or not) -> ``[B, size, ...]``: one dynamic slice of the
    array as stored, so a loop over key blocks reads each block where it lies and nothing copies the cache."""
    if layer is None:
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
    rest = (0,) * (x.ndim - 3)
    return jax.lax.dynamic_slice(x, (layer, 0, start, *rest), (1, x.shape[1], size, *x.shape[3:]))[0]


def update_slots(x: jax.Array, new: jax.Array, start, layer=None) -> jax.Array:
    """``x [B, S, ...]`` (or layer ``layer`` of ``x [L, B, S, ...]``) with ``new [B, T, ...]`` written at slots
    ``[start, start + T)``: one dynamic update of the T slots, in place in a donated or scan-carried cache
    (a decode step writes one slot per row of its layer, not the layer's whole slice)."""
    new = new.astype(x.dtype)
    if layer is None:
        return jax.lax.dynamic_update_slice_in_dim(x, new, start, axis=1)
    rest = (0,) * (x.ndim - 3)
    return jax.lax.dynamic_update_slice(x, new[None], (layer, 0, start, *rest))


def layer_cache(cfg: ModelConfig, mixer: str, batch: int, max_len: int, dtype) -> KDACache | MLACache:
    if mixer == "kda":
        c = cfg.kda
        conv = jnp.zeros((batch, max(c.conv_size - 1, 0), c.num_heads * c.head_dim), dtype)
        state = jnp.zeros((batch, c.num_heads, c.head_dim, c.head_dim), jnp.float32)
        return KDACache(state, conv, conv, conv)
    c = cfg.mla
    return MLACache(jnp.zeros((batch, max_len, c.kv_lora_rank), dtype),
                    jnp.zeros((batch, max_len, c.qk_rope_head_dim), dtype))


def init_cache(cfg: ModelConfig, plan: LayerPlan, batch: int, max_len: int) -> ModelCache:
    """An empty cache for ``batch`` rows of up to ``max_len`` slots (prompt + generated)."""
    if max_len > cfg.max_seq_len:
        raise ValueError(f"cache length {max_len} exceeds model.max_seq_len={cfg.max_seq_len}")
    dtype = jnp.dtype(cfg.dtype)

    def one(i):
        return layer_cache(cfg, cfg.mixer(i), batch, max_len, dtype)

    def stacked(slot):
        return jax.tree.map(lambda *xs: jnp.stack(xs), *[one(i) for i in plan.slot_layers(slot)])

    return ModelCache(prefix=tuple(one(i) for i in plan.prefix),
                      groups=tuple(stacked(s) for s in range(plan.period)) if plan.num_groups else (),
                      suffix=tuple(one(i) for i in plan.suffix),
                      length=jnp.zeros((), jnp.int32), positions=jnp.zeros((batch,), jnp.int32),
                      valid=jnp.zeros((batch, max_len), bool))


def _move_slots(x: jax.Array, slot_axis: int, shift, size: int) -> jax.Array:
    """``x`` with slot ``s`` moved to ``s + shift`` along ``slot_axis`` and ``size`` slots out; slots
    with no source are zero (False)."""
    src = jnp.arange(size, dtype=jnp.int32) - shift
    inside = (src >= 0) & (src < x.shape[slot_axis])
    moved = jnp.take(x, jnp.clip(src, 0, x.shape[slot_axis] - 1), axis=slot_axis)
    return jnp.where(inside.reshape((-1,) + (1,) * (x.ndim - slot_axis - 1)), moved, jnp.zeros((), x.dtype))


def _layer_caches(cache: ModelCache):
    """(layer cache, batch axis) for every layer: the scanned groups' caches lead with the group axis."""
    return [(c, 0) for c in cache.prefix] + [(c, 1) for c in cache.groups] + [(c, 0) for c in cache.suffix]


def _rebuild(cache: ModelCache, layers: list, **fields) -> ModelCache:
    n, g = len(cache.prefix), len(cache.groups)
    return cache._replace(prefix=tuple(layers[:n]), groups=tuple(layers[n:n + g]), suffix=tuple(layers[n + g:]),
                          **fields)


def shift_slots(cache: ModelCache, shift) -> ModelCache:
    """Every row's slots moved by ``shift`` (an int, traced or not): slot ``s`` -> ``s + shift``, and
    ``length`` with them. Slots moved past either end are dropped (the caller keeps every row's valid
    slots inside). Decoding is unchanged by the move: MLA reads slots only through ``valid`` and the
    causal mask against the write position (all of a row's slots precede it), and rope keys are
    stored already rotated at their token positions. KDA states and conv tails have no slots.
    """
    layers = [type(c)(*(_move_slots(x, b + 1, shift, x.shape[b + 1]) for x in c)) if isinstance(c, MLACache) else c
              for c, b in _layer_caches(cache)]
    return _rebuild(cache, layers, length=cache.length + shift,
                    valid=_move_slots(cache.valid, 1, shift, cache.max_len))


def write_row(cache: ModelCache, row, src: ModelCache, shift, src_row=0) -> ModelCache:
    """``cache`` with row ``row`` (an int, traced or not) replaced by row ``src_row`` of ``src`` (a cache
    of the same model, any number of rows and slots), its slots moved by ``shift`` as in
    :func:`shift_slots`: a prefilled request joins a running batch whose write position is
    ``cache.length`` when ``shift = cache.length - src.length``. ``cache.length`` is unchanged."""

    def put(dst, x, batch_axis, slot_axis):
        x = jnp.take(x, src_row, axis=batch_axis)
        if slot_axis is not None:
            x = _move_slots(x, slot_axis - 1, shift, dst.shape[slot_axis])
        index = (slice(None),) * batch_axis + (row,)
        return dst.at[index].set(x.astype(dst.dtype))

    layers = []
    for (c, b), (s, _) in zip(_layer_caches(cache), _layer_caches(src)):
        slot_axis = b + 1 if isinstance(c, MLACache) else None
        layers.append(type(c)(*(put(d, x, b, slot_axis) for d, x in zip(c, s))))
    return _rebuild(cache, layers, positions=cache.positions.at[row].set(src.positions[src_row]),
                    valid=put(cache.valid, src.valid, 0, 1))


def first_rows(cache: ModelCache, n: int) -> ModelCache:
    """Rows ``[0, n)`` of ``cache`` (a static ``n``): the cache of an ``n``-row batch at the same write
    position, to decode the leading rows of a pool with a smaller program (:func:`put_first_rows`)."""
    layers = [type(c)(*(jax.lax.slice_in_dim(x, 0, n, axis=b) for x in c)) for c, b in _layer_caches(cache)]
    return _rebuild(cache, layers, positions=cache.positions[:n], valid=cache.valid[:n])


def put_first_rows(cache: ModelCache, rows: ModelCache) -> ModelCache:
    """``cache`` with its first rows replaced by ``rows`` (a cache of the same model and slots with fewer
    rows, e.g. :func:`first_rows` decoded further) and ``rows``' write position. The other rows keep
    what they held: a step of the whole batch with their tokens marked invalid would differ only in
    their short-conv tails (a zero input pushed in) and in the invalid slot it writes."""
    layers = [type(c)(*(jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), 0, axis=b) for x, y in zip(c, r)))
              for (c, b), (r, _) in zip(_layer_caches(cache), _layer_caches(rows))]
    return _rebuild(cache, layers, length=rows.length,
                    positions=jax.lax.dynamic_update_slice_in_dim(cache.positions, rows.positions, 0, axis=0),
                    valid=jax.lax.dynamic_update_slice_in_dim(cache.valid, rows.valid, 0, axis=0))


def cache_bytes(cache: ModelCache) -> int:
    """Memory of a cache in bytes."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))


def read_block(cache: ModelCache, row, start, size: int) -> ModelCache:
    """Row ``row``'s slots ``[start, start + size)`` (``row`` / ``start`` traced or not, ``size`` static) and
    its KDA states as they are now, as a 1-row cache of ``size`` slots (``length = size``, the row's
    position): a snapshot of the row's prefix ending at slot ``start + size`` (``write_block`` puts it back)."""

    def take(x, batch_axis, slot_axis):
        x = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=batch_axis)
        return x if slot_axis is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=slot_axis)

    layers = [type(c)(*(take(x, b, b + 1 if isinstance(c, MLACache) else None) for x in c))
              for c, b in _layer_caches(cache)]
    return _rebuild(cache, layers, length=jnp.asarray(size, jnp.int32),
                    positions=jax.lax.dynamic_slice_in_dim(cache.positions, row, 1),
                    valid=take(cache.valid, 0, 1))


def write_block(cache: ModelCache, row, start, block: ModelCache) -> ModelCache:
    """``cache`` with ``block`` (a 1-row cache, e.g. from :func:`read_block`) written into row ``row`` at
    slots ``[start, start + block.max_len)``, the row's KDA states and position replaced by the block's;
    the row's other slots and ``cache.length`` are unchanged. Writing a prefix's blocks in order rebuilds it."""

    def put(dst, x, batch_axis, slot_axis):
        index = [0] * dst.ndim
        index[batch_axis] = row
        if slot_axis is not None:
            index[slot_axis] = start
        return jax.lax.dynamic_update_slice(dst, x.astype(dst.dtype), tuple(jnp.asarray(i, jnp.int32) for i in index))

    layers = [type(c)(*(put(d, x, b, b + 1 if isinstance(c, MLACache) else None) for d, x in zip(c, s)))
              for (c, b), (s, _) in zip(_layer_caches(cache), _layer_caches(block))]
    return _rebuild(cache, layers, positions=put(cache.positions, block.positions, 0, None),
                    valid=put(cache.valid, block.valid, 0, 1))


def keep_rows(new: ModelCache, old: ModelCache, keep: jax.Array) -> ModelCache:
    """``new`` with the KDA states and conv tails of the rows where ``keep [B]`` is True taken from ``old``:
    a call in which a row has no valid token must leave it as it was, but it pushes that row's short
    convolutions a zero input per token (padding is a no-op only before a row's first token)."""

    def pick(n, o, batch_axis):
        k = keep.reshape((1,) * batch_axis + (-1,) + (1,) * (n.ndim - batch_axis - 1))
        return jnp.where(k, o, n)

    layers = [c if isinstance(c, MLACache) else type(c)(*(pick(n, o, b) for n, o in zip(c, p)))
              for (c, b), (p, _) in zip(_layer_caches(new), _layer_caches(old))]
    return _rebuild(new, layers)


def pack_row(cache: ModelCache, row) -> ModelCache:
    """Row ``row`` alone, as a 1-row cache of the same slots whose valid slots are moved, in order, to the
    last slots (``length`` = all slots): a row with invalid slots between its tokens (a prefill that skipped
    it for some calls) becomes one run ending at the write position, as :func:`write_row` expects. Exact
    for decoding, as :func:`shift_slots`: MLA reads slots only through ``valid``, rope keys are stored rotated."""
    valid = jax.lax.dynamic_index_in_dim(cache.valid, row, 0, keepdims=False)
    order = jnp.argsort(valid, stable=True)  # invalid slots first, then the valid ones in their order

    def take(x, batch_axis, slot_axis):
        x = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=batch_axis)
        return x if slot_axis is None else jnp.take(x, order, axis=slot_axis)

    layers = [type(c)(*(take(x, b, b + 1 if isinstance(c, MLACache) else None) for x in c))
              for c, b in _layer_caches(cache)]
    return _rebuild(cache, layers, length=jnp.asarray(cache.max_len, jnp.int32),
                    positions=jax.lax.dynamic_slice_in_dim(cache.positions, row, 1), valid=take(cache.valid, 0, 1))

"""Attention over a decoding cache whose slots are split over devices, and the write of new slots.

A long cache is spread over every mesh axis the (often tiny) decode batch leaves free: the
``cache_length`` rule of ``k3jax.sharding``. Left to GSPMD, the blockwise attention
(``k3jax.ops.attention.chunked_attention``: a ``lax.scan`` over key blocks inside a ``lax.map`` over
query blocks) cannot be partitioned: each iteration's dynamic slice of the split slot axis becomes a
collective and every device repeats the whole loop (K3's 16K-token prefill chunk into a 1M-slot cache
on v5p-128: 32x the MLA's FLOPs and 3.6 PB of all-reduce per device). Here the loops run inside a
``jax.shard_map`` on local arrays, in one of two layouts:

- **Split keys** (flash-decoding), for few queries: each device attends all the queries over its own
  slots and returns its partial output and log-sum-exp (``chunked_attention_with_lse``); the partials
  are combined with one ``pmax`` and one ``psum`` over the slot axes (each weighted by
  ``exp(lse_i - max)``). Slots that are unwritten, invalid or in a query's causal future contribute
  nothing; a device with nothing visible returns ``lse = -inf`` and zeros.
- **Split queries**, for a prefill chunk with many queries: the queries stay split over time (over the
  slot axes), the cache is all-gathered once (the absorbed MLA's ``c_kv | k_rope`` latent, 576 values
  per slot for K3) and each device attends its own queries over all slots.

The choice (:func:`choose_split`) is by bytes a device moves: the split-queries gather of the cache,
``S · D`` elements, against the split-keys traffic, the queries gathered to every device
(``T · H · D``) plus the float32 partials' all-reduce (``2 · T · H · (Dv + 2)`` words: output, lse and
max; an all-reduce counts twice, as ``k3jax.aot.breakdown`` counts it). Split queries needs T divisible by
the slot shards. A decode step (T = 1) always splits keys; K3's 16K-token chunk into a 1M-slot cache
splits queries (1.2 GB gathered against 8.3 GB of queries and partials); a small model's short
chunks split keys.

New entries are written (:func:`write_slots`) by the devices that hold their slots, each in a window
of ``min(T, s)`` of its ``s`` slots; GSPMD writes a chunk into the split slot axis by gathering the
whole cache (1.2 GB per K3 MLA layer and prefill chunk at 1M slots).

The batch splits as the cache's batch does, and the heads over the ``heads`` rule's axes when those
are not slot axes (the other axes hold replicas); the mesh axes all come from the active rule table.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.cache import read_slots, update_slots
from k3jax.ops.attention import KV_CHUNK, Q_CHUNK, chunked_attention, chunked_attention_with_lse
from k3jax.sharding import axis_size, current_mesh, logical_to_spec, spec_axes

Split = Literal["keys", "queries"]


def _specs(mesh, batch: int, slots: int, heads: int):
    """(batch entry, slot axes, heads entry): the cache's ``[B, S, ...]`` layout (``cache_batch``,
    ``cache_length``) and the heads over the ``heads`` rule's axes that the rows and the slots leave free."""
    b_entry, s_entry, h_entry = logical_to_spec(("cache_batch", "cache_length", "heads"), None, mesh,
                                                (batch, slots, heads))
    return b_entry, spec_axes(s_entry), h_entry


def slot_shards(batch: int, slots: int, mesh=None) -> int:
    """How many devices a ``[batch, slots, ...]`` cache's slots are split over under the current mesh (1
    without one)."""
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None:
        return 1
    return math.prod(axis_size(mesh, a) for a in spec_axes(logical_to_spec(("cache_batch", "cache_length"), None, mesh,
                                                                           (batch, slots))[1]))


def choose_split(*, queries: int, slots: int, heads: int, key_dim: int, value_dim: int, shards: int,
                 q_itemsize: int, kv_itemsize: int) -> Split:
    """The layout that moves fewer bytes per device and batch row (module docstring): ``"queries"`` when the
    queries divide over the ``shards`` and the gathered cache (``slots x key_dim``) is no larger than the
    queries gathered plus the float32 partials' all-reduce (``heads``: a device's heads), else ``"keys"``."""
    if queries % shards:
        return "keys"
    gather = slots * key_dim * kv_itemsize
    combine = queries * heads * (key_dim * q_itemsize + 2 * (value_dim + 2) * 4)
    return "queries" if gather <= combine else "keys"


def cache_attention(q: jax.Array, kv: tuple[jax.Array, ...], q_index: jax.Array, kv_valid: jax.Array | None, *,
                    scale: float, kv_layer=None, split: Split | None = None, q_chunk: int = Q_CHUNK,
                    kv_chunk: int = KV_CHUNK) -> jax.Array:
    """Multi-query attention over a slot-split cache stored as key parts whose first part is also the
    values (the absorbed MLA: keys ``c_kv | k_rope``, values ``c_kv``).

    q ``[B, T, H, D]``; kv: the parts ``[B, S, D_i]`` (slot j at position j), their features adding up to
    D, or ``[L, B, S, D_i]`` and ``kv_layer`` (a scanned group's stacked cache: layer ``kv_layer`` is read
    in place); q_index ``[B, T]`` the queries' slots (key j visible to query i iff ``j <= q_index[i]`` and
    ``kv_valid[j]``); kv_valid ``[B, S]`` bool or None (all valid). Returns ``[B, T, H, Dv]`` (Dv: the first
    part's width) in its dtype, what ``chunked_attention(q, kv, kv[0], q_index, arange(S), kv_valid=...)``
    returns. ``split``: the layout (None: :func:`choose_split`'s); ``q_chunk`` / ``kv_chunk``: the blocks
    of each device's ``chunked_attention``.
    """
    mesh = current_mesh()
    (b, t, h, d), s = q.shape, kv[0].shape[-2]
    value_dim = kv[0].shape[-1]
    shards = slot_shards(b, s, mesh)
    if shards == 1:
        raise ValueError(f"cache_attention: the cache's {s} slots are not split under the current mesh")
    b_entry, axes, h_entry = _specs(mesh, b, s, h)
    if split is None:
        local_heads = h // math.prod(axis_size(mesh, a) for a in spec_axes(h_entry))
        split = choose_split(queries=t, slots=s, heads=local_heads, key_dim=d, value_dim=value_dim, shards=shards,
                             q_itemsize=q.dtype.itemsize, kv_itemsize=kv[0].dtype.itemsize)
    if split == "queries" and t % shards:
        raise ValueError(f"cache_attention: {t} queries do not split over {shards} slot shards")
    if kv_valid is None:
        kv_valid = jnp.ones((b, s), bool)
    layers = () if kv_layer is None else (None,)  # the stacked cache's layer axis is whole on every device
    cache, valid = P(*layers, b_entry, axes, None), P(b_entry, axes)
    t_entry = axes if split == "queries" else None
    queries, index = P(b_entry, t_entry, h_entry, None), P(b_entry, t_entry)
    body = _split_queries if split == "queries" else _split_keys
    body = functools.partial(body, axes=axes, scale=scale, q_chunk=q_chunk, kv_chunk=kv_chunk)
    args, specs = (q, tuple(kv), q_index, kv_valid), (queries, (cache,) * len(kv), index, valid)
    if kv_layer is not None:
        args, specs = args + (jnp.asarray(kv_layer, jnp.int32),), specs + (P(),)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=queries)(*args)


def _split_keys(q, kv, q_index, kv_valid, layer=None, *, axes, scale, q_chunk, kv_chunk):
    """One slot shard: all queries ``[B, T, h, D]`` over its own slots (parts ``[B, s, D_i]``, or layer
    ``layer`` of ``[L, B, s, D_i]``, read in place); partials combined."""
    b, s = kv_valid.shape
    kv_index = jnp.broadcast_to(jax.lax.axis_index(axes) * s + jnp.arange(s, dtype=jnp.int32), (b, s))
    q = jax.lax.pcast(q, axes, to="varying")  # the shared queries meet this shard's own slots
    o, lse = chunked_attention_with_lse(q, kv, kv[0], q_index, kv_index, kv_valid=kv_valid, kv_layer=layer,
                                        scale=scale, q_chunk=q_chunk, kv_chunk=kv_chunk)  # [B, T, h, Dv] float32
    top = jax.lax.pmax(lse, axes)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # 0 for a shard that sees nothing
    total = jax.lax.psum(weight, axes)
    o = jax.lax.psum(o * weight[..., None], axes) / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
    return o.astype(kv[0].dtype)


def _split_queries(q, kv, q_index, kv_valid, layer=None, *, axes, scale, q_chunk, kv_chunk):
    """One query shard: its queries ``[B, t, h, D]`` over the gathered cache (parts ``[B, S, D_i]``)."""
    if layer is not None:  # the layer's own slots, gathered (this layout gathers the layer's cache anyway)
        kv = tuple(jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False) for x in kv)
    kv = tuple(jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in kv)
    kv_valid = jax.lax.all_gather(kv_valid, axes, axis=1, tiled=True)
    b, s = kv_valid.shape
    kv_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return chunked_attention(q, kv, kv[0], q_index, kv_index, kv_valid=kv_valid, scale=scale, q_chunk=q_chunk,
                             kv_chunk=kv_chunk)


# ------------------------------------------------------------------------------------------ writing


def write_slots(cache: jax.Array, new: jax.Array, start, layer=None) -> jax.Array:
    """:func:`k3jax.cache.update_slots` for a slot-split cache: each device writes the new entries that land
    in its own slots, in place. GSPMD writes a chunk of several slots into a split axis by all-gathering
    the whole cache.

    cache ``[B, S, W]`` (or ``[L, B, S, W]``, written at layer ``layer``), new ``[B, T, W]``, start ``[]``
    int (slots ``[start, start + T)``, within the cache) -> the cache's shape.
    """
    mesh = current_mesh()
    b, s = cache.shape[-3:-1]
    b_entry, axes, _ = _specs(mesh, b, s, 1)
    layers = () if layer is None else (None,)
    spec = P(*layers, b_entry, axes, None)
    args, specs = (cache, new.astype(cache.dtype), jnp.asarray(start, jnp.int32)), (spec, P(b_entry), P())
    if layer is not None:
        args, specs = args + (jnp.asarray(layer, jnp.int32),), specs + (P(),)
    return jax.shard_map(functools.partial(_write_local, axes=axes), mesh=mesh, in_specs=specs,
                         out_specs=spec)(*args)


def _write_local(cache, new, start, layer=None, *, axes):
    """One slot shard (``[B, s, W]``, or layer ``layer`` of ``[L, B, s, W]``): a window of ``min(T, s)`` slots
    holds every new entry that lands here."""
    s, t = cache.shape[-2], new.shape[1]
    n = min(t, s)
    offset = jax.lax.axis_index(axes) * s
    at = jnp.clip(start - offset, 0, s - n)  # the window's first local slot
    rel = at + offset - start + jnp.arange(n)  # the new entry each window slot receives, if in [0, T)
    window = read_slots(cache, at, n, layer)
    rows = jnp.take(new, jnp.clip(rel, 0, t - 1), axis=1)
    written = jnp.where(((rel >= 0) & (rel < t))[None, :, None], rows, window)
    return update_slots(cache, written, at, layer)

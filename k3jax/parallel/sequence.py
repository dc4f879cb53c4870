"""Sequence (context) parallelism: the time axis split over the ``sequence`` mesh axis, for the three
ops that mix tokens (everything else in the model is per token and stays plain GSPMD).

- **Short conv** (:func:`causal_conv1d`): each shard receives the last ``W - 1`` inputs (and their
  segment ids) of the previous shard with one ``ppermute`` and convolves its extended window, so
  the window and its document resets cross shard boundaries exactly. Continuing a cache (a prefill
  chunk), shard 0's halo is the cached window, and the last shard's last ``W - 1`` inputs are the new one.
- **KDA** (:func:`chunk_kda`): the recurrence ``S <- A_t S + b_t`` is affine in the state, so a shard
  summarises its whole slice as ``S_out = M S_in + S_loc`` (``M [K, K]`` per head) and its outputs as
  ``o = o_loc + P S_in`` (``P [T, K]`` per head). Both come from one ``chunk_kda`` pass whose value
  width is augmented with an identity block: values ``[0 | v]`` from the state ``[I | 0]`` give
  ``o = [P | o_loc]`` and the final state ``[M | S_loc]`` (about twice the state work of a plain
  pass). The affine maps are composed across the shards by an inclusive scan in ``log2(sp)`` rounds of
  ``ppermute`` (each shard holds two summaries at a time, not all ``sp``: 12.6 MB each for K3, 6.4 GB
  gathered at 512 shards), a shard that starts a document exactly at its boundary dropping what came
  before; each shard's incoming state is the previous shard's composed output, and it finishes
  ``o = o_loc + P S_in`` locally. Continuing a cache (a prefill chunk), shard 0 applies its map to the
  cached state before the scan (its map becomes the constant ``M S_0 + S_loc``), so every composed
  state is absolute, shard 0's incoming state is the cached one, and the last shard's composed state is
  the new one (sent to every shard with one all-reduce of the state's size).
- **MLA** (:func:`mla_attention`): each shard all-gathers the compressed KV (``c_kv | k_rope``,
  576 values per token for K3) and the segment ids, and attends with its local queries under the
  causal mask of global positions, expanding keys and values from the latent one key block at a time
  (``k3jax.ops.attention.latent_attention``, forward and backward): no shard holds the sequence's
  keys and values (30720 values per token for K3, 53x the latent; 64 GB per layer for a 1M-token
  row in bf16, against 1.2 GB of gathered latent), and the key blocks after a shard's last query are
  neither expanded nor attended. The latent's gradient goes back with the gather's transpose (a
  reduce-scatter); ``kv_b``'s is summed over the shards. docs/scale.md ("Long context") compares this
  with attention in the latent space (the absorbed form) and with a ring over KV shards.

Inside the ``shard_map`` the batch and the time axis split as the residual stream does (the ``batch``
and ``length`` rules of the active table of ``k3jax.sharding``): the batch over the data-like axes that
divide it, the time axis over ``sequence`` and the data-like axes the batch leaves free (one 1M-token
row on ``expert=64, sequence=8`` runs on 512 time shards, not 8 shards each repeated on 64 devices),
the heads as the ``heads`` rule says (over ``tensor``) when they divide; the other axes hold replicas.
"Sequence shards" below are these time shards.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.ops import conv as conv_ops
from k3jax.ops import kda as kda_ops
from k3jax.sharding import axis_size, current_mesh, logical_to_spec, spec_axes

# The KDA state fold runs in full float32 precision, like chunk_kda's own matmuls.
_PRECISION = jax.lax.Precision.HIGHEST


def time_axes(batch: int, seq_len: int, mesh=None) -> tuple[str, ...]:
    """The mesh axes the time axis of a ``[batch, seq_len, ...]`` activation splits over: the ``length``
    rule of the active table (``k3jax.sharding``) after the ``batch`` rule took its axes (() without a mesh)."""
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None:
        return ()
    return spec_axes(logical_to_spec(("batch", "length"), None, mesh, (batch, seq_len))[1])


def sequence_shards(seq_len: int, min_shard_len: int = 1, mesh=None, *, batch: int) -> int:
    """Number of sequence shards a ``[batch, seq_len, ...]`` activation runs on under the current mesh:
    the product of its :func:`time_axes` when that splits ``seq_len`` into shards of at least
    ``min_shard_len`` tokens, else 1 (the single-device path, partitioned by GSPMD)."""
    mesh = current_mesh() if mesh is None else mesh
    sp = 1
    for a in time_axes(batch, seq_len, mesh):
        sp *= axis_size(mesh, a)
    if sp > 1 and seq_len % sp == 0 and seq_len // sp >= min_shard_len:
        return sp
    return 1


def _specs(mesh, batch: int, seq_len: int, heads: int):
    """(batch entry, time axes, heads entry) of the PartitionSpecs inside the shard_map: batch, time and
    heads as the active rule table (``k3jax.sharding``) lays out a ``[B, T, H, ...]`` activation."""
    b_entry, t_entry, h_entry = logical_to_spec(("batch", "length", "heads"), None, mesh, (batch, seq_len, heads))
    return b_entry, spec_axes(t_entry), h_entry


# --------------------------------------------------------------------------------------- short conv


def causal_conv1d(x: jax.Array, weight: jax.Array, *, segment_ids: jax.Array | None = None,
                  initial_state: jax.Array | None = None, output_final_state: bool = False):
    """``k3jax.ops.conv.causal_conv1d`` with the time axis over the sequence shards.

    x ``[B, T, C]``, weight ``[W, C]``, segment_ids ``[B, T]`` or None, initial_state ``[B, W-1, C]`` or
    None (the inputs before token 0, a cache's conv window: shard 0's halo) -> ``(y [B, T, C], final_state
    [B, W-1, C] or None)``, the final state (the last shard's last ``W - 1`` inputs) replicated over the
    time shards.
    """
    mesh = current_mesh()
    halo = weight.shape[0] - 1
    if initial_state is not None and (initial_state.shape != (x.shape[0], halo, x.shape[2])
                                      or initial_state.dtype != x.dtype):
        raise ValueError(f"initial_state must be {x.dtype} [B, W-1, C]={(x.shape[0], halo, x.shape[2])}, "
                         f"got {initial_state.dtype} {initial_state.shape}")
    sp = sequence_shards(x.shape[1], halo, mesh, batch=x.shape[0])
    b_entry, axes, c_entry = _specs(mesh, *x.shape)
    act, w_spec, seg_spec = P(b_entry, axes, c_entry), P(None, c_entry), P(b_entry, axes)
    state_spec = P(b_entry, None, c_entry)  # [B, W-1, C]: whole on every time shard
    body = functools.partial(_conv_body, halo=halo, sp=sp, axes=axes, output_final_state=output_final_state)
    return jax.shard_map(body, mesh=mesh, in_specs=(act, w_spec, seg_spec, state_spec),
                         out_specs=(act, state_spec))(x, weight, segment_ids, initial_state)


def _conv_body(x, weight, segment_ids, initial_state, *, halo, sp, axes, output_final_state):
    """One shard: x ``[B, t, C]`` -> (``[B, t, C]``, final state or None), with the previous shard's last
    ``halo`` inputs (shard 0: ``initial_state``, or zeros)."""
    if halo == 0:
        return conv_ops.causal_conv1d(x, weight, segment_ids=segment_ids, output_final_state=output_final_state)
    me = jax.lax.axis_index(axes)
    to_next = [(i, i + 1) for i in range(sp - 1)]  # shard 0 receives zeros: the sequence start
    x_halo = jax.lax.ppermute(x[:, -halo:], axes, to_next)
    if initial_state is not None:  # ... or the inputs before it
        x_halo = jnp.where(me == 0, initial_state, x_halo)
    x_ext = jnp.concatenate([x_halo, x], axis=1)
    seg_ext = None
    if segment_ids is not None:  # the halo keeps its own ids, so a document start resets the window
        seg_halo = jax.lax.ppermute(segment_ids[:, -halo:], axes, to_next)
        # shard 0's halo belongs to token 0's document (as an initial state does in k3jax.ops.conv)
        seg_halo = jnp.where(me == 0, segment_ids[:, :1], seg_halo)
        seg_ext = jnp.concatenate([seg_halo, segment_ids], axis=1)
    y, final = conv_ops.causal_conv1d(x_ext, weight, segment_ids=seg_ext, output_final_state=output_final_state)
    return y[:, halo:], (None if final is None else _from_last_shard(final, me, sp, axes))


def _from_last_shard(x: jax.Array, me: jax.Array, sp: int, axes) -> jax.Array:
    """The last shard's ``x`` on every shard (a final state): one all-reduce of ``x``'s size, exact (the other
    shards add zeros)."""
    return jax.lax.psum(jnp.where(me == sp - 1, x, jnp.zeros((), x.dtype)), axes)


# ---------------------------------------------------------------------------------------------- KDA


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, chunk_size=64,
              segment_ids=None, chunk_fn=None):
    """``k3jax.ops.kda.chunk_kda`` with the time axis over the sequence shards.

    q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``, segment_ids ``[B, T]`` or None,
    initial_state ``[B, H, K, V]`` (float32) or None: the state before token 0 (a cache's), which shard 0
    starts from -> ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] or None)``, the final state (the
    last shard's outgoing one) replicated over the time shards. ``chunk_fn``: the per-shard chunkwise KDA
    (same signature as ``k3jax.ops.kda.chunk_kda``, e.g. a Pallas kernel); default the pure-JAX op.
    """
    kda_ops.check_inputs(q, k, v, g, beta, initial_state, segment_ids)
    mesh = current_mesh()
    sp = sequence_shards(q.shape[1], 1, mesh, batch=q.shape[0])
    b_entry, axes, h_entry = _specs(mesh, *q.shape[:3])
    act, gate = P(b_entry, axes, h_entry, None), P(b_entry, axes, h_entry)
    seg_spec, state_spec = P(b_entry, axes), P(b_entry, h_entry, None, None)
    body = functools.partial(_kda_body, scale=scale, chunk_size=chunk_size, sp=sp, axes=axes,
                             output_final_state=output_final_state,
                             chunk_fn=kda_ops.chunk_kda if chunk_fn is None else chunk_fn)
    return jax.shard_map(body, mesh=mesh, in_specs=(act, act, act, act, gate, seg_spec, state_spec),
                         out_specs=(act, state_spec))(q, k, v, g, beta, segment_ids, initial_state)


def _kda_body(q, k, v, g, beta, segment_ids, initial_state, *, scale, chunk_size, sp, axes, output_final_state,
              chunk_fn):
    """One shard: q, k, g ``[B, t, H, K]``, v ``[B, t, H, V]``, beta ``[B, t, H]``, initial_state ``[B, H, K, V]``
    or None -> (o ``[B, t, H, V]``, final state ``[B, H, K, V]`` or None)."""
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    dtype = jnp.result_type(jnp.float32, q, k, v, g, beta)
    # values [0 | v] from the state [I | 0]: o = [P | o_loc], final state = [M | S_loc]
    v_aug = jnp.concatenate([jnp.zeros_like(v, dtype, shape=v.shape[:3] + (dk,)), v.astype(dtype)], axis=-1)
    identity = jnp.concatenate([jnp.eye(dk, dtype=dtype), jnp.zeros((dk, dv), dtype)], axis=-1)
    # zeros_like gives the state the inputs' device-varying type (chunk_kda's scan carry needs it)
    initial = jnp.zeros_like(v_aug, shape=(b, h, dk, dk + dv)) + identity
    o_aug, final = chunk_fn(q, k, v_aug, g, beta, scale=scale, chunk_size=chunk_size, segment_ids=segment_ids,
                            output_final_state=True, initial_state=initial)
    read, o_local = o_aug[..., :dk], o_aug[..., dk:]  # [B, t, H, K], [B, t, H, V]
    m, state = final[..., :dk], final[..., dk:]  # S_out = m S_in + state: [B, H, K, K], [B, H, K, V]
    me = jax.lax.axis_index(axes)
    first = me == 0
    if initial_state is not None:  # shard 0's map applied to the initial state: a constant, m = 0
        state = jnp.where(first, jnp.einsum("bhkj,bhjv->bhkv", m, initial_state, precision=_PRECISION) + state, state)
        m = jnp.where(first, jnp.zeros((), dtype), m)
    to_next = [(i, i + 1) for i in range(sp - 1)]  # shard 0 receives zeros: the sequence start
    starts_doc = jnp.zeros_like(me, bool, shape=(b,))
    if segment_ids is not None:  # a shard whose first id differs from the previous shard's last id
        starts_doc = (segment_ids[:, 0] != jax.lax.ppermute(segment_ids[:, -1], axes, to_next)) & (me > 0)
    reset = starts_doc[:, None, None, None]
    m = jnp.where(reset, jnp.zeros((), dtype), m)  # it forgets what came before it
    # inclusive scan of the affine maps over the shards in log2(sp) rounds (Hillis-Steele): after round r a
    # shard holds the composition of itself and the 2^r - 1 shards before it; two summaries per shard at a time
    step = 1
    while step < sp:
        shift = [(i, i + step) for i in range(sp - step)]
        m_prev, state_prev = jax.lax.ppermute(m, axes, shift), jax.lax.ppermute(state, axes, shift)
        has_prev = me >= step  # shards before `step` receive zeros: nothing to compose
        m, state = (jnp.where(has_prev, jnp.einsum("bhkj,bhjl->bhkl", m, m_prev, precision=_PRECISION), m),
                    jnp.where(has_prev, jnp.einsum("bhkj,bhjv->bhkv", m, state_prev, precision=_PRECISION) + state,
                              state))
        step *= 2
    # the state entering this shard is the one leaving the previous shard (zero at a document start; shard 0's
    # is the initial state, or zero), and the last shard's composed state is the final one
    incoming = jax.lax.ppermute(state, axes, to_next)
    if initial_state is not None:
        incoming = jnp.where(first, initial_state, incoming)
    incoming = jnp.where(reset, jnp.zeros((), dtype), incoming)
    o = o_local + jnp.einsum("bthk,bhkv->bthv", read, incoming, precision=_PRECISION)
    return o.astype(v.dtype), (_from_last_shard(state, me, sp, axes) if output_final_state else None)


# ---------------------------------------------------------------------------------------------- MLA

# attend(q, kv_latent, q_index, kv_index, q_segment_ids, kv_segment_ids, kv_b) -> o
Attend = Callable[..., jax.Array]


def mla_attention(attend: Attend, q: jax.Array, kv_latent: jax.Array, segment_ids: jax.Array | None,
                  kv_b: jax.Array) -> jax.Array:
    """MLA's training attention with the time axis over ``sequence``: the compressed KV is gathered.

    q ``[B, T, H, P]``, kv_latent ``[B, T, r + R]`` (normalised ``c_kv`` | ``k_rope``), segment_ids
    ``[B, T]`` or None, kv_b ``[r, H, nope + v]``. ``attend`` is the layer's latent attention
    (``[B, t, H, P]`` queries over ``[B, S, r + R]`` latents with ``[B, t]`` / ``[B, S]`` positions and
    segment ids, keys and values expanded block by block); returns ``[B, T, H, v]``.
    """
    mesh = current_mesh()
    sp = sequence_shards(q.shape[1], 1, mesh, batch=q.shape[0])
    b_entry, axes, h_entry = _specs(mesh, *q.shape[:3])
    q_spec, lat_spec = P(b_entry, axes, h_entry, None), P(b_entry, axes, None)
    seg_spec, kv_b_spec = P(b_entry, axes), P(None, h_entry, None)
    body = functools.partial(_mla_body, attend=attend, sp=sp, axes=axes)
    if segment_ids is None:
        return jax.shard_map(lambda q, lat, w: body(q, lat, None, w), mesh=mesh,
                             in_specs=(q_spec, lat_spec, kv_b_spec), out_specs=q_spec)(q, kv_latent, kv_b)
    return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, lat_spec, seg_spec, kv_b_spec),
                         out_specs=q_spec)(q, kv_latent, segment_ids, kv_b)


def _mla_body(q, kv_latent, segment_ids, kv_b, *, attend, sp, axes):
    """One shard: local queries ``[B, t, H, P]`` over the whole sequence's gathered latents."""
    b, t = q.shape[:2]
    latent_all = jax.lax.all_gather(kv_latent, axes, axis=1, tiled=True)  # [B, sp*t, r+R]
    q_index = jax.lax.axis_index(axes) * t + jnp.arange(t, dtype=jnp.int32)
    q_index = jnp.broadcast_to(q_index, (b, t))
    kv_index = jnp.broadcast_to(jnp.arange(sp * t, dtype=jnp.int32), (b, sp * t))
    kv_segment_ids = None if segment_ids is None else jax.lax.all_gather(segment_ids, axes, axis=1, tiled=True)
    return attend(q, latent_all, q_index, kv_index, segment_ids, kv_segment_ids, kv_b)


# ------------------------------------------------------------------------------------ per-token ops


def on_own_tokens(fn: Callable[..., object], tokens, *shared: jax.Array, batch: int, seq_len: int):
    """``fn(tokens, *shared)`` run on each device's own tokens, for a per-token op that GSPMD would
    otherwise gather along the tokens (XLA:CPU replicates ``lax.top_k``'s sort: the router's ``[N, E]``
    scores of a whole 1M-token row on every device).

    tokens ``[N, ...]`` (or a pytree of such arrays): the flattened ``[batch, seq_len]`` tokens (split as the
    residual stream is: batch axes, then time axes); ``shared``: arrays every token uses whole (replicated); ``fn``'s
    outputs: a pytree of ``[N, ...]`` arrays. Without a mesh (or with unsplit tokens) ``fn`` runs as is.
    """
    mesh = current_mesh()
    if mesh is None:
        return fn(tokens, *shared)
    b_entry, t_entry = logical_to_spec(("batch", "length"), None, mesh, (batch, seq_len))
    axes = spec_axes(b_entry) + spec_axes(t_entry)
    if not axes:
        return fn(tokens, *shared)
    spec = P(axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) + (P(),) * len(shared), out_specs=spec)(tokens, *shared)

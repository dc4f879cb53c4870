"""Grouped matmul over expert-sorted rows as Pallas **Triton** (GPU) kernels: the ``backend="gpu"`` path of
``pallas_kernels.moe.gmm`` / ``tgmm`` / ``grouped_matmul`` (same arguments and results; see ``gmm.py``).

Triton has no scalar prefetch, so the run-time group layout cannot steer BlockSpec index maps as on TPU.
Instead every operand is passed whole and each program reads its work item from small int32 metadata
arrays (scalar loads) and forms its own dynamic ``pl.ds`` windows:

- ``gmm`` (``out[r] = lhs[r] @ rhs[e(r)]``): grid ``(row tiles, F / tn)``. Row tiles start at each
  group's first row (``tile_metadata``), so a tile never spans two groups and no row is computed twice:
  ``sum_e ceil(size_e / tm) <= M / tm + E`` tiles, a static bound; programs past the real count exit at
  once. The contraction runs in an in-kernel ``fori_loop`` over ``tk``-wide blocks (Triton pipelines its
  loads, ``num_stages``); the store is masked to the group's rows. Rows past ``sum(group_sizes)`` are never
  written and are zeroed afterwards by XLA. ``transpose_rhs`` reads ``rhs[e]`` as ``[F, D]`` blocks.
- ``tgmm`` (``out[e] = lhs_e^T dy_e``): grid ``(D / tk, F / tn, E)``; each program loops over its group's
  rows in ``tm`` steps (a run-time trip count; zero for an empty group, which therefore gets zeros),
  with masked loads at the group's edges.

Blocks must be powers of two: D and F are zero-padded to multiples of the tile (nothing to pad at the
K3 sizes 3584 / 3072 with the default tiles) and M by one row tile, so every window is in bounds.
Operands reach the tensor cores in their own dtype (bf16 stays bf16; fp32 at HIGHEST precision) with
fp32 accumulation in registers.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import HIGHEST, next_pow2, triton_params

F32 = jnp.float32
MIN_DOT = 16  # tl.dot needs every block dim >= 16
DEFAULT_TILING = (64, 64, 128)  # (tm rows, tk contraction, tn output columns): untuned, no GPU measurement yet
NUM_WARPS = 4
NUM_STAGES = 3  # software pipelining of the contraction loop's loads


def _round_up(x, m):
    return -(-x // m) * m


def _tiles(tiling, M, D, F):
    """Power-of-two tiles no larger than the (padded) problem: (tm, tk, tn)."""
    tm, tk, tn = tiling
    for t in tiling:
        if t < MIN_DOT or t & (t - 1):
            raise ValueError(f"GPU tiles must be powers of two >= {MIN_DOT}, got {tiling}")
    return min(tm, next_pow2(M, MIN_DOT)), min(tk, next_pow2(D, MIN_DOT)), min(tn, next_pow2(F, MIN_DOT))


def tile_metadata(group_sizes, m, tm):
    """Row tiles that start at each group's first row.

    group_sizes [E] int, m rows in all (static). Returns ``(group_ids [S], starts [S], offsets [E+1],
    num_tiles [1])`` int32 with the static bound ``S = ceil(m / tm) + E`` (each group adds at most one
    partial tile); entries ``>= num_tiles`` are padding (group 0, start 0) that the kernel skips.
    """
    E = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    n_tiles = (gs + tm - 1) // tm
    first = jnp.cumsum(n_tiles) - n_tiles
    bound = -(-m // tm) + E
    steps = jnp.arange(bound, dtype=jnp.int32)
    gid = jnp.clip(jnp.searchsorted(first + n_tiles, steps, side="right"), 0, E - 1).astype(jnp.int32)
    total = jnp.sum(n_tiles).astype(jnp.int32)
    valid = steps < total
    starts = jnp.where(valid, offsets[gid] + (steps - first[gid]) * tm, 0).astype(jnp.int32)
    return jnp.where(valid, gid, 0), starts, offsets, total.reshape(1)


def _dot(a, b, trans_a=False, trans_b=False):
    prec = HIGHEST if a.dtype == F32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=prec, preferred_element_type=F32)


def gmm(lhs, rhs, group_sizes, *, transpose_rhs, tiling, out_dtype, interpret, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES):
    """See ``gmm.gmm``: lhs [M, D], rhs [E, D, F] (``[E, F, D]`` with transpose_rhs) -> [M, F]."""
    M, D = lhs.shape
    F = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cdt = jnp.promote_types(lhs.dtype, rhs.dtype)
    tm, tk, tn = _tiles(tiling, M, D, F)
    Dp, Fp, Mp = _round_up(D, tk), _round_up(F, tn), _round_up(M, tm) + tm
    x = jnp.pad(lhs, ((0, Mp - M), (0, Dp - D)))
    w_pad = ((0, 0), (0, Fp - F), (0, Dp - D)) if transpose_rhs else ((0, 0), (0, Dp - D), (0, Fp - F))
    w = jnp.pad(rhs, w_pad) if (Dp, Fp) != (D, F) else rhs  # a full weight copy: only when not tile-aligned
    gids, starts, offsets, total = tile_metadata(group_sizes, M, tm)

    def kernel(gid_ref, start_ref, off_ref, total_ref, x_ref, w_ref, o_ref):
        t, j = pl.program_id(0), pl.program_id(1)

        @pl.when(t < total_ref[0])
        def _():
            g, start = gid_ref[t], start_ref[t]
            cols = pl.ds(pl.multiple_of(j * tn, tn), tn)

            def body(kk, acc):
                ks = pl.ds(pl.multiple_of(kk * tk, tk), tk)
                xb = x_ref[pl.ds(start, tm), ks].astype(cdt)  # rows of other groups: computed, never stored
                if transpose_rhs:
                    return acc + _dot(xb, w_ref[g, cols, ks].astype(cdt), trans_b=True)
                return acc + _dot(xb, w_ref[g, ks, cols].astype(cdt))

            acc = jax.lax.fori_loop(0, Dp // tk, body, jnp.zeros((tm, tn), F32))
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
            plgpu.store(o_ref.at[pl.ds(start, tm), cols], acc.astype(o_ref.dtype), mask=rows < off_ref[g + 1])

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, Fp), out_dtype),
        grid=(gids.shape[0], Fp // tn),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="gmm_gpu",
    )(gids, starts, offsets, total, x, w)
    valid = jnp.arange(M) < offsets[-1]  # rows past the last group were never written
    return jnp.where(valid[:, None], out[:M, :F], jnp.zeros((), out_dtype))


def tgmm(lhs, dy, group_sizes, *, tiling, out_dtype, interpret, num_warps=NUM_WARPS, num_stages=NUM_STAGES):
    """See ``gmm.tgmm``: lhs [M, D], dy [M, F] -> [E, D, F] (``lhs_e^T dy_e``; zeros for empty groups)."""
    M, D = lhs.shape
    F = dy.shape[1]
    E = group_sizes.shape[0]
    cdt = jnp.promote_types(lhs.dtype, dy.dtype)
    tm, tk, tn = _tiles(tiling, M, D, F)
    Dp, Fp, Mp = _round_up(D, tk), _round_up(F, tn), _round_up(M, tm) + tm
    x = jnp.pad(lhs, ((0, Mp - M), (0, Dp - D)))
    g_ = jnp.pad(dy, ((0, Mp - M), (0, Fp - F)))
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])

    def kernel(off_ref, x_ref, dy_ref, o_ref):
        i, j, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        start, end = off_ref[g], off_ref[g + 1]
        ks = pl.ds(pl.multiple_of(i * tk, tk), tk)
        cols = pl.ds(pl.multiple_of(j * tn, tn), tn)

        def body(r, acc):
            r0 = start + r * tm
            row = r0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
            inside = row < end  # the group's last tile: rows of the next group count as zeros
            xb = plgpu.load(x_ref.at[pl.ds(r0, tm), ks], mask=jnp.broadcast_to(inside, (tm, tk)), other=0)
            gb = plgpu.load(dy_ref.at[pl.ds(r0, tm), cols], mask=jnp.broadcast_to(inside, (tm, tn)), other=0)
            return acc + _dot(xb.astype(cdt), gb.astype(cdt), trans_a=True)

        acc = jax.lax.fori_loop(0, (end - start + tm - 1) // tm, body, jnp.zeros((tk, tn), F32))
        o_ref[g, ks, cols] = acc.astype(o_ref.dtype)

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((E, Dp, Fp), out_dtype),
        grid=(Dp // tk, Fp // tn, E),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="tgmm_gpu",
    )(offsets, x, g_)
    return out[:, :D, :F] if (Dp, Fp) != (D, F) else out


__all__ = ["DEFAULT_TILING", "gmm", "tgmm", "tile_metadata"]

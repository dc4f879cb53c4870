"""Grouped matmul over expert-sorted rows (Pallas: TPU Mosaic here, GPU Triton in ``gmm_gpu.py``; interpret
mode on CPU), with its two backward products. The public functions dispatch on ``backend``.

- ``gmm(x [M, D], w [E, D, F], group_sizes [E]) -> [M, F]``: rows ``[off_e, off_e + size_e)`` of x
  (rows sorted by expert) times ``w[e]``; ``transpose_rhs=True`` multiplies by ``w[e]^T`` (w [E, F, D]),
  which is the input gradient ``dx = dy @ w[e]^T``.
- ``tgmm(x [M, D], dy [M, F], group_sizes) -> [E, D, F]``: ``x_e^T dy_e`` per group (the weight gradient);
  empty groups get zeros.
- ``grouped_matmul`` = ``gmm`` with a ``jax.custom_vjp`` (dx by ``gmm(transpose_rhs)``, dW by ``tgmm``).
- ``grouped_rows_call``: ``gmm``'s TPU grid for any weight operand, given a step's partial product;
  ``gmm_mxfp4.py`` runs it over MXFP4 weights decoded tile by tile.

TPU kernels: group sizes are run-time values: they are turned into per-grid-step tile metadata (which row tile and
which group each step works on, as in megablox) and handed to the kernel by scalar prefetch
(``pltpu.PrefetchScalarGridSpec``), so the index maps pick the weight block of the step's group and
the grid only visits tiles that hold rows (plus one step per empty group in ``tgmm``). A row tile that
straddles a group boundary is visited once per group, with a row mask on the store (gmm) or on the
operands (tgmm). Operands go to the MXU in their own dtype (bf16 stays bf16) with fp32 accumulation
in a VMEM scratch; rows beyond ``sum(group_sizes)`` come back as zeros.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import HIGHEST
from pallas_kernels.platform import resolve_backend
from pallas_kernels.moe import gmm_gpu
from pallas_kernels.varying import match_varying, out_struct

F32 = jnp.float32
DEFAULT_TILING = (128, 512, 512)  # (tm rows, tk contraction, tn output columns)


def _tile(dim, pref):
    """Largest tile <= pref that divides dim, lane aligned (multiple of 128), else the whole dim."""
    if dim <= pref:
        return dim
    t = pref - pref % 128
    while t >= 128:
        if dim % t == 0:
            return t
        t -= 128
    return dim


def _round_up(x, m):
    return -(-x // m) * m


def group_metadata(group_sizes, m, tm, *, visit_empty):
    """Per-grid-step metadata for row tiles of size tm over m (a multiple of tm) rows.

    Returns ``(offsets [E+1], group_ids [T], tile_ids [T], num_steps)`` with the static bound
    ``T = m // tm + E - 1`` (``+ 1`` when visit_empty); steps ``>= num_steps`` are never run. Steps are
    ordered by group, then row tile, so a row tile's visits are consecutive (one per group in it).
    """
    E = group_sizes.shape[0]
    tiles_m = m // tm
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    first_tile = starts // tm
    last_tile = (ends + tm - 1) // tm  # exclusive
    n_tiles = jnp.where(gs > 0, last_tile - first_tile, 1 if visit_empty else 0)
    bound = tiles_m + E - 1 + (1 if visit_empty else 0)
    step_starts = jnp.cumsum(n_tiles) - n_tiles
    steps = jnp.arange(bound, dtype=jnp.int32)
    group_ids = jnp.clip(jnp.searchsorted(step_starts + n_tiles, steps, side="right"), 0, E - 1).astype(jnp.int32)
    tile_ids = first_tile[group_ids] + (steps - step_starts[group_ids])
    tile_ids = jnp.clip(tile_ids, 0, tiles_m - 1).astype(jnp.int32)
    return offsets, group_ids, tile_ids, jnp.sum(n_tiles).astype(jnp.int32)


def _row_mask(offsets_ref, group_ids_ref, tile_ids_ref, t, tm):
    g = group_ids_ref[t]
    rows = tile_ids_ref[t] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return (rows >= offsets_ref[g]) & (rows < offsets_ref[g + 1])


def _dot(a, b, dims):
    prec = HIGHEST if a.dtype == F32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=F32)


def _resolve(interpret, backend):
    return resolve_backend(interpret, backend)


def _tiling(tiling, backend):
    """The backend's default tiling when None (TPU: DEFAULT_TILING; GPU: gmm_gpu.DEFAULT_TILING)."""
    if tiling is None:
        return gmm_gpu.DEFAULT_TILING if backend == "gpu" else DEFAULT_TILING
    return tuple(tiling)


def _check(lhs, group_sizes):
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be 2-D, got shape {lhs.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be a 1-D integer array, got {group_sizes.dtype} {group_sizes.shape}")


def _cost_rows(M: int, expected_rows: int | None, E: int, tm: int) -> int:
    """Rows the ``pl.CostEstimate`` counts. The grid visits only the tiles of real rows (``num_steps``
    is dynamic), so the work is data-dependent: a caller whose buffer has head-room (an expert-parallel
    capacity factor) passes the rows it expects; a tile per group of rounding is added, at most M."""
    return M if expected_rows is None else min(M, expected_rows + E * tm)


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiling", "out_dtype", "interpret", "backend",
                                             "expected_rows"))
def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, out_dtype=None, interpret=None, backend=None,
        expected_rows=None):
    """``out[r] = lhs[r] @ rhs[e(r)]`` (``rhs[e(r)]^T`` with transpose_rhs) for expert-sorted rows r.

    lhs [M, D]; rhs [E, D, F] (or [E, F, D] transposed); group_sizes [E] int with sum <= M. Returns
    [M, F] in ``out_dtype`` (default lhs.dtype); rows past ``sum(group_sizes)`` are zero. tiling:
    ``(tm, tk, tn)`` or None (the backend's default); ``backend="gpu"`` runs ``gmm_gpu.gmm`` (Triton).
    ``expected_rows``: the real rows expected, for the cost estimate only (``_cost_rows``).
    """
    _check(lhs, group_sizes)
    interpret, backend = _resolve(interpret, backend)
    tiling = _tiling(tiling, backend)
    M, D = lhs.shape
    E = rhs.shape[0]
    F = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if (rhs.shape[2] if transpose_rhs else rhs.shape[1]) != D or group_sizes.shape != (E,):
        raise ValueError(f"shape mismatch: lhs {lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    if backend == "gpu":
        return gmm_gpu.gmm(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, tiling=tiling, out_dtype=out_dtype,
                           interpret=interpret)
    cdt = jnp.promote_types(lhs.dtype, rhs.dtype)
    tm, tk, tn = tiling
    tm = min(tm, _round_up(M, 8))
    tk, tn = _tile(D, tk), _tile(F, tn)
    dims = ((1,), (1,)) if transpose_rhs else ((1,), (0,))

    def product(x_refs, w_refs, kk):
        return _dot(x_refs[0][...].astype(cdt), w_refs[0][...].astype(cdt), dims)

    w_block = (tn, tk) if transpose_rhs else (tk, tn)
    w_index = (lambda g, n, kk: (g, n, kk)) if transpose_rhs else (lambda g, n, kk: (g, kk, n))
    isz = lambda d: jnp.dtype(d).itemsize
    rows = _cost_rows(M, expected_rows, E, tm)
    cost = pl.CostEstimate(
        flops=2 * rows * D * F, transcendentals=0,
        bytes_accessed=rows * D * isz(lhs.dtype) * (F // tn) + E * D * F * isz(rhs.dtype) + rows * F * isz(out_dtype))
    return grouped_rows_call(product, (lhs,), tk, ((rhs, w_block, w_index),), group_sizes, out_cols=F, tm=tm,
                             tn=tn, out_dtype=out_dtype, interpret=interpret, cost=cost, name="gmm")


def grouped_rows_call(product, lhs_parts, tk, rhs_parts, group_sizes, *, out_cols, tm, tn, out_dtype, interpret,
                      cost, name):
    """The TPU grid of ``gmm``, for any weight operand: ``out[r] = sum_kk product(...)`` over the row tiles
    of each group (``group_metadata``), with the store's row mask and zeros past ``sum(group_sizes)``.

    lhs_parts: arrays ``[M, K]`` (one, or the column planes a weight format pairs with), read in
    ``(tm, tk)`` blocks of the step's row tile; ``K // tk`` contraction steps. rhs_parts: ``(array,
    block_shape, index(g, n, kk))`` per weight array, the block's leading expert dimension squeezed.
    ``product(x_refs, w_refs, kk) -> [tm, tn]`` float32: one step's partial product. Returns
    ``[M, out_cols]`` in ``out_dtype``; tm is capped at M rounded up to 8.
    """
    M, K = lhs_parts[0].shape
    tm = min(tm, _round_up(M, 8))
    Mp = _round_up(M, tm)
    xs = tuple(jnp.pad(x, ((0, Mp - M), (0, 0))) for x in lhs_parts)
    offsets, group_ids, tile_ids, num_steps = group_metadata(group_sizes, Mp, tm, visit_empty=False)
    tiles_k = K // tk
    n_x, n_w = len(xs), len(rhs_parts)

    def kernel(offsets_ref, group_ids_ref, tile_ids_ref, *refs):
        x_refs, w_refs, (o_ref, acc_ref) = refs[:n_x], refs[n_x:n_x + n_w], refs[n_x + n_w:]
        t, kk = pl.program_id(1), pl.program_id(2)

        @pl.when(kk == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

        acc_ref[...] += product(x_refs, w_refs, kk)

        @pl.when(kk == tiles_k - 1)
        def _():
            mask = _row_mask(offsets_ref, group_ids_ref, tile_ids_ref, t, tm)
            prev = jnp.where(t > 0, tile_ids_ref[jnp.maximum(t - 1, 0)], -1)
            first_visit = tile_ids_ref[t] != prev  # the first group in this row tile: rows of no group -> 0
            old = jnp.where(first_visit, 0.0, o_ref[...].astype(F32))
            o_ref[...] = jnp.where(mask, acc_ref[...], old).astype(o_ref.dtype)

    def w_spec(block, index):
        return pl.BlockSpec((pl.Squeezed(), *block), lambda n, t, kk, off, gid, tid: index(gid[t], n, kk))

    x_spec = pl.BlockSpec((tm, tk), lambda n, t, kk, off, gid, tid: (tid[t], kk))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(out_cols // tn, num_steps, tiles_k),
        in_specs=[x_spec] * n_x + [w_spec(block, index) for _, block, index in rhs_parts],
        out_specs=pl.BlockSpec((tm, tn), lambda n, t, kk, off, gid, tid: (tid[t], n)),
        scratch_shapes=[pltpu.VMEM((tm, tn), F32)],
    )
    out = pl.pallas_call(
        kernel,
        out_shape=out_struct((Mp, out_cols), out_dtype, xs[0]),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )(offsets, group_ids, tile_ids, *xs, *(w for w, _, _ in rhs_parts))
    out = out[:M]
    # rows past the last group are never stored: zero them (a tile may hold only such rows)
    valid = jnp.arange(M) < offsets[-1]
    return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret", "backend", "expected_rows"))
def tgmm(lhs, dy, group_sizes, *, tiling=None, out_dtype=None, interpret=None, backend=None, expected_rows=None):
    """``out[e] = lhs_e^T @ dy_e`` over the rows of group e: lhs [M, D], dy [M, F] -> [E, D, F].

    Empty groups give zeros. out_dtype defaults to lhs.dtype. tiling / backend / expected_rows as in
    ``gmm``.
    """
    _check(lhs, group_sizes)
    interpret, backend = _resolve(interpret, backend)
    tiling = _tiling(tiling, backend)
    M, D = lhs.shape
    F = dy.shape[1]
    E = group_sizes.shape[0]
    if dy.shape[0] != M:
        raise ValueError(f"lhs {lhs.shape} and dy {dy.shape} must have the same rows")
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    if backend == "gpu":
        return gmm_gpu.tgmm(lhs, dy, group_sizes, tiling=tiling, out_dtype=out_dtype, interpret=interpret)
    cdt = jnp.promote_types(lhs.dtype, dy.dtype)
    tm, tk, tn = tiling
    tm = min(tm, _round_up(M, 8))
    tk, tn = _tile(D, tk), _tile(F, tn)
    Mp = _round_up(M, tm)
    x = jnp.pad(lhs, ((0, Mp - M), (0, 0)))
    g = jnp.pad(dy, ((0, Mp - M), (0, 0)))
    offsets, group_ids, tile_ids, num_steps = group_metadata(group_sizes, Mp, tm, visit_empty=True)

    def kernel(offsets_ref, group_ids_ref, tile_ids_ref, x_ref, dy_ref, o_ref, acc_ref):
        t = pl.program_id(2)
        nt = pl.num_programs(2)
        gid = group_ids_ref[t]
        first = (t == 0) | (group_ids_ref[jnp.maximum(t - 1, 0)] != gid)
        last = (t == nt - 1) | (group_ids_ref[jnp.minimum(t + 1, nt - 1)] != gid)

        @pl.when(first)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

        mask = _row_mask(offsets_ref, group_ids_ref, tile_ids_ref, t, tm)
        xm = jnp.where(mask, x_ref[...], jnp.zeros((), x_ref.dtype)).astype(cdt)
        gm = jnp.where(mask, dy_ref[...], jnp.zeros((), dy_ref.dtype)).astype(cdt)
        acc_ref[...] += _dot(xm, gm, ((0,), (0,)))

        @pl.when(last)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(D // tk, F // tn, num_steps),
        in_specs=[pl.BlockSpec((tm, tk), lambda kk, n, t, off, gid, tid: (tid[t], kk)),
                  pl.BlockSpec((tm, tn), lambda kk, n, t, off, gid, tid: (tid[t], n))],
        out_specs=pl.BlockSpec((pl.Squeezed(), tk, tn), lambda kk, n, t, off, gid, tid: (gid[t], kk, n)),
        scratch_shapes=[pltpu.VMEM((tk, tn), F32)],
    )
    isz = lambda d: jnp.dtype(d).itemsize
    rows = _cost_rows(M, expected_rows, E, tm)
    cost = pl.CostEstimate(
        flops=2 * rows * D * F, transcendentals=0,
        bytes_accessed=rows * D * isz(lhs.dtype) * (F // tn) + rows * F * isz(dy.dtype) * (D // tk)
        + E * D * F * isz(out_dtype))
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((E, D, F), out_dtype, x),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="tgmm",
    )(offsets, group_ids, tile_ids, x, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _grouped_matmul(lhs, rhs, group_sizes, tiling, interpret, backend, expected_rows):
    return gmm(lhs, rhs, group_sizes, tiling=tiling, interpret=interpret, backend=backend,
               expected_rows=expected_rows)


def _gm_fwd(lhs, rhs, group_sizes, tiling, interpret, backend, expected_rows):
    out = gmm(lhs, rhs, group_sizes, tiling=tiling, interpret=interpret, backend=backend,
              expected_rows=expected_rows)
    return out, (lhs, rhs, group_sizes)


def _gm_bwd(tiling, interpret, backend, expected_rows, res, dy):
    lhs, rhs, group_sizes = res
    dx = gmm(dy, rhs, group_sizes, transpose_rhs=True, tiling=tiling, out_dtype=lhs.dtype, interpret=interpret,
             backend=backend, expected_rows=expected_rows)
    dw = tgmm(lhs, dy, group_sizes, tiling=tiling, out_dtype=rhs.dtype, interpret=interpret, backend=backend,
              expected_rows=expected_rows)
    # Nothing upstream needs dw, so XLA:TPU's scheduler deferred every layer's weight gradient to the
    # end of the backward, keeping each layer's [M, D] lhs alive until then (a dropless 5-layer K2
    # step: 8 receive buffers of 3.8 GB at the peak). Tying dw to dx computes it within its layer.
    dx, dw = jax.lax.optimization_barrier((dx, dw))
    return dx, dw, None


_grouped_matmul.defvjp(_gm_fwd, _gm_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, tiling=None, interpret=None, backend=None, expected_rows=None):
    """Differentiable ``gmm`` (a drop-in for ``jax.lax.ragged_dot(lhs, rhs, group_sizes)``).

    Gradients: ``dx = gmm(dy, rhs, transpose_rhs=True)``, ``drhs = tgmm(lhs, dy)``; none for group_sizes.
    ``expected_rows``: for the kernels' cost estimates (``gmm``).
    """
    interpret, backend = _resolve(interpret, backend)
    lhs, rhs = match_varying(lhs, rhs), match_varying(rhs, lhs)
    return _grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32), _tiling(tiling, backend), interpret, backend,
                           expected_rows)

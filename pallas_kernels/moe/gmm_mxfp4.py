"""Grouped matmul with MXFP4 weights, dequantized tile by tile in VMEM (TPU Mosaic; interpret mode on CPU).

``gmm_mxfp4(x [M, in], w, group_sizes) -> [M, out]``: ``gmm`` (``gmm.py``) with the weight of each expert
held as MXFP4 in the release's orientation (``pallas_kernels.mxfp4.MXFP4``: packed E2M1 codes ``[E, out,
in/2]`` and E8M0 block scales ``[E, out, in/32]``, both uint8, blocks of 32 along ``in``). Dequantized
before an XLA matmul, every expert's weight goes through HBM several times per step (XLA:TPU materialises
its int32 intermediates: ~32 bytes per parameter); here the kernel reads the 4.25 bits a parameter is
stored in, only for the experts that have rows (``gmm``'s grid), and decodes each tile next to the MXU.

The encoding and its plain decode: ``pallas_kernels.mxfp4``.

How a tile is decoded without moving lanes:

- Nibbles are not interleaved back into columns: the low nibbles of a ``[tn, tk/2]`` byte tile are the
  weight's even columns, the high nibbles its odd ones, so x enters as its even and odd columns (two
  ``[M, in/2]`` arrays, split once outside) and a step sums two matmuls, ``x_even w_lo^T + x_odd w_hi^T``.
- Every 16 lanes of a nibble plane share a scale. Repeating each scale over its 16 lanes is a one-hot
  matmul on the MXU (``scales [tn, in/32] @ onehot [in/32, tk/2]``, exact: the scale bytes are integers
  below 256, exact in bfloat16), where a lane shuffle would be a long VPU / XLU sequence.
- E2M1 codes become float32 bits with integer arithmetic (``decode_e2m1``), the scale by its exponent
  bits (``decode_e8m0``); their product, exact, goes to the MXU in the compute dtype with float32
  accumulation.

Gradients (``mxfp4_grouped_matmul``): the weights are frozen (no cotangent); the input gradient ``dy
W_e`` runs ``gmm`` on the dequantized weight (:func:`dequantize`), as the plain path does (LoRA over
frozen MXFP4 experts needs it; decoding does not).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.moe.gmm import F32, _check, _cost_rows, _dot, _round_up, _tile, _tiling, gmm, grouped_rows_call
from pallas_kernels.mxfp4 import BLOCK, MXFP4, NIBBLE, decode_e2m1, decode_e8m0, dequantize
from pallas_kernels.platform import resolve_backend
from pallas_kernels.varying import match_varying

PLANE_BLOCK = BLOCK // 2  # lanes of a nibble plane (one code per byte) sharing a scale
_NT = ((1,), (1,))  # x [tm, k] . w [tn, k]: the weight in the release's [out, in] orientation


def gmm_mxfp4_reference(lhs, w: MXFP4, group_sizes):
    """``jax.lax.ragged_dot`` on the dequantized weight, in lhs's dtype (float32 accumulation)."""
    return jax.lax.ragged_dot(lhs, jnp.swapaxes(dequantize(w, lhs.dtype), 1, 2), group_sizes,
                              preferred_element_type=F32).astype(lhs.dtype)


def _plane_scales(scale, kk, th):
    """The scales of a step's nibble planes: scale bytes ``[tn, in/32]`` (the expert's whole rows) ->
    float32 ``[tn, th]``, lane j of contraction step kk getting block ``kk * th / 16 + j // 16``."""
    nb = scale.shape[1]
    block = jax.lax.broadcasted_iota(jnp.int32, (nb, th), 0)
    lane_block = kk * (th // PLANE_BLOCK) + (jax.lax.broadcasted_iota(jnp.int32, (nb, th), 1) >> 4)
    onehot = (block == lane_block).astype(jnp.bfloat16)
    repeated = _dot(scale.astype(jnp.int32).astype(F32).astype(jnp.bfloat16), onehot, ((1,), (0,)))
    return decode_e8m0(repeated.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret", "expected_rows"))
def gmm_mxfp4(lhs, w: MXFP4, group_sizes, *, tiling=None, out_dtype=None, interpret=None, expected_rows=None):
    """``out[r] = lhs[r] @ W[e(r)]`` for expert-sorted rows r, W held as MXFP4 (TPU kernel).

    lhs [M, in]; w: :class:`MXFP4` (``packed [E, out, in/2]``, ``scale [E, out, in/32]``); group_sizes [E]
    int with sum <= M. Returns [M, out] in ``out_dtype`` (default lhs.dtype); rows past
    ``sum(group_sizes)`` are zero. The weight goes to the MXU in lhs's dtype. tiling ``(tm, tk, tn)`` as in
    ``gmm`` (tk along ``in``, made a multiple of 256 that divides it, or all of it).
    """
    _check(lhs, group_sizes)
    interpret, _ = resolve_backend(interpret, "tpu")
    tm, tk, tn = _tiling(tiling, "tpu")
    M, D = lhs.shape
    E, F, half = w.packed.shape
    if 2 * half != D or w.scale.shape != (E, F, D // BLOCK) or group_sizes.shape != (E,) or D % BLOCK:
        raise ValueError(f"shape mismatch: lhs {lhs.shape}, packed {w.packed.shape}, scale {w.scale.shape}, "
                         f"group_sizes {group_sizes.shape}")
    if w.packed.dtype != jnp.uint8 or w.scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 packed / scale must be uint8, got {w.packed.dtype} / {w.scale.dtype}")
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    cdt = lhs.dtype
    # th: the contraction tile of a nibble plane (tk / 2 columns of x), lane aligned or the whole width
    th, tn = _tile(half, max(tk // 2, 128)), _tile(F, tn)
    tm = min(tm, _round_up(M, 8))

    def product(x_refs, w_refs, kk):
        x_even, x_odd = x_refs
        packed_ref, scale_ref = w_refs
        scale = _plane_scales(scale_ref[...], kk, th)
        codes = packed_ref[...].astype(jnp.int32)
        w_even = (decode_e2m1(codes & NIBBLE) * scale).astype(cdt)
        w_odd = (decode_e2m1(codes >> 4) * scale).astype(cdt)
        return _dot(x_even[...].astype(cdt), w_even, _NT) + _dot(x_odd[...].astype(cdt), w_odd, _NT)

    rows = _cost_rows(M, expected_rows, E, tm)
    isz = lambda d: jnp.dtype(d).itemsize
    cost = pl.CostEstimate(
        flops=2 * rows * D * F, transcendentals=0,
        bytes_accessed=rows * D * isz(lhs.dtype) * (F // tn) + E * F * (half + D // BLOCK) + rows * F * isz(out_dtype))
    weight = ((w.packed, (tn, th), lambda g, n, kk: (g, n, kk)),
              (w.scale, (tn, D // BLOCK), lambda g, n, kk: (g, n, 0)))  # whole scale rows: fetched once per tile
    return grouped_rows_call(product, (lhs[:, 0::2], lhs[:, 1::2]), th, weight, group_sizes, out_cols=F, tm=tm, tn=tn,
                             out_dtype=out_dtype, interpret=interpret, cost=cost, name="gmm_mxfp4")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _mxfp4_matmul(lhs, packed, scale, group_sizes, tiling, interpret, expected_rows):
    return gmm_mxfp4(lhs, MXFP4(packed, scale), group_sizes, tiling=tiling, interpret=interpret,
                     expected_rows=expected_rows)


def _mm_fwd(lhs, packed, scale, group_sizes, tiling, interpret, expected_rows):
    return _mxfp4_matmul(lhs, packed, scale, group_sizes, tiling, interpret, expected_rows), (packed, scale,
                                                                                               group_sizes)


def _mm_bwd(tiling, interpret, expected_rows, res, dy):
    packed, scale, group_sizes = res
    # dx = dy @ W_e^T: W_e^T is the release's [out, in], so gmm without transposing
    dx = gmm(dy, dequantize(MXFP4(packed, scale), dy.dtype), group_sizes, tiling=tiling, out_dtype=dy.dtype,
             interpret=interpret, backend="tpu", expected_rows=expected_rows)
    return dx, None, None, None


_mxfp4_matmul.defvjp(_mm_fwd, _mm_bwd)


def mxfp4_grouped_matmul(lhs, w: MXFP4, group_sizes, *, tiling=None, interpret=None, backend=None,
                         expected_rows=None):
    """Differentiable ``gmm_mxfp4`` (``grouped_matmul`` for an :class:`MXFP4` weight): the gradient of lhs
    only, the weights are frozen. TPU kernel only (``backend`` "tpu" or None; on a CPU host it is
    interpreted)."""
    interpret, backend = resolve_backend(interpret, backend)
    if backend != "tpu":
        raise NotImplementedError(f"the MXFP4 grouped matmul is a TPU kernel; on {backend} dequantize the weights")
    packed, scale = (match_varying(a, lhs) for a in w)
    lhs = match_varying(match_varying(lhs, packed), scale)
    return _mxfp4_matmul(lhs, packed, scale, group_sizes.astype(jnp.int32), _tiling(tiling, backend), interpret,
                         expected_rows)


__all__ = ["gmm_mxfp4", "gmm_mxfp4_reference", "mxfp4_grouped_matmul"]

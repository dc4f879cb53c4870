"""MXFP4 codec (OCP Microscaling v1.0, FP4 E2M1 elements, E8M0 block scales), pure NumPy.

Storage layout of the Kimi-K3 release (compressed-tensors ``mxfp4-pack-quantized``,
research/k3_format.md §1.3), for an ``nn.Linear`` weight ``W [..., out, in]``:

- ``weight_packed`` uint8 ``[..., out, in / 2]``: two 4-bit codes per byte, the **low nibble is
  the even input column**, the high nibble the odd one. Code bit 3 is the sign, bits 0-2 index the
  magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
- ``weight_scale`` uint8 ``[..., out, in / 32]``: one E8M0 exponent per 32 consecutive input
  columns (the contraction axis); the factor is ``2 ** (byte - 127)``; 0xFF is NaN.

``W[o, i] = value(code[o, i]) * 2 ** (scale[o, i // 32] - 127)``.

Packed nibbles cannot be transposed, so packed arrays stay in the HF ``[out, in]`` orientation.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

GROUP_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# E2M1 magnitude of codes 0..7; codes 8..15 are the negatives.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest power of two in E2M1 (4 = 2**2)
# All 16 codes, signed (code 8 is -0).
_LUT16 = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)

ScaleRule = Literal["ceil", "ocp"]


def e8m0_to_float(scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """E8M0 bytes -> factors ``2 ** (byte - 127)`` (byte 0 = 2**-127, 0xFF = NaN)."""
    s = np.asarray(scale, dtype=np.uint8)
    with np.errstate(over="ignore"):
        out = np.ldexp(np.asarray(1.0, dtype), s.astype(np.int32) - E8M0_BIAS).astype(dtype)
    return np.where(s == E8M0_NAN, np.asarray(np.nan, dtype), out)


def decode(packed: np.ndarray, scale: np.ndarray, dtype=np.float32) -> np.ndarray:
    """``weight_packed [..., out, in/2]`` + ``weight_scale [..., out, in/32]`` -> ``[..., out, in]``."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise ValueError(f"MXFP4 packed/scale must be uint8, got {packed.dtype}/{scale.dtype}")
    n_in = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or n_in != scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"MXFP4 shapes disagree: packed {packed.shape} (in = {n_in}) vs scale {scale.shape} "
                         f"(expected [..., out, in/{GROUP_SIZE}])")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], n_in)
    # float32 like the reference decoders (exact for every finite result); float64 on request
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    values = _LUT16.astype(work)[codes]
    with np.errstate(over="ignore"):
        values = values.reshape(*scale.shape, GROUP_SIZE) * e8m0_to_float(scale, work)[..., None]
    return values.reshape(*packed.shape[:-1], n_in).astype(dtype)


def _round_to_e2m1(x: np.ndarray) -> np.ndarray:
    """Codes (0..15) of the nearest E2M1 values to ``x`` (float32), ties to even, saturating at 6."""
    mag = np.minimum(np.abs(x), E2M1_MAX)
    # Midpoints between consecutive magnitudes; at a tie pick the one with an even mantissa bit
    # (codes 0, 2, 4, 6 have mantissa 0 except 0, which is the subnormal zero: tie 0.25 -> 0).
    idx = np.searchsorted(E2M1_VALUES, mag)  # first value >= mag
    idx = np.clip(idx, 1, len(E2M1_VALUES) - 1)
    lo, hi = E2M1_VALUES[idx - 1], E2M1_VALUES[idx]
    dlo, dhi = mag - lo, hi - mag
    pick_hi = (dhi < dlo) | ((dhi == dlo) & ((idx % 2) == 0))
    code = np.where(pick_hi, idx, idx - 1).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0), code)  # NaN cannot be represented; encoded as 0
    sign = (np.signbit(x) & (code != 0)).astype(np.uint8) << 3
    return code | sign


def shared_exponent(amax: np.ndarray, rule: ScaleRule = "ceil") -> np.ndarray:
    """Unbiased block exponent from the block's max magnitude.

    - ``"ceil"`` (default, no clipping): ``ceil(log2(amax / 6))``, the smallest power of two with
      ``amax / X <= 6``. Decoding and re-encoding a decoded block gives back the same values.
    - ``"ocp"``: OCP MX v1.0 Algorithm 1, ``floor(log2(amax)) - 2``; blocks whose peak mantissa
      exceeds 1.5 clip their largest element to 6 (k3_format.md §4.2-4.3).

    ``amax = 0`` gives exponent 0 (byte 127). Exponents are clamped to E8M0's [-127, 127].
    """
    amax = np.asarray(amax, np.float32)
    safe = np.where(amax > 0, amax, np.float32(1.0))
    if rule == "ceil":
        # frexp: safe/6 = m * 2**e with m in [0.5, 1): ceil(log2) = e, or e - 1 when m == 0.5.
        m, e = np.frexp(safe / np.float32(E2M1_MAX))
        exp = np.where(m == 0.5, e - 1, e)
    elif rule == "ocp":
        _, e = np.frexp(safe)  # floor(log2(safe)) = e - 1
        exp = (e - 1) - E2M1_EMAX
    else:
        raise ValueError(f"unknown MXFP4 scale rule {rule!r}; use 'ceil' or 'ocp'")
    exp = np.where(amax > 0, exp, 0)
    return np.clip(exp, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)


def encode(w: np.ndarray, *, rule: ScaleRule = "ceil") -> tuple[np.ndarray, np.ndarray]:
    """``W [..., out, in]`` (float) -> (``weight_packed [..., out, in/2]``, ``weight_scale [..., out, in/32]``).

    Round-to-nearest-even on the E2M1 grid after dividing by the block scale, saturating at +-6.
    ``in`` must be a multiple of 32.
    """
    w = np.asarray(w, dtype=np.float32)
    n_in = w.shape[-1]
    if n_in % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP_SIZE}, got {n_in}")
    blocks = w.reshape(*w.shape[:-1], n_in // GROUP_SIZE, GROUP_SIZE)
    exp = shared_exponent(np.max(np.abs(blocks), axis=-1), rule)
    scaled = blocks * np.ldexp(np.float32(1.0), -exp)[..., None].astype(np.float32)
    codes = _round_to_e2m1(scaled).reshape(*w.shape[:-1], n_in)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scale = (exp + E8M0_BIAS).astype(np.uint8)
    return packed, scale


def quantize_dequantize(w: np.ndarray, *, rule: ScaleRule = "ceil") -> np.ndarray:
    """Fake quantization ``decode(encode(w))`` along the last axis, in w's dtype."""
    w = np.asarray(w)
    return decode(*encode(w, rule=rule), dtype=np.float32).astype(w.dtype)


@dataclasses.dataclass(frozen=True)
class PackedMXFP4:
    """A routed-expert weight kept packed (``from_hf(..., keep_mxfp4=True)``).

    ``packed [..., out, in/2]`` and ``scale [..., out, in/32]`` in HF orientation; the leading axes
    are the k3jax leaf's leading axes (``[groups,] experts``). The dense k3jax leaf it stands for has
    shape ``[..., in, out]`` (``logical_shape``). Arrays may be NumPy or JAX arrays.
    """

    packed: object
    scale: object

    @property
    def logical_shape(self) -> tuple[int, ...]:
        *lead, out, half = self.packed.shape
        return (*lead, half * 2, out)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.logical_shape

    def dequantize(self, dtype=np.float32) -> np.ndarray:
        """The dense k3jax-orientation array ``[..., in, out]``."""
        w = decode(np.asarray(self.packed), np.asarray(self.scale), np.float32)
        return np.swapaxes(w, -1, -2).astype(dtype)


def _register_pytree():
    try:
        import jax
    except ImportError:  # pragma: no cover - NumPy-only use
        return
    jax.tree_util.register_pytree_node(
        PackedMXFP4, lambda p: ((p.packed, p.scale), None), lambda _, c: PackedMXFP4(*c))


_register_pytree()

__all__ = ["E2M1_VALUES", "GROUP_SIZE", "PackedMXFP4", "decode", "e8m0_to_float", "encode",
           "quantize_dequantize", "shared_exponent"]

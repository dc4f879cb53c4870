"""MXFP4 codec (OCP Microscaling v1.0, FP4 E2M1 elements, E8M0 block scales), pure NumPy.

This is the HF interop's codec (``from_hf`` / ``to_hf`` read and write packed experts with it) and the
independent transcription of the format that the tests hold the JAX quantizer
(``k3jax.quant.mxfp4``, integer arithmetic on IEEE bits) against, bit for bit. It is written
differently on purpose: IEEE float arithmetic (``frexp``, exact power-of-two scaling) and a table
search for the nearest E2M1 value.

Storage layout of the Kimi-K3 release (compressed-tensors ``mxfp4-pack-quantized``,
the compressed-tensors ``pack-quantized`` layout of the K3 release), for an ``nn.Linear`` weight ``W [..., out, in]``:

- ``weight_packed`` uint8 ``[..., out, in / 2]``: two 4-bit codes per byte, the **low nibble is
  the even input column**, the high nibble the odd one. Code bit 3 is the sign, bits 0-2 index the
  magnitudes ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
- ``weight_scale`` uint8 ``[..., out, in / 32]``: one E8M0 exponent per 32 consecutive input
  columns (the contraction axis); the factor is ``2 ** (byte - 127)``; 0xFF is NaN.

``W[o, i] = value(code[o, i]) * 2 ** (scale[o, i // 32] - 127)``.

Encoding: scale rule per ``k3jax.quant.formats`` (default ``ceil``, the release's); elements round to
nearest, ties to even, saturating at 6, keeping the input's sign bit (-0.0 -> code 8); a block with
an infinity or NaN gets scale 0xFF (decodes to NaN) and zero codes; a zero block gets scale 127.

Packed nibbles cannot be transposed, so packed arrays stay in the HF ``[out, in]`` orientation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.quant.formats import DEFAULT_SCALE_RULE, E2M1, E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN, \
    GROUP_SIZE, SCALE_RULES, ScaleRule

E2M1_VALUES = np.array([E2M1.value(c) for c in range(8)], dtype=np.float32)
E2M1_MAX = E2M1.max_value
E2M1_EMAX = E2M1.emax  # exponent of the largest power of two in E2M1 (4 = 2**2)
# All 16 codes, signed (code 8 is -0).
_LUT16 = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
_SIGN_BIT = E2M1.sign_bit


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
    with np.errstate(over="ignore", invalid="ignore"):
        values = values.reshape(*scale.shape, GROUP_SIZE) * e8m0_to_float(scale, work)[..., None]
    return values.reshape(*packed.shape[:-1], n_in).astype(dtype)


def _round_to_e2m1(x: np.ndarray) -> np.ndarray:
    """Codes (0..15) of the nearest E2M1 values to finite float32 ``x``, ties to even, saturating at 6."""
    mag = np.minimum(np.abs(x), E2M1_MAX)
    # Midpoints between consecutive magnitudes; at a tie pick the one with an even mantissa bit
    # (the even codes 0, 2, 4, 6).
    idx = np.searchsorted(E2M1_VALUES, mag)  # first value >= mag
    idx = np.clip(idx, 1, len(E2M1_VALUES) - 1)
    lo, hi = E2M1_VALUES[idx - 1], E2M1_VALUES[idx]
    dlo, dhi = mag - lo, hi - mag
    pick_hi = (dhi < dlo) | ((dhi == dlo) & ((idx % 2) == 0))
    code = np.where(pick_hi, idx, idx - 1).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) * np.uint8(_SIGN_BIT))


def shared_exponent(amax: np.ndarray, rule: ScaleRule = DEFAULT_SCALE_RULE) -> np.ndarray:
    """Unbiased block exponent from the block's (finite) max magnitude.

    With ``amax = M * 2**fl``, ``M`` in [1, 2) (``frexp``, exact for subnormals too):

    - ``"ceil"`` (default, the release's rule): ``fl - 2 + (M > 1.5)`` = ``ceil(log2(amax / 6))``,
      the smallest scale with ``amax / X <= 6``: never clips, and decoding then re-encoding never
      changes a value;
    - ``"aiter"``: ``fl - 2 + (M >= 1.5)``: amax/4 rounded to a power of two with the round-up
      threshold at mantissa 1.5 (AITER's ``f32_to_e8m0``); differs from ``"ceil"`` only at
      ``amax = 6 * 2**k``;
    - ``"ocp"``: OCP MX v1.0 Algorithm 1, ``floor(log2(amax)) - 2``; blocks whose peak mantissa
      exceeds 1.5 clip their largest element to 6 (docs/quantization.md, "The scale rule is a switch").

    ``amax = 0`` gives exponent 0 (byte 127). Exponents are clamped to E8M0's [-127, 127].
    """
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown MXFP4 scale rule {rule!r}; use one of {SCALE_RULES}")
    amax = np.asarray(amax, np.float32)
    safe = np.where(amax > 0, amax, np.float32(1.0))
    m, e = np.frexp(safe)  # safe = m * 2**e, m in [0.5, 1): M = 2m, fl = e - 1
    mantissa, fl = 2 * m.astype(np.float64), e.astype(np.int64) - 1
    exp = fl - E2M1_EMAX
    if rule == "aiter":
        exp = exp + (mantissa >= 1.5)
    elif rule == "ceil":
        exp = exp + (mantissa > E2M1_MAX / 2**E2M1_EMAX)
    exp = np.where(amax > 0, exp, 0)
    return np.clip(exp, E8M0_MIN_EXP, E8M0_MAX_EXP).astype(np.int32)


def encode(w: np.ndarray, *, rule: ScaleRule = DEFAULT_SCALE_RULE) -> tuple[np.ndarray, np.ndarray]:
    """``W [..., out, in]`` (float) -> (``weight_packed [..., out, in/2]``, ``weight_scale [..., out, in/32]``).

    Round-to-nearest-even on the E2M1 grid after dividing by the block scale, saturating at +-6.
    ``in`` must be a multiple of 32.
    """
    w = np.asarray(w, dtype=np.float32)
    n_in = w.shape[-1]
    if n_in % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP_SIZE}, got {n_in}")
    blocks = w.reshape(*w.shape[:-1], n_in // GROUP_SIZE, GROUP_SIZE)
    amax = np.max(np.abs(blocks), axis=-1)
    finite = np.isfinite(amax)
    exp = shared_exponent(np.where(finite, amax, 0), rule)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = blocks * np.ldexp(np.float32(1.0), -exp)[..., None].astype(np.float32)
    codes = np.where(finite[..., None], _round_to_e2m1(np.where(finite[..., None], scaled, 0)), np.uint8(0))
    codes = codes.reshape(*w.shape[:-1], n_in)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scale = np.where(finite, exp + E8M0_BIAS, E8M0_NAN).astype(np.uint8)
    return packed, scale


def quantize_dequantize(w: np.ndarray, *, rule: ScaleRule = DEFAULT_SCALE_RULE) -> np.ndarray:
    """Fake quantization ``decode(encode(w))`` along the last axis, in w's dtype."""
    w = np.asarray(w)
    return decode(*encode(w, rule=rule), dtype=np.float32).astype(w.dtype)


@dataclasses.dataclass(frozen=True)
class PackedMXFP4:
    """One packed weight on the host: ``packed [..., out, in/2]`` and ``scale [..., out, in/32]`` in
    HF orientation, standing for the k3jax-orientation array ``[..., in, out]`` (``logical_shape``).
    (In a model, packed experts live in ``k3jax.quant.packed.MXFP4Weight`` modules.)"""

    packed: np.ndarray
    scale: np.ndarray

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


__all__ = ["E2M1_VALUES", "GROUP_SIZE", "PackedMXFP4", "decode", "e8m0_to_float", "encode",
           "quantize_dequantize", "shared_exponent"]

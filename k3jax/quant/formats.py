"""OCP Microscaling v1.0 formats used by K3: FP4 E2M1 and FP8 E4M3 elements, E8M0 block scales.

Facts only (the OCP MX spec and the K3 release's bytes; docs/quantization.md); the NumPy codec (``k3jax.interop.mxfp4``) and the JAX
quantizers (``k3jax.quant.mx`` and friends) both take their constants from here.

A block is ``GROUP_SIZE`` consecutive elements along the contraction axis sharing one scale
``X = 2 ** (byte - E8M0_BIAS)``; byte ``E8M0_NAN`` means "the whole block is NaN".

Scale rules (how ``X`` follows from the block's largest magnitude ``amax``; ``emax`` is the exponent
of the element format's largest power of two, 2 for E2M1, and ``max_value`` its largest value):

- ``"ceil"`` (default): ``2 ** ceil(log2(amax / max_value))``, the smallest scale that does not clip.
  This is the release's rule as far as the released bytes can tell: a third-party team histogrammed
  the released K3 experts' block peaks (in units of X: 3 for 26 %, 4 for 55 %, 6 for 19 %), which
  only a no-clip rule that puts the peak near E2M1's largest power of two produces
  (docs/quantization.md, "The scale rule is a switch"). ``"ceil"`` and ``"aiter"`` are the two such rules; they differ only
  when ``amax`` is exactly ``6 * 2**k``, which the released bytes cannot reveal (the master weights
  are not public). ``"ceil"`` is the default because it is idempotent: decoding a block and
  re-encoding it never changes a value, so the released (or any exported) experts survive a dense
  round trip exactly and QAT from the released weights starts exactly at the released model.
- ``"aiter"``: ``amax / 2**emax`` rounded to a power of two with the round-up threshold at mantissa
  1.5 (AITER's ``f32_to_e8m0``, as reconstructed in docs/quantization.md). At the tie it
  doubles the scale, so re-encoding a decoded block whose peak is 6 moves its 0.5 and 1.5 elements
  (19 % of the released blocks peak at 6).
- ``"ocp"``: OCP MX v1.0 Algorithm 1, ``2 ** (floor(log2(amax)) - emax)``; clips the peak of
  blocks whose peak mantissa exceeds the element format's largest mantissa (e.g. 7 -> 6).

A zero block gets byte 127 (X = 1); shared exponents are clamped to E8M0's [-127, 127].
"""

from __future__ import annotations

import dataclasses
from typing import Literal

GROUP_SIZE = 32  # elements per block, along the contraction (input) axis
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # byte 0 is 2**-127; 0xFF is NaN, so 254 -> 2**127 is the largest

ScaleRule = Literal["ceil", "aiter", "ocp"]
SCALE_RULES: tuple[str, ...] = ("ceil", "aiter", "ocp")
# The weights' default is the release's rule (see above); MXFP8 activations use the same no-clip rule,
# as the serving kernels do (AITER per_1x32 with e8m0 scales).
DEFAULT_SCALE_RULE: ScaleRule = "ceil"
DEFAULT_ACTIVATION_SCALE_RULE: ScaleRule = "ceil"


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude minifloat element: ``bits`` wide, ``mantissa_bits`` explicit mantissa bits,
    normal exponents ``[emin, emax]`` (``emin = 1 - bias``), subnormals below ``2**emin``.

    Magnitude codes are ``exponent_field << mantissa_bits | mantissa``; the sign is the top bit.
    ``max_code`` is the largest finite magnitude code, ``nan_code`` the magnitude code of NaN (if any).
    """

    name: str
    bits: int
    mantissa_bits: int
    emin: int
    emax: int
    max_code: int
    max_value: float
    nan_code: int | None = None

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def magnitude_mask(self) -> int:
        return self.sign_bit - 1

    def value(self, code: int) -> float:
        """The value of one code (a readable definition, used to check the tables)."""
        mag = code & self.magnitude_mask
        if self.nan_code is not None and mag == self.nan_code:
            return float("nan")
        e, m = mag >> self.mantissa_bits, mag & ((1 << self.mantissa_bits) - 1)
        scale = 1 << self.mantissa_bits
        v = m / scale * 2.0**self.emin if e == 0 else (1 + m / scale) * 2.0 ** (e - 1 + self.emin)
        return -v if code & self.sign_bit else v


# FP4 E2M1: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf or NaN.
E2M1 = ElementFormat("e2m1", bits=4, mantissa_bits=1, emin=0, emax=2, max_code=0x7, max_value=6.0)
# FP8 E4M3 ("fn": no inf; magnitude code 0x7F is NaN): largest 448 = 1.75 * 2**8.
E4M3 = ElementFormat("e4m3", bits=8, mantissa_bits=3, emin=-6, emax=8, max_code=0x7E, max_value=448.0, nan_code=0x7F)

# E2M1 magnitudes of codes 0..7 (codes 8..15 are their negatives; 8 is -0).
E2M1_VALUES: tuple[float, ...] = tuple(E2M1.value(c) for c in range(8))

__all__ = ["DEFAULT_ACTIVATION_SCALE_RULE", "DEFAULT_SCALE_RULE", "E2M1", "E2M1_VALUES", "E4M3", "E8M0_BIAS",
           "E8M0_MAX_EXP", "E8M0_MIN_EXP", "E8M0_NAN", "ElementFormat", "GROUP_SIZE", "SCALE_RULES", "ScaleRule"]

"""Microscaling block quantization in JAX, computed on the IEEE bits with integer arithmetic.

Why integers: XLA on CPU and TPU flushes float32 subnormals to zero (inputs and results), so a
float implementation would quantize tiny blocks differently on different backends and disagree with
the IEEE-exact NumPy codec. Working on the bit patterns gives the same bytes everywhere: the block
maximum is an unsigned max of the magnitude bits (for non-negative floats the bit order is the
value order; NaN patterns sort above infinity), shared exponents come from the exponent field and a
leading-zero count, and elements are rounded to nearest, ties to even, with integer shifts.

Conventions (``fmt`` is an :class:`~k3jax.quant.formats.ElementFormat`, blocks run along ``axis``):

- an element's code keeps the input's sign bit (IEEE conversion semantics: -0.0 and negatives that
  round to zero encode as -0); magnitudes above the format's largest value saturate to it;
- a block holding a NaN or an infinity gets scale byte 0xFF and decodes to NaN entirely (MX elements
  have no infinity; the OCP spec's NaN scale keeps a non-finite weight from turning finite);
- a zero block gets scale byte 127 (X = 1) and zero codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.quant.formats import E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, E8M0_NAN, GROUP_SIZE, SCALE_RULES, \
    ElementFormat, ScaleRule

# float32 bit layout
_MANT_BITS = 23
_EXP_SHIFT = _MANT_BITS
_FRAC_MASK = (1 << _MANT_BITS) - 1
_HIDDEN_BIT = 1 << _MANT_BITS
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_QNAN_BITS = 0x7FC00000
_BIAS = 127
_MIN_NORMAL_EXP = -126
_MAX_EXP = 127
_LSB_EXP = -149  # exponent of the least significant bit of float32 subnormals
# a 24-bit significand shifted right by this much is below one half: it rounds to zero
_MAX_USEFUL_SHIFT = _MANT_BITS + 2
# mantissa fraction of 1.5 (the "aiter" rule's round-up threshold)
_HALF_FRAC = 1 << (_MANT_BITS - 1)


def _u32(x) -> jax.Array:
    return jnp.asarray(x, jnp.uint32)


def f32_bits(x: jax.Array) -> jax.Array:
    """uint32 bit patterns of ``x`` as float32 (bfloat16 and float32 exactly, subnormals included)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if x.dtype == jnp.bfloat16:  # bfloat16 is the top half of float32: no conversion, no flushing
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def from_f32_bits(bits: jax.Array, dtype) -> jax.Array:
    """float32 bit patterns -> values of ``dtype`` (float32 and bfloat16 without flushing subnormals)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    if dtype == jnp.bfloat16:
        # round to nearest even on the dropped half; NaN stays a quiet NaN
        rounded = (bits + _u32(0x7FFF) + ((bits >> 16) & 1)) >> 16
        is_nan = (bits & _ABS_MASK) > _INF_BITS
        out = jnp.where(is_nan, _u32(_QNAN_BITS >> 16), rounded).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(out, jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _floor_log2(u: jax.Array) -> jax.Array:
    """floor(log2(u)) of a positive uint32, as int32 (-1 for 0)."""
    return 31 - jax.lax.clz(u).astype(jnp.int32)


def _significand(abs_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Non-negative float32 bits -> (significand uint32, exponent int32) with value = sig * 2**exp."""
    e_field = (abs_bits >> _EXP_SHIFT).astype(jnp.int32)
    frac = abs_bits & _FRAC_MASK
    normal = e_field > 0
    sig = jnp.where(normal, frac | _HIDDEN_BIT, frac)
    exp = jnp.where(normal, e_field - _BIAS - _MANT_BITS, _LSB_EXP)
    return sig, exp


def shared_exponent(amax_bits: jax.Array, fmt: ElementFormat, rule: ScaleRule) -> jax.Array:
    """Unbiased block exponent (int32, clamped to E8M0's range) from the bits of a finite block
    maximum; 0 for a zero block. See :mod:`k3jax.quant.formats` for the rules."""
    if rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {rule!r}; expected one of {SCALE_RULES}")
    sig, exp = _significand(amax_bits)
    fl_sig = _floor_log2(jnp.maximum(sig, 1))
    fl = fl_sig + exp  # floor(log2(amax))
    # amax = (1 + frac / 2**23) * 2**fl: the normalised mantissa fraction (subnormals shifted up)
    frac = (sig << (_MANT_BITS - fl_sig).astype(jnp.uint32)) & _FRAC_MASK
    e = fl - fmt.emax
    if rule == "ceil":  # one more when amax exceeds the format's largest value times 2**e
        max_frac = int(round((fmt.max_value / 2.0**fmt.emax - 1.0) * (1 << _MANT_BITS)))
        e = e + (frac > max_frac).astype(jnp.int32)
    elif rule == "aiter":
        e = e + (frac >= _HALF_FRAC).astype(jnp.int32)
    e = jnp.clip(e, E8M0_MIN_EXP, E8M0_MAX_EXP)
    return jnp.where(amax_bits == 0, 0, e)


def _round_shift(sig: jax.Array, shift: jax.Array) -> jax.Array:
    """``sig / 2**shift`` rounded to nearest, ties to even (uint32 ``sig`` < 2**24, int32 ``shift``)."""
    left = sig << jnp.clip(-shift, 0, 31).astype(jnp.uint32)  # shift <= 0: exact (tiny significands only)
    s = jnp.clip(shift, 1, _MAX_USEFUL_SHIFT).astype(jnp.uint32)
    q = sig >> s
    rem = sig & ((_u32(1) << s) - 1)
    half = _u32(1) << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return jnp.where(shift <= 0, left, q + up.astype(jnp.uint32))


def encode_elements(bits: jax.Array, exp: jax.Array, fmt: ElementFormat) -> jax.Array:
    """Element codes (uint8: sign bit + magnitude code) of float32 ``bits`` divided by ``2**exp``
    (int32, broadcast against ``bits``), rounded to nearest even and saturated."""
    sign = (bits >> 31).astype(jnp.uint8)
    sig, e_x = _significand(bits & _ABS_MASK)
    k = e_x - exp  # the scaled value is sig * 2**k
    fl = _floor_log2(jnp.maximum(sig, 1)) + k
    m = fmt.mantissa_bits
    quantum = jnp.maximum(fl, fmt.emin) - m  # exponent of the grid spacing around the value
    n = _round_shift(sig, quantum - k)  # the value in grid steps
    # Codes are monotonic in value: each binade above the subnormal one adds 2**m codes.
    mag = (quantum - (fmt.emin - m)) * (1 << m) + n.astype(jnp.int32)
    mag = jnp.where(sig == 0, 0, jnp.minimum(mag, fmt.max_code))
    return mag.astype(jnp.uint8) | (sign << (fmt.bits - 1))


def _compose(n: jax.Array, k: jax.Array) -> jax.Array:
    """float32 bits of ``n * 2**k`` for a small uint32 ``n`` (exact for every product of an MX
    element and an E8M0 scale: those are never below float32's smallest subnormal)."""
    fl = _floor_log2(jnp.maximum(n, 1))
    e = fl + k
    mant = (n << (_MANT_BITS - fl).astype(jnp.uint32)) & _FRAC_MASK
    normal = ((e + _BIAS).astype(jnp.uint32) << _EXP_SHIFT) | mant
    subnormal = n << jnp.clip(k - _LSB_EXP, 0, 31).astype(jnp.uint32)
    out = jnp.where(e >= _MIN_NORMAL_EXP, normal, subnormal)
    out = jnp.where(e > _MAX_EXP, _u32(_INF_BITS), out)
    return jnp.where(n == 0, _u32(0), out)


def decode_elements(codes: jax.Array, exp: jax.Array, fmt: ElementFormat) -> jax.Array:
    """float32 bits of element ``codes`` (uint8) times ``2**exp`` (int32, broadcast)."""
    codes = codes.astype(jnp.uint32)
    mag = codes & fmt.magnitude_mask
    m = fmt.mantissa_bits
    e_field = (mag >> m).astype(jnp.int32)
    mant = mag & ((1 << m) - 1)
    n = jnp.where(e_field == 0, mant, mant | (1 << m))
    k = jnp.where(e_field == 0, fmt.emin, e_field - 1 + fmt.emin) - m + exp
    bits = _compose(n, k) | ((codes >> (fmt.bits - 1)) << 31)
    if fmt.nan_code is not None:
        bits = jnp.where(mag == fmt.nan_code, _u32(_QNAN_BITS), bits)
    return bits


# ---------------------------------------------------------------------------------------------
# Blocks along an axis


def _block_view(x: jax.Array, axis: int) -> tuple[jax.Array, int]:
    """``x`` with ``axis`` split into (blocks, GROUP_SIZE); returns the view and the in-block axis."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % GROUP_SIZE:
        raise ValueError(f"MX blocks need the blocked axis to be a multiple of {GROUP_SIZE}, got {n} "
                         f"(shape {x.shape}, axis {axis})")
    return x.reshape(x.shape[:axis] + (n // GROUP_SIZE, GROUP_SIZE) + x.shape[axis + 1:]), axis + 1


def quantize_blocks(x: jax.Array, fmt: ElementFormat, rule: ScaleRule, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """``x [..., n, ...]`` -> (codes uint8 of x's shape, scale bytes uint8 with ``n / 32`` on ``axis``)."""
    bits, block_axis = _block_view(f32_bits(x), axis)
    abs_bits = bits & _ABS_MASK
    amax = jnp.max(abs_bits, axis=block_axis, keepdims=True)
    finite = amax < _INF_BITS
    exp = shared_exponent(jnp.where(finite, amax, 0), fmt, rule)
    codes = jnp.where(finite, encode_elements(bits, exp, fmt), jnp.uint8(0))
    scale = jnp.where(finite, exp + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
    return codes.reshape(x.shape), jnp.squeeze(scale, block_axis)


def dequantize_blocks(codes: jax.Array, scale: jax.Array, fmt: ElementFormat, dtype, axis: int = -1) -> jax.Array:
    """Codes ``[..., n, ...]`` and scale bytes (``n / 32`` on ``axis``) -> values of ``dtype``."""
    view, block_axis = _block_view(codes, axis)
    scale = jnp.expand_dims(scale, block_axis)
    bits = decode_elements(view, scale.astype(jnp.int32) - E8M0_BIAS, fmt)
    bits = jnp.where(scale == E8M0_NAN, _u32(_QNAN_BITS), bits)
    return from_f32_bits(bits.reshape(codes.shape), dtype)


def fake_quantize_blocks(x: jax.Array, fmt: ElementFormat, rule: ScaleRule, axis: int = -1) -> jax.Array:
    """Quantize then dequantize along ``axis``: the values of ``x`` on the MX grid, in x's dtype."""
    codes, scale = quantize_blocks(x, fmt, rule, axis)
    return dequantize_blocks(codes, scale, fmt, x.dtype, axis)


__all__ = ["decode_elements", "dequantize_blocks", "encode_elements", "f32_bits", "fake_quantize_blocks",
           "from_f32_bits", "quantize_blocks", "shared_exponent"]

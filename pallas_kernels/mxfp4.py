"""MXFP4 weights as the kernels take them: the operand type, the element decode shared by the kernel
(``pallas_kernels.moe.gmm_mxfp4``) and the plain dequantization beside it. Public and at the bottom of
the import graph (it needs only jax), so that ``k3jax`` can hand its weights over without importing
Pallas.

The encoding is the Kimi-K3 release's (``k3jax.quant.mxfp4``, which the tests compare against): for a
weight ``W [..., out, in]``, ``packed`` uint8 ``[..., out, in/2]`` holds two E2M1 codes per byte, the
**low nibble the even input column**; code bit 3 is the sign, bits 0-2 index the magnitudes ``0, .5,
1, 1.5, 2, 3, 4, 6``; ``scale`` uint8 ``[..., out, in/32]`` holds one E8M0 byte ``s`` per block of 32
inputs, ``2 ** (s - 127)``, 0xFF meaning NaN (the whole block). Scale byte 0 (``2 ** -127``, a float32
subnormal) decodes as 0: TPUs flush subnormals; ``k3jax.quant.mxfp4`` keeps it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

BLOCK = 32  # E2M1 elements per E8M0 scale, along `in`
NIBBLE = 0xF
_SIGN = 0x8
_F32_EXP_SHIFT = 23
_QNAN_BITS = 0x7FC00000
_E8M0_NAN = 0xFF
_HALF_BITS = 0x3F000000  # float32 0.5


class MXFP4(NamedTuple):
    """Expert weights ``W [E, in, out]`` held as MXFP4 in the release orientation: ``packed`` uint8
    ``[E, out, in/2]`` and ``scale`` uint8 ``[E, out, in/32]``. A pytree: it passes through ``jit`` and
    ``shard_map`` as the two arrays it holds."""

    packed: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense ``(E, in, out)`` this weight stands for."""
        *lead, n_out, half = self.packed.shape
        return (*lead, 2 * half, n_out)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """E2M1 codes (int32 in [0, 16)) -> float32 values, by integer arithmetic on the bits (no table: it
    runs in a TPU kernel). A magnitude code ``m = 2 e + mant`` with ``e > 0`` is ``2**(e-1) (1 + mant/2)``:
    float32 bits ``(m + 252) << 22`` (exponent ``e + 126``, mantissa bit 22); codes 0 and 1 (0 and the
    subnormal 0.5) are set apart. The sign bit goes to bit 31."""
    m = codes & (_SIGN - 1)
    bits = jnp.where(m < 2, m * _HALF_BITS, (m + 252) << 22) | ((codes & _SIGN) << 28)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def decode_e8m0(scales: jax.Array) -> jax.Array:
    """E8M0 scale bytes (int32 in [0, 256)) -> float32 ``2 ** (s - 127)``: the byte is the float32's
    biased exponent. 0xFF is NaN; 0 decodes as 0 (see the module docstring)."""
    bits = jnp.where(scales == _E8M0_NAN, _QNAN_BITS, scales << _F32_EXP_SHIFT)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def dequantize(w: MXFP4, dtype=jnp.float32) -> jax.Array:
    """The plain decode: ``W`` in the release orientation ``[..., out, in]``, in ``dtype``."""
    codes = w.packed.astype(jnp.int32)
    values = jnp.stack([decode_e2m1(codes & NIBBLE), decode_e2m1(codes >> 4)], axis=-1)  # low nibble first
    *lead, n_out, half = codes.shape
    blocks = values.reshape(*lead, n_out, 2 * half // BLOCK, BLOCK)
    blocks = blocks * decode_e8m0(w.scale.astype(jnp.int32))[..., None]
    return blocks.reshape(*lead, n_out, 2 * half).astype(dtype)


__all__ = ["BLOCK", "MXFP4", "NIBBLE", "decode_e2m1", "decode_e8m0", "dequantize"]

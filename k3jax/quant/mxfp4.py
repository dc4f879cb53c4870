"""MXFP4 in JAX: FP4 E2M1 elements in blocks of 32 along the input axis, one E8M0 scale per block,
stored exactly like the Kimi-K3 release (compressed-tensors ``mxfp4-pack-quantized``).

For a weight ``W [..., out, in]`` in the release's torch orientation:

- ``packed`` uint8 ``[..., out, in / 2]``: two codes per byte, the **low nibble is the even input
  column**; code bit 3 is the sign, bits 0-2 index the magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6``;
- ``scales`` uint8 ``[..., out, in / 32]``: E8M0, ``X = 2 ** (byte - 127)``, 0xFF = NaN.

Rounding is to nearest, ties to even; the scale rule is a switch (``k3jax.quant.formats``), by
default ``ceil``, the release's rule. Zeros, subnormal blocks, infinities and NaN: see
``k3jax.quant.mx`` (a block with an inf or NaN decodes to NaN; -0.0 and negatives that round to zero
keep their sign). ``k3jax.interop.mxfp4`` is the independent NumPy transcription the tests compare
this against, bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.quant import mx
from k3jax.quant.formats import DEFAULT_SCALE_RULE, E2M1, GROUP_SIZE, ScaleRule

NIBBLE_BITS = 4
_LOW_NIBBLE = (1 << NIBBLE_BITS) - 1


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """4-bit codes ``[..., n]`` -> bytes ``[..., n / 2]`` (even index in the low nibble)."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << NIBBLE_BITS)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Bytes ``[..., m]`` -> 4-bit codes ``[..., 2 m]``."""
    codes = jnp.stack([packed & _LOW_NIBBLE, packed >> NIBBLE_BITS], axis=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@functools.partial(jax.jit, static_argnames=("rule",))
def quantize_mxfp4(w: jax.Array, *, rule: ScaleRule = DEFAULT_SCALE_RULE) -> tuple[jax.Array, jax.Array]:
    """``w [..., out, in]`` (float) -> (``packed`` uint8 ``[..., out, in/2]``, ``scales`` uint8
    ``[..., out, in/32]``); blocks run along the last (input) axis, which must divide by 32."""
    codes, scales = mx.quantize_blocks(w, E2M1, rule, axis=-1)
    return pack_nibbles(codes), scales


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(packed: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``packed [..., out, in/2]`` + ``scales [..., out, in/32]`` (uint8) -> ``w [..., out, in]``."""
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 packed/scales must be uint8, got {packed.dtype}/{scales.dtype}")
    n_in = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or n_in != scales.shape[-1] * GROUP_SIZE:
        raise ValueError(f"MXFP4 shapes disagree: packed {packed.shape} (in = {n_in}) vs scales {scales.shape} "
                         f"(expected [..., out, in/{GROUP_SIZE}])")
    return mx.dequantize_blocks(unpack_nibbles(packed), scales, E2M1, dtype, axis=-1)


def fake_quantize_mxfp4(w: jax.Array, *, rule: ScaleRule = DEFAULT_SCALE_RULE, axis: int = -1) -> jax.Array:
    """``dequantize(quantize(w))`` with blocks along ``axis`` (-1: release orientation ``[..., out,
    in]``; -2: k3jax's ``(.., in, out)``), in w's dtype; no packing."""
    return mx.fake_quantize_blocks(w, E2M1, rule, axis)


__all__ = ["dequantize_mxfp4", "fake_quantize_mxfp4", "pack_nibbles", "quantize_mxfp4", "unpack_nibbles"]

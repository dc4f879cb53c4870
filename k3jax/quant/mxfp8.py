"""MXFP8 (FP8 E4M3 elements, E8M0 scale per 32) in JAX: K3's expert-GEMM input activations.

K3 computes its routed experts with MXFP8 inputs (the release's quantization_config; docs/quantization.md): the latent tokens
entering w1 / w3 and the SiTU-GLU output entering w2, quantized per token in blocks of 32 along the
contraction axis at run time. Elements are ``jnp.float8_e4m3fn`` (largest 448, no infinity);
rounding is to nearest even with saturation; the default scale rule is the no-clip ``"ceil"`` of
the serving kernels. Same special-value handling as MXFP4 (``k3jax.quant.mx``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3jax.quant import mx
from k3jax.quant.formats import DEFAULT_ACTIVATION_SCALE_RULE, E4M3, ScaleRule


@functools.partial(jax.jit, static_argnames=("rule", "axis"))
def quantize_mxfp8(x: jax.Array, *, rule: ScaleRule = DEFAULT_ACTIVATION_SCALE_RULE,
                   axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """``x [..., n]`` -> (elements ``float8_e4m3fn [..., n]``, scales uint8 ``[..., n/32]``) with
    blocks along ``axis``; ``x = elements * 2 ** (scale - 127)`` up to rounding."""
    codes, scales = mx.quantize_blocks(x, E4M3, rule, axis)
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn), scales


@functools.partial(jax.jit, static_argnames=("dtype", "axis"))
def dequantize_mxfp8(elements: jax.Array, scales: jax.Array, dtype=jnp.float32, axis: int = -1) -> jax.Array:
    """``float8_e4m3fn`` elements and their uint8 scales -> values of ``dtype``."""
    codes = jax.lax.bitcast_convert_type(elements.astype(jnp.float8_e4m3fn), jnp.uint8)
    return mx.dequantize_blocks(codes, scales, E4M3, dtype, axis)


def fake_quantize_mxfp8(x: jax.Array, *, rule: ScaleRule = DEFAULT_ACTIVATION_SCALE_RULE, axis: int = -1) -> jax.Array:
    """``dequantize(quantize(x))`` along ``axis``, in x's dtype."""
    return mx.fake_quantize_blocks(x, E4M3, rule, axis)


__all__ = ["dequantize_mxfp8", "fake_quantize_mxfp8", "quantize_mxfp8"]

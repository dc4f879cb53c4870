"""Rotary position embeddings with DeepSeek-V3 / Kimi K2 YaRN scaling.

Matches HF transformers' ``_compute_yarn_parameters`` (truncated correction range) and DeepSeek's
interleaved rope layout: with ``interleave=True`` the rotated pairs are ``(x0, x1), (x2, x3), ...``
and the output is written de-interleaved (evens then odds), exactly as HF does; q and k get the same
permutation, so their dot products are unchanged.
"""

import math

import jax
import jax.numpy as jnp


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, yarn=None) -> tuple[jax.Array, float]:
    """Inverse frequencies ``[dim // 2]`` and the cos/sin scale (YaRN's attention factor).

    Computed in float32 on purpose, like the reference implementations the released weights were
    trained with: float64 frequencies are "more exact" but move K2's YaRN angles ~2x further from HF's.
    """
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if yarn is None or yarn.factor <= 1.0:
        return inv_freq, 1.0
    factor = yarn.factor

    def correction_dim(num_rotations):
        return dim * math.log(yarn.original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    inv_freq = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
    if yarn.mscale and yarn.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, yarn.mscale) / _yarn_mscale(factor, yarn.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)
    return inv_freq, attention_factor


def yarn_softmax_scale(head_dim: int, yarn=None) -> float:
    """``head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN (DeepSeek-V3)."""
    scale = head_dim ** -0.5
    if yarn is not None and yarn.factor > 1.0 and yarn.mscale_all_dim:
        m = _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
        scale *= m * m
    return scale


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attention_factor: float = 1.0,
               interleave: bool = False) -> jax.Array:
    """Rotate ``x [B, T, ..., R]`` by ``positions [B, T]``; computed in float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

"""Normalisations, computed in float32 and cast back to the input dtype."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis. x ``[..., D]``, weight ``[D]``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def l2_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (fla's l2norm, used on KDA q and k)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)

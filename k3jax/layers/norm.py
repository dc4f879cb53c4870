"""RMSNorm with a learnable gain."""

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.initializers import constant
from k3jax.ops.norms import rms_norm


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32, axis_name: str = "norm"):
        self.eps = eps
        self.weight = constant(1.0, (dim,), (axis_name,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., D]`` -> ``[..., D]`` in x's dtype."""
        return rms_norm(x, self.weight[...], self.eps)

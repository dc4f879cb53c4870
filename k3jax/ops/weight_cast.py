"""A weight's cast to the compute dtype that stays inside the layer loop.

Inside the scanned layer groups a weight is read as ``convert(dynamic-slice(stack, layer))``. XLA:TPU
rewrites a float32 -> bfloat16 ``convert`` of a slice into a slice of a converted stack, hoists that
convert out of the layer loops and shares it between the forward and the backward loop: a bfloat16
copy of every stacked weight, live for the whole step. For full K3 on v5p-1024 that was 12 routed-
expert stacks, 10.2 GB per device at the step's peak. The same rounding written as integer operations
on the float32 bits is not moved, so each layer's weights are rounded where they are used (twice, in
the forward and in the backward loop: an elementwise pass, against the layer's matmuls).

Under a mesh its result is pinned to the weight's storage layout before the FSDP gather
(``k3jax.sharding.gather_weight``): its ops then run on each device's shard, and the gather moves the
bfloat16 result, not its operands (the values and the NaN mask, which sharding propagation otherwise
gathers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# a NumPy scalar: a JAX value made at import would start the backend before jax.distributed.initialize
_BF16_NAN = np.array(np.nan, jnp.bfloat16)


@jax.custom_vjp
def _float32_to_bfloat16(x: jax.Array) -> jax.Array:
    """Round-to-nearest-even float32 -> bfloat16 from the bits: the value ``x.astype(bfloat16)`` gives
    (infinities and overflow to infinity included; NaN stays NaN)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16  # ties to the even upper half
    y = jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)
    return jnp.where(jnp.isnan(x), _BF16_NAN, y)  # a NaN's payload could carry into the sign bit


def _cast_fwd(x):
    return _float32_to_bfloat16(x), None


def _cast_bwd(_, g):
    return (g.astype(jnp.float32),)  # a cast's transpose, as for astype


_float32_to_bfloat16.defvjp(_cast_fwd, _cast_bwd)


def weight_cast(w: jax.Array, dtype) -> jax.Array:
    """``w.astype(dtype)``, with float32 -> bfloat16 written so that XLA cannot hoist it out of the
    layer loop (module docstring). Same values and gradients as ``astype``."""
    dtype = jnp.dtype(dtype)
    if w.dtype == dtype:
        return w
    if w.dtype == jnp.float32 and dtype == jnp.bfloat16:
        return _float32_to_bfloat16(w)
    return w.astype(dtype)


__all__ = ["weight_cast"]

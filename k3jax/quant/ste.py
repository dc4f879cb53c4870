"""Straight-through estimator: a quantizer in the forward pass, the identity in the backward pass.

``straight_through(q)(x)`` returns exactly ``q(x)`` (a ``jax.custom_vjp``, not ``x + stop_gradient(q(x)
- x)``, which is off by a rounding) and passes the cotangent through unchanged. With the no-clip
scale rules nothing saturates, so there is no clipping range to mask the gradient with. Applied to a
matmul's operands this makes the weight gradient use the *quantized* activations that reached the
matmul and vice versa, as the serving kernels compute them.
"""

from __future__ import annotations

from typing import Callable

import jax


def straight_through(quantize: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``quantize`` (shape- and dtype-preserving) with an identity gradient."""

    @jax.custom_vjp
    def f(x):
        return quantize(x)

    def fwd(x):
        return quantize(x), None

    def bwd(_, g):
        return (g,)

    f.defvjp(fwd, bwd)
    return f


__all__ = ["straight_through"]

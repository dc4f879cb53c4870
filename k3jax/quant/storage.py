"""What every compressed weight in a model shares: its storage variable type and its interface.

A compressed weight is an ``nnx.Module`` standing where a dense parameter ``W (..., in, out)`` would
be (MXFP4 experts, compressed-tensors INT4 experts, DeepSeek FP8 block-scaled weights). The layers
read it through the same accessors as a dense weight (``k3jax.layers.initializers.cast`` for
projections, ``k3jax.layers.quantized_experts.expert_weight`` for routed experts), which call
:meth:`QuantizedWeight.dequantize` right before the matmul.

Its arrays are :class:`QuantizedStorage` variables, not ``nnx.Param``: optimizers (``nnx.Optimizer(...,
wrt=nnx.Param)``), parameter counts and gradients skip them, so a model holding them trains only its
dense parameters (a frozen base, e.g. under LoRA). Checkpoints, scanning and the sharding rules see
them like any other variable.
"""

from __future__ import annotations

import jax
from flax import nnx


class QuantizedStorage(nnx.Variable):
    """The codes or scales of a compressed weight: model state, never trained (not an ``nnx.Param``)."""


def swap_last(axes: tuple[str | None, ...] | None) -> tuple[str | None, ...] | None:
    """Logical axes of a dense ``(..., in, out)`` weight -> those of its torch-orientation storage
    ``(..., out, in')``: the last two swapped (leading group / expert axes unchanged)."""
    return None if axes is None else (*axes[:-2], axes[-1], axes[-2])


class QuantizedWeight(nnx.Module):
    """Base of the compressed weights: ``shape`` (the dense ``(..., in, out)`` it stands for), ``axes``
    (the dense weight's logical axis names, or None) and ``dequantize(dtype)``."""

    axes: tuple[str | None, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def dequantize(self, dtype) -> jax.Array:
        """The dense weight ``(..., in, out)`` in ``dtype``."""
        raise NotImplementedError


__all__ = ["QuantizedStorage", "QuantizedWeight", "swap_last"]

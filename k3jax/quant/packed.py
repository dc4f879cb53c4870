"""Packed MXFP4 weights as model state: the deployment form of the routed experts.

An :class:`MXFP4Weight` stands where a dense expert parameter ``W (..., in, out)`` would be and holds
the release's bytes instead (``packed (..., out, in/2)`` and ``scale (..., out, in/32)``, uint8, in
the torch orientation because nibbles cannot be transposed): 4.25 bits per weight, 17/64 of
bfloat16. The forward pass dequantizes them on the fly (:meth:`MXFP4Weight.dequantize`). Both
arrays are :class:`MXFP4Bytes` variables, not ``nnx.Param``: optimizers and parameter counts skip
them, checkpoints and sharding rules see them like any other variable (their logical axis names are
the dense weight's, last two swapped). The leading axes (scanned layer groups, experts) are the
dense weight's, so stacking, scanning and expert sharding work unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.quant.formats import GROUP_SIZE
from k3jax.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3jax.quant.storage import QuantizedStorage, QuantizedWeight, swap_last

PACK = 2  # FP4 codes per byte


class MXFP4Bytes(QuantizedStorage):
    """uint8 storage of an MXFP4 weight (packed codes or E8M0 scales): model state, never trained."""


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Dense ``(..., in, out)`` -> (packed ``(..., out, in/2)``, scale ``(..., out, in/32)``)."""
    *lead, n_in, n_out = shape
    if n_in % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP_SIZE}, got shape {shape}")
    return (*lead, n_out, n_in // PACK), (*lead, n_out, n_in // GROUP_SIZE)


class MXFP4Weight(QuantizedWeight):
    """A weight ``W (..., in, out)`` held as MXFP4: ``packed (..., out, in/2)``, ``scale (..., out, in/32)``."""

    def __init__(self, packed, scale, axes: tuple[str | None, ...] | None = None):
        self.axes = None if axes is None else tuple(axes)
        meta = {} if axes is None else {"out_sharding": swap_last(self.axes)}
        self.packed = MXFP4Bytes(packed, **meta)
        self.scale = MXFP4Bytes(scale, **meta)

    @classmethod
    def from_dense(cls, w: jax.Array, axes=None, *, rule) -> "MXFP4Weight":
        """Quantize a dense ``w (..., in, out)`` (concrete or traced)."""
        packed, scale = quantize_mxfp4(jnp.swapaxes(w, -1, -2), rule=rule)
        return cls(packed, scale, axes)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], axes=None) -> "MXFP4Weight":
        """The structure for a dense ``shape``, with ``jax.ShapeDtypeStruct`` leaves."""
        p, s = packed_shapes(tuple(shape))
        return cls(jax.ShapeDtypeStruct(p, jnp.uint8), jax.ShapeDtypeStruct(s, jnp.uint8), axes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense ``(..., in, out)`` shape this weight stands for."""
        *lead, n_out, half = self.packed.get_raw_value().shape
        return (*lead, half * PACK, n_out)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The dense weight ``(..., in, out)`` in ``dtype``."""
        return jnp.swapaxes(dequantize_mxfp4(self.packed[...], self.scale[...], jnp.dtype(dtype)), -1, -2)


__all__ = ["MXFP4Bytes", "MXFP4Weight", "packed_shapes"]

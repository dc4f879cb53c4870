"""What the MoE layer calls to quantize its routed experts, driven by ``model.quant`` (QuantConfig).

- :func:`expert_param` creates a routed-expert weight ``(E, in, out)``: a dense ``nnx.Param``, or
  with ``experts: mxfp4 / int4 / fp8_block`` a compressed weight (:class:`~k3jax.quant.packed.MXFP4Weight`,
  :class:`~k3jax.quant.int4.Int4Weight`, :class:`~k3jax.quant.fp8_block.FP8BlockWeight`; their arrays are
  ``k3jax.quant.storage.QuantizedStorage`` variables, never trained).
- :func:`expert_weight` gives the weight the expert matmuls use, in the compute dtype: a compressed
  weight dequantized on the fly; with ``experts: mxfp4_qat`` the dense master weight's MXFP4 values
  (fake quantization, blocks along ``in``) with a straight-through gradient; else the cast weight.
  :func:`expert_operand` hands a packed MXFP4 weight over as its bytes instead, where the expert matmuls
  decode it themselves (``k3jax.kernels.packed_mxfp4``).
- :func:`activation_quantizer` gives the MXFP8 fake quantizer of the expert matmuls' inputs
  (``activations: mxfp8``; blocks along the last, contraction axis; straight-through), or None.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax import nnx

from k3jax.config import QuantConfig
from k3jax.layers.initializers import normal
from k3jax.ops.weight_cast import weight_cast
from k3jax.quant.mxfp4 import fake_quantize_mxfp4
from k3jax.quant.mxfp8 import fake_quantize_mxfp8
from k3jax.quant.fp8_block import FP8BlockWeight
from k3jax.quant.int4 import Int4Weight
from k3jax.quant.packed import MXFP4Weight
from k3jax.quant.storage import QuantizedWeight
from k3jax.quant.ste import straight_through
from pallas_kernels.mxfp4 import MXFP4

# Routed-expert weights are (E, in, out): the MX blocks run along `in`, the contraction axis.
_IN_AXIS = -2


def expert_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float, dtype,
                 quant: QuantConfig) -> nnx.Param | QuantizedWeight:
    """A routed-expert weight ``(E, in, out)`` ~ N(0, std): dense, or held compressed for deployment
    (``quant.experts``: ``mxfp4`` packed with ``quant.scale_rule``, ``int4`` with scales in ``dtype``,
    ``fp8_block``; the same random draw, quantized)."""
    dense = normal(rngs, shape, axes, std, dtype)
    if quant.experts not in ("mxfp4", "int4", "fp8_block"):
        return dense
    value = dense.get_raw_value()
    abstract = isinstance(value, jax.ShapeDtypeStruct)
    if quant.experts == "int4":
        if abstract:
            return Int4Weight.abstract(shape, quant.int4_group_size, dtype, axes)
        return Int4Weight.from_dense(value, quant.int4_group_size, dtype, axes)
    if quant.experts == "fp8_block":
        if abstract:
            return FP8BlockWeight.abstract(shape, quant.fp8_block, axes)
        return FP8BlockWeight.from_dense(value, quant.fp8_block, axes)
    if abstract:
        return MXFP4Weight.abstract(shape, axes)
    return MXFP4Weight.from_dense(value, axes, rule=quant.scale_rule)


@functools.lru_cache(maxsize=None)
def _qat_weight(rule: str) -> Callable[[jax.Array], jax.Array]:
    return straight_through(functools.partial(fake_quantize_mxfp4, rule=rule, axis=_IN_AXIS))


@functools.lru_cache(maxsize=None)
def _qat_activation(rule: str) -> Callable[[jax.Array], jax.Array]:
    return straight_through(functools.partial(fake_quantize_mxfp8, rule=rule, axis=-1))


def expert_weight(w: nnx.Variable | QuantizedWeight, dtype, quant: QuantConfig) -> jax.Array:
    """The routed-expert weight ``(E, in, out)`` the expert matmuls use, in ``dtype``: a compressed
    weight (MXFP4, INT4, FP8) dequantized here, right before the grouped matmul."""
    if isinstance(w, QuantizedWeight):
        return w.dequantize(dtype)
    x = w[...]
    if quant.experts == "mxfp4_qat":
        # quantized from the master weight's own precision; MXFP4 values are exact in bfloat16
        x = _qat_weight(quant.scale_rule)(x)
    return weight_cast(x, dtype)


def expert_operand(w: nnx.Variable | QuantizedWeight, dtype, quant: QuantConfig, *,
                   packed_mxfp4: bool) -> jax.Array | MXFP4:
    """What the expert matmuls take for a routed-expert weight ``(E, in, out)``: with ``packed_mxfp4`` an
    MXFP4 weight's release-orientation bytes as they are (``MXFP4(packed [E, out, in/2], scale [E, out,
    in/32])``, decoded tile by tile in the kernel, in the dtype of its input), else :func:`expert_weight`."""
    if packed_mxfp4 and isinstance(w, MXFP4Weight):
        return MXFP4(w.packed[...], w.scale[...])
    return expert_weight(w, dtype, quant)


def activation_quantizer(quant: QuantConfig) -> Callable[[jax.Array], jax.Array] | None:
    """MXFP8 fake quantization (with a straight-through gradient) of an expert matmul's input
    ``[..., in]``, or None when activations are not quantized."""
    if quant.activations == "none":
        return None
    return _qat_activation(quant.activation_scale_rule)


__all__ = ["activation_quantizer", "expert_operand", "expert_param", "expert_weight"]

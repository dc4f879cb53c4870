"""Quantization of the routed experts: MXFP4 weights and MXFP8 activations (K3), INT4 and block FP8 (K2 releases).

- ``formats``: the OCP MX element / scale formats and the scale rules;
- ``mx``: the JAX block quantizer (integer arithmetic on IEEE bits: identical bytes on every backend);
- ``mxfp4`` / ``mxfp8``: the public quantize / dequantize / fake-quantize functions;
- ``ste``: the straight-through estimator used by quantization-aware training;
- ``storage``: what every compressed weight in a model shares (``QuantizedStorage`` variables, never
  trained; the ``QuantizedWeight`` interface the layers' accessors dequantize through);
- ``int4`` / ``fp8_block``: compressed-tensors INT4 (K2 Thinking) and DeepSeek block FP8 (K2) weights
  kept compressed (``quant.experts=int4`` / ``fp8_block``);
- ``packed``: packed MXFP4 weights as model state (deployment). Turning a dense model into a packed
  one is a whole-model transform and lives above the model: ``k3jax.interop.packed_experts``.

What the MoE layer calls (QAT fake quantization, on-the-fly dequantization) is a layer-level module,
``k3jax.layers.quantized_experts``, so that ``k3jax.config`` can take the format facts (``formats``)
from here without pulling in the layers. docs/quantization.md describes the whole picture.
"""

from k3jax.quant.formats import DEFAULT_SCALE_RULE, SCALE_RULES
from k3jax.quant.mxfp4 import dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4
from k3jax.quant.mxfp8 import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8
from k3jax.quant.ste import straight_through

__all__ = ["DEFAULT_SCALE_RULE", "SCALE_RULES", "dequantize_mxfp4", "dequantize_mxfp8", "fake_quantize_mxfp4",
           "fake_quantize_mxfp8", "quantize_mxfp4", "quantize_mxfp8", "straight_through"]

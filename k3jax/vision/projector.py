"""The multimodal projector: merged vision features ``[B, M, m*m, D]`` -> LM embeddings ``[B, M, d]``.

- ``patchmergerv2`` (K3): concat the m*m sub-patches -> Linear(m²D, m²D) -> GELU (erf) ->
  Linear(m²D, d) -> RMSNorm(d, projector_eps). No biases, no pre-norm.
- ``patchmerger`` (K2.5): LayerNorm(D) on each sub-patch -> concat -> Linear + b -> GELU (erf) ->
  Linear + b.

The ViT MLP uses tanh-GELU while both projectors use the exact erf GELU (as the releases do).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import VisionConfig
from k3jax.layers.initializers import cast, constant, normal
from k3jax.vision.moonvit import VisionNorm


class Projector(nnx.Module):
    """in_proj ``[m²D, m²D]``, out_proj ``[m²D, d]``; pre_norm (patchmerger) or post_norm (v2)."""

    def __init__(self, cfg: VisionConfig, text_hidden: int, *, init_std: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.kind, self.dtype = cfg.projector, jnp.dtype(dtype)
        width = cfg.hidden_size * cfg.merge_size * cfg.merge_size
        pd = param_dtype
        self.in_proj = normal(rngs, (width, width), ("vision_mlp", "vision_mlp_out"), init_std, pd)
        self.out_proj = normal(rngs, (width, text_hidden), ("vision_mlp", "embed"), init_std, pd)
        if self.kind == "patchmerger":
            self.pre_norm = VisionNorm(cfg.hidden_size, "layernorm", cfg.projector_eps, param_dtype=pd)
            self.in_bias = constant(0.0, (width,), ("vision_mlp",), pd)
            self.out_bias = constant(0.0, (text_hidden,), ("embed",), pd)
        else:
            self.post_norm = VisionNorm(text_hidden, "rmsnorm", cfg.projector_eps, param_dtype=pd)

    def __call__(self, merged: jax.Array) -> jax.Array:
        """merged ``[B, M, m*m, D]`` -> ``[B, M, d]`` in the compute dtype."""
        dt = self.dtype
        x = merged.astype(dt)
        if self.kind == "patchmerger":
            x = self.pre_norm(x)
        x = x.reshape(x.shape[:-2] + (-1,))  # sub-patch-major concat: [kh, kw, D]
        x = jnp.einsum("bmi,io->bmo", x, cast(self.in_proj, dt))
        if self.kind == "patchmerger":
            x = x + cast(self.in_bias, dt)
        x = jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(dt)
        x = jnp.einsum("bmi,id->bmd", x, cast(self.out_proj, dt))
        if self.kind == "patchmerger":
            return x + cast(self.out_bias, dt)
        return self.post_norm(x)


__all__ = ["Projector"]

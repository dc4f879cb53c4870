"""Dense gated FFN (SiTU-GLU or SwiGLU): layer 0 of K3 and the shared experts."""

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers import lora
from k3jax.layers.initializers import normal
from k3jax.ops.activations import glu
from k3jax.sharding import constrain_activation

# Logical axes of the hidden activations [B, T, F].
HIDDEN_AXES = ("batch", "length", "mlp")


class GatedFFN(nnx.Module):
    """``(act(x @ W_gate, x @ W_up)) @ W_down`` with ``W_gate, W_up: (d, F)``, ``W_down: (F, d)``."""

    def __init__(self, cfg: ModelConfig, hidden: int, *, rngs: nnx.Rngs):
        d, pd, std = cfg.hidden_size, jnp.dtype(cfg.param_dtype), cfg.init_std
        self.activation, self.beta, self.linear_beta = cfg.activation, cfg.situ_beta, cfg.situ_linear_beta
        self.dtype = jnp.dtype(cfg.dtype)
        self.w_gate = normal(rngs, (d, hidden), ("embed", "mlp"), std, pd)
        self.w_up = normal(rngs, (d, hidden), ("embed", "mlp"), std, pd)
        self.w_down = normal(rngs, (hidden, d), ("mlp", "embed"), std, pd)

    def __call__(self, x: jax.Array, *, lora_key: jax.Array | None = None) -> jax.Array:
        """x ``[B, T, d]`` -> ``[B, T, d]``. ``lora_key``: the dropout key of the adapters' inputs (training)."""
        x, dt = x.astype(self.dtype), self.dtype
        gate = constrain_activation(lora.project(self, "w_gate", x, "btd,df->btf", dt, lora_key), HIDDEN_AXES)
        up = constrain_activation(lora.project(self, "w_up", x, "btd,df->btf", dt, lora_key), HIDDEN_AXES)
        h = constrain_activation(glu(gate, up, self.activation, self.beta, self.linear_beta), HIDDEN_AXES)
        return lora.project(self, "w_down", h, "btf,fd->btd", dt, lora_key)

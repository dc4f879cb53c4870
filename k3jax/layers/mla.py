"""Gated multi-head latent attention (SPEC §3): DeepSeek-V2 MLA, optionally NoPE (K3, Kimi Linear)
or RoPE + YaRN (K2), with K3's sigmoid output gate taken from the layer input."""

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.initializers import cast, normal
from k3jax.layers.norm import RMSNorm
from k3jax.ops.attention import attention, attention_mask
from k3jax.ops.rope import apply_rope, rope_frequencies, yarn_softmax_scale


class MLA(nnx.Module):
    """Parameters (H heads, P = nope + rope head dim): ``q_a (d, q_lora)``, ``q_a_norm``,
    ``q_b (q_lora, H, P)`` or ``q_proj (d, H, P)``; ``kv_a (d, kv_lora + rope)``, ``kv_a_norm``,
    ``kv_b (kv_lora, H, nope + v)``; ``g_proj (d, H, v)`` if gated; ``o_proj (H, v, d)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        c, d, pd, std = cfg.mla, cfg.hidden_size, jnp.dtype(cfg.param_dtype), cfg.init_std
        h, p = c.num_heads, c.qk_head_dim
        self.cfg, self.dtype = c, jnp.dtype(cfg.dtype)
        if c.q_lora_rank:
            self.q_a = normal(rngs, (d, c.q_lora_rank), ("embed", "q_lora"), std, pd)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.norm_eps, param_dtype=pd)
            self.q_b = normal(rngs, (c.q_lora_rank, h, p), ("q_lora", "heads", "head_dim"), std, pd)
        else:
            self.q_proj = normal(rngs, (d, h, p), ("embed", "heads", "head_dim"), std, pd)
        self.kv_a = normal(rngs, (d, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", "kv_lora"), std, pd)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.norm_eps, param_dtype=pd)
        self.kv_b = normal(rngs, (c.kv_lora_rank, h, c.qk_nope_head_dim + c.v_head_dim),
                           ("kv_lora", "heads", "head_dim"), std, pd)
        if c.output_gate:
            self.g_proj = normal(rngs, (d, h, c.v_head_dim), ("embed", "heads", "head_dim"), std, pd)
        self.o_proj = normal(rngs, (h, c.v_head_dim, d), ("heads", "head_dim", "embed"), std, pd)

    @property
    def softmax_scale(self) -> float:
        c = self.cfg
        return yarn_softmax_scale(c.qk_head_dim, c.yarn if c.rope == "yarn" else None)

    def __call__(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """x ``[B, T, d]``, positions ``[B, T]`` -> ``[B, T, d]``."""
        c, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        x = x.astype(dt)
        if c.q_lora_rank:
            cq = self.q_a_norm(jnp.einsum("btd,dr->btr", x, cast(self.q_a, dt)))
            q = jnp.einsum("btr,rhp->bthp", cq, cast(self.q_b, dt))
        else:
            q = jnp.einsum("btd,dhp->bthp", x, cast(self.q_proj, dt))
        ckv_rope = jnp.einsum("btd,dr->btr", x, cast(self.kv_a, dt))
        ckv, k_rope = ckv_rope[..., : c.kv_lora_rank], ckv_rope[..., c.kv_lora_rank:]
        ckv = self.kv_a_norm(ckv)
        kv = jnp.einsum("btr,rhp->bthp", ckv, cast(self.kv_b, dt))
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        k_rope = k_rope[:, :, None, :]  # one rope key shared by all heads
        if c.rope != "none":
            inv_freq, factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.yarn if c.rope == "yarn" else None)
            q_rope = apply_rope(q_rope, positions, inv_freq, factor, c.rope_interleave)
            k_rope = apply_rope(k_rope, positions, inv_freq, factor, c.rope_interleave)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + k_rope.shape[-1:])], axis=-1)
        index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mask = attention_mask(index, index, segment_ids, segment_ids)
        o = attention(q, k, v, mask, scale=self.softmax_scale)
        if c.output_gate:
            gate = jnp.einsum("btd,dhv->bthv", x, cast(self.g_proj, dt))
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
        return jnp.einsum("bthv,hvd->btd", o, cast(self.o_proj, dt))

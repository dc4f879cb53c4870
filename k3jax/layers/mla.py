"""Gated multi-head latent attention (SPEC §3): DeepSeek-V2 MLA, optionally NoPE (K3, Kimi Linear)
or RoPE + YaRN (K2), with K3's sigmoid output gate taken from the layer input."""

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import MLACache
from k3jax.config import ModelConfig
from k3jax.layers.initializers import cast, normal
from k3jax.layers.norm import RMSNorm
from k3jax.ops.attention import chunked_attention
from k3jax.ops.rope import apply_rope, rope_frequencies, yarn_softmax_scale
from k3jax.parallel import sequence as seq_parallel


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

    def _query(self, x):
        c, dt = self.cfg, self.dtype
        if c.q_lora_rank:
            cq = self.q_a_norm(jnp.einsum("btd,dr->btr", x, cast(self.q_a, dt)))
            return jnp.einsum("btr,rhp->bthp", cq, cast(self.q_b, dt))
        return jnp.einsum("btd,dhp->bthp", x, cast(self.q_proj, dt))

    def _rope(self, x, positions):
        c = self.cfg
        if c.rope == "none":
            return x
        inv_freq, factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.yarn if c.rope == "yarn" else None)
        return apply_rope(x, positions, inv_freq, factor, c.rope_interleave)

    def _gate_and_project(self, x, o):
        c, dt = self.cfg, self.dtype
        if c.output_gate:
            gate = jnp.einsum("btd,dhv->bthv", x, cast(self.g_proj, dt))
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
        return jnp.einsum("bthv,hvd->btd", o.astype(dt), cast(self.o_proj, dt))

    def __call__(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: MLACache | None = None, cache_index=None, kv_valid: jax.Array | None = None
                 ) -> tuple[jax.Array, MLACache | None]:
        """x ``[B, T, d]``, positions ``[B, T]`` -> (``[B, T, d]``, updated cache or None).

        Without a cache: expanded MLA over the T tokens (training, plain prefill). With a cache: the
        new tokens' latent and rope key are written at slots ``[cache_index, cache_index + T)`` and
        the queries attend over all valid slots (``kv_valid [B, S]``) in the absorbed form.
        """
        c, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        x = x.astype(dt)
        q = self._query(x)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], self._rope(q[..., c.qk_nope_head_dim:], positions)
        ckv_rope = jnp.einsum("btd,dr->btr", x, cast(self.kv_a, dt))
        ckv = self.kv_a_norm(ckv_rope[..., : c.kv_lora_rank])
        k_rope = self._rope(ckv_rope[..., None, c.kv_lora_rank:], positions)  # [B, T, 1, R]: shared by heads
        kv_b = cast(self.kv_b, dt)
        if cache is None:
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            kv_latent = jnp.concatenate([ckv, k_rope[:, :, 0]], axis=-1)  # [B, T, r + R]: 576 wide for K3
            if seq_parallel.sequence_shards(t) > 1:  # time split over `sequence`: shards gather the latent
                o = seq_parallel.mla_attention(self.expanded_attention, q, kv_latent, segment_ids, kv_b)
            else:
                index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
                o = self.expanded_attention(q, kv_latent, index, index, segment_ids, segment_ids, kv_b)
            return self._gate_and_project(x, o), None
        ckv_all = jax.lax.dynamic_update_slice_in_dim(cache.ckv, ckv.astype(cache.ckv.dtype), cache_index, axis=1)
        k_rope_all = jax.lax.dynamic_update_slice_in_dim(cache.k_rope, k_rope[:, :, 0].astype(cache.k_rope.dtype),
                                                         cache_index, axis=1)
        o = self.absorbed_attention(q_nope, q_rope, ckv_all, k_rope_all, kv_b, cache_index, kv_valid)
        return self._gate_and_project(x, o), MLACache(ckv_all, k_rope_all)

    def expanded_attention(self, q, kv_latent, q_index, kv_index, q_segment_ids, kv_segment_ids, kv_b):
        """Training attention: the latent expanded to per-head keys and values.

        q ``[B, T, H, nope + R]``, kv_latent ``[B, S, r + R]`` (normalised ``c_kv`` | ``k_rope``),
        positions ``q_index [B, T]`` / ``kv_index [B, S]`` (causal mask), segment ids ``[B, T]`` /
        ``[B, S]`` or None, kv_b ``[r, H, nope + v]`` -> ``[B, T, H, v]``.
        """
        c = self.cfg
        ckv, k_rope = kv_latent[..., : c.kv_lora_rank], kv_latent[..., None, c.kv_lora_rank:]  # k_rope [B, S, 1, R]
        kv = jnp.einsum("bsr,rhp->bshp", ckv, kv_b)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + k_rope.shape[-1:])], axis=-1)
        # query/key blocks beyond attention.Q_CHUNK / KV_CHUNK tokens: bounded memory for long prompts
        return chunked_attention(q, k, v, q_index, kv_index, q_segment_ids=q_segment_ids,
                                 kv_segment_ids=kv_segment_ids, scale=self.softmax_scale)

    def absorbed_attention(self, q_nope, q_rope, ckv, k_rope, kv_b, cache_index, kv_valid):
        """MQA over the cached latent: ``W_UK`` folded into the query, ``W_UV`` applied after.

        q_nope ``[B, T, H, nope]``, q_rope ``[B, T, H, R]``, ckv ``[B, S, r]``, k_rope ``[B, S, R]``,
        kv_b ``[r, H, nope + v]`` -> ``[B, T, H, v]``.
        """
        c = self.cfg
        b, t = q_nope.shape[:2]
        s = ckv.shape[1]
        w_uk, w_uv = kv_b[..., : c.qk_nope_head_dim], kv_b[..., c.qk_nope_head_dim:]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
        q = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)  # [B, T, H, r + R]
        k = jnp.concatenate([ckv, k_rope.astype(ckv.dtype)], axis=-1)[:, :, None]  # [B, S, 1, r + R]
        q_index = jnp.broadcast_to(cache_index + jnp.arange(t, dtype=jnp.int32), (b, t))
        kv_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        o_lat = chunked_attention(q, k, ckv[:, :, None], q_index, kv_index, kv_valid=kv_valid,
                                  scale=self.softmax_scale)  # [B, T, H, r]
        return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)

"""Gated multi-head latent attention: DeepSeek-V2 MLA, optionally NoPE (K3, Kimi Linear)
or RoPE + YaRN (K2), with K3's sigmoid output gate taken from the layer input."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.cache import MLACache, update_slots
from k3jax.config import ModelConfig
from k3jax.layers import lora
from k3jax.layers.initializers import normal
from k3jax.layers.norm import RMSNorm
from k3jax.ops.attention import KV_CHUNK, Q_CHUNK, attention_mask, chunked_attention, latent_attention
from k3jax.ops.rope import apply_rope, rope_frequencies, yarn_softmax_scale
from k3jax.ops.saved_names import MIXER_OUTPUTS, MIXER_PROJECTIONS
from k3jax.parallel import cache_attention as cache_parallel
from k3jax.parallel import sequence as seq_parallel
from k3jax.sharding import constrain_activation


# The absorbed queries [B, T, H, r + R] against a cache whose rows are not slot-split: as the cache's rows.
CACHE_QUERY_AXES = ("cache_batch", None, None, None)
# Their output [B, T, H, r], as the heads' projections use it.
HEAD_OUTPUT_AXES = ("batch", None, "heads", None)


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

    def _query(self, x, key):
        c, dt = self.cfg, self.dtype
        if c.q_lora_rank:
            cq = self.q_a_norm(lora.project(self, "q_a", x, "btd,dr->btr", dt, key))
            return lora.project(self, "q_b", cq, "btr,rhp->bthp", dt, key)
        return lora.project(self, "q_proj", x, "btd,dhp->bthp", dt, key)

    def _rope(self, x, positions):
        c = self.cfg
        if c.rope == "none":
            return x
        inv_freq, factor = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.yarn if c.rope == "yarn" else None)
        return apply_rope(x, positions, inv_freq, factor, c.rope_interleave)

    def _gate_and_project(self, x, o, key):
        c, dt = self.cfg, self.dtype
        if c.output_gate:
            gate = checkpoint_name(lora.project(self, "g_proj", x, "btd,dhv->bthv", dt, key), MIXER_PROJECTIONS)
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
        return lora.project(self, "o_proj", o.astype(dt), "bthv,hvd->btd", dt, key)

    def __call__(self, x: jax.Array, *, positions: jax.Array, segment_ids: jax.Array | None = None,
                 cache: MLACache | None = None, cache_index=None, cache_layer=None, kv_valid: jax.Array | None = None,
                 max_logits: bool = False, lora_key: jax.Array | None = None) -> tuple[jax.Array, MLACache | None]:
        """x ``[B, T, d]``, positions ``[B, T]`` -> (``[B, T, d]``, updated cache or None).

        Without a cache: MLA over the T tokens with keys and values expanded from the latent one key
        block at a time (training, plain prefill; :meth:`latent_attention`). With a cache: the
        new tokens' latent and rope key are written at slots ``[cache_index, cache_index + T)`` and
        the queries attend over all valid slots (``kv_valid [B, S]``) in the absorbed form. The cache's
        arrays are ``[B, S, ...]``, or a scanned group's stacked ``[L, B, S, ...]`` with ``cache_layer`` this
        layer's index on their leading axis: the T new slots are written into the stack and the attention
        reads the layer's slots from it, so no copy of the layer's cache is made or written back.

        ``max_logits=True`` (no cache; QK-clip) appends a third output: each head's largest
        pre-softmax logit over the batch ``[H]`` float32 (:func:`head_max_logits`). ``lora_key``: the
        dropout key of the adapters' inputs (training).
        """
        c, dt = self.cfg, self.dtype
        b, t, _ = x.shape
        x = x.astype(dt)
        q = self._query(x, lora_key)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], self._rope(q[..., c.qk_nope_head_dim:], positions)
        ckv_rope = lora.project(self, "kv_a", x, "btd,dr->btr", dt, lora_key)
        ckv = self.kv_a_norm(ckv_rope[..., : c.kv_lora_rank])
        k_rope = self._rope(ckv_rope[..., None, c.kv_lora_rank:], positions)  # [B, T, 1, R]: shared by heads
        kv_b = lora.weight(self, "kv_b", dt)  # read as a weight by both attention forms: merged adapter
        if cache is None:
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            kv_latent = jnp.concatenate([ckv, k_rope[:, :, 0]], axis=-1)  # [B, T, r + R]: 576 wide for K3
            index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            if seq_parallel.sequence_shards(t, batch=b) > 1:  # time split over shards: they gather the latent
                o = seq_parallel.mla_attention(self.latent_attention, q, kv_latent, segment_ids, kv_b)
            else:
                o = self.latent_attention(q, kv_latent, index, index, segment_ids, segment_ids, kv_b)
            y = self._gate_and_project(x, checkpoint_name(o, MIXER_OUTPUTS), lora_key)
            if not max_logits:
                return y, None
            # on the whole sequence (GSPMD splits it like any array under a sequence-sharded mesh)
            k, _ = expand_latent(kv_latent, kv_b, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim)
            return y, None, head_max_logits(q, k, index, segment_ids, self.softmax_scale)
        if max_logits:
            raise ValueError("max_logits is measured in the expanded (training) form, without a cache")
        # a slot-split cache is written by the devices that hold the slots (GSPMD would gather it whole)
        write = (cache_parallel.write_slots if cache_parallel.slot_shards(b, cache.ckv.shape[-2]) > 1
                 else update_slots)
        cache = MLACache(write(cache.ckv, ckv, cache_index, cache_layer),
                         write(cache.k_rope, k_rope[:, :, 0], cache_index, cache_layer))
        o = self.absorbed_attention(q_nope, q_rope, cache, kv_b, cache_index, kv_valid, cache_layer)
        return self._gate_and_project(x, o, lora_key), cache

    def latent_attention(self, q, kv_latent, q_index, kv_index, q_segment_ids, kv_segment_ids, kv_b):
        """Training attention: per-head keys and values expanded from the latent one key block at a time
        (``k3jax.ops.attention.latent_attention``), never for the whole sequence.

        q ``[B, T, H, nope + R]``, kv_latent ``[B, S, r + R]`` (normalised ``c_kv`` | ``k_rope``),
        positions ``q_index [B, T]`` / ``kv_index [B, S]`` (causal mask), segment ids ``[B, T]`` /
        ``[B, S]`` or None, kv_b ``[r, H, nope + v]`` -> ``[B, T, H, v]``.
        """
        c = self.cfg
        expand = functools.partial(expand_latent, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim)
        return latent_attention(q, kv_latent, kv_b, q_index, kv_index, expand=expand, scale=self.softmax_scale,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)

    def absorbed_attention(self, q_nope, q_rope, cache: MLACache, kv_b, cache_index, kv_valid, cache_layer=None):
        """MQA over the cached latent: ``W_UK`` folded into the query, ``W_UV`` applied after.

        q_nope ``[B, T, H, nope]``, q_rope ``[B, T, H, R]``, cache ``ckv [B, S, r]`` / ``k_rope [B, S, R]`` (or
        layer ``cache_layer`` of ``[L, B, S, ...]``), kv_b ``[r, H, nope + v]`` -> ``[B, T, H, v]``. The scores
        are ``q_lat . c_kv + q_rope . k_rope``, the two cache arrays read block by block where they lie
        (concatenated, ``[c_kv | k_rope]`` would be a copy of the layer's cache per step). A cache whose
        slots are split over devices runs ``k3jax.parallel.cache_attention`` (split keys or split queries),
        not the GSPMD-partitioned loops.
        """
        c = self.cfg
        b, t = q_nope.shape[:2]
        s = cache.ckv.shape[-2]
        w_uk, w_uv = kv_b[..., : c.qk_nope_head_dim], kv_b[..., c.qk_nope_head_dim:]
        q_lat = jnp.einsum("bthn,rhn->bthr", q_nope, w_uk)
        q = jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)  # [B, T, H, r + R]: small
        kv = (cache.ckv, cache.k_rope)  # the keys' two parts; c_kv is also the values
        q_index = jnp.broadcast_to(cache_index + jnp.arange(t, dtype=jnp.int32), (b, t))
        if cache_parallel.slot_shards(b, s) > 1:
            o_lat = cache_parallel.cache_attention(q, kv, q_index, kv_valid, kv_layer=cache_layer,
                                                   scale=self.softmax_scale)  # [B, T, H, r]
        else:
            kv_index = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            # the queries laid out as the cache's rows, once: left to GSPMD, the serving layout's head-split
            # queries were moved to the rows' devices inside the loop, once per key block
            q = constrain_activation(q, CACHE_QUERY_AXES)
            o_lat = chunked_attention(q, kv, cache.ckv, q_index, kv_index, kv_valid=kv_valid, kv_layer=cache_layer,
                                      scale=self.softmax_scale)  # [B, T, H, r]
            # ... and the output leaves as the rows, so the heads' layout below is not pulled into the loop (its
            # float32 accumulators moved once per key block: 4.7 GB per step for 32 x 1M of full K3)
            o_lat = constrain_activation(o_lat, CACHE_QUERY_AXES)
        # back to the heads' layout before the value up-projection and o_proj (split by head in the serving
        # layout): left to GSPMD, an output split by the cache's rows made it gather o_proj instead (3.75 GB per
        # device and step for 256 rows of full K3)
        o_lat = constrain_activation(o_lat, HEAD_OUTPUT_AXES)
        return jnp.einsum("bthr,rhv->bthv", o_lat, w_uv)


def expand_latent(kv_latent: jax.Array, kv_b: jax.Array, *, kv_lora_rank: int,
                  qk_nope_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """kv_latent ``[B, S, r + R]``, kv_b ``[r, H, nope + v]`` -> per-head keys ``[B, S, H, nope + R]`` (the
    shared rope key copied to every head) and values ``[B, S, H, v]``: 53x the latent's width for K3."""
    ckv, k_rope = kv_latent[..., :kv_lora_rank], kv_latent[..., None, kv_lora_rank:]  # k_rope [B, S, 1, R]
    kv = jnp.einsum("bsr,rhp->bshp", ckv, kv_b)
    k_nope, v = kv[..., :qk_nope_head_dim], kv[..., qk_nope_head_dim:]
    return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + k_rope.shape[-1:])], axis=-1), v


def head_max_logits(q: jax.Array, k: jax.Array, index: jax.Array, segment_ids: jax.Array | None, scale: float,
                    *, q_chunk: int = Q_CHUNK, kv_chunk: int = KV_CHUNK) -> jax.Array:
    """Each head's largest pre-softmax logit ``scale * q.k`` over every (query, key) pair the attention
    lets see each other, over the whole batch: q, k ``[B, T, H, P]``, index ``[B, T]`` positions
    (causal), segment_ids ``[B, T]`` or None -> ``[H]`` float32 (no gradient).

    Kimi K2's QK-clip statistic. It is computed next to the attention from the same q and k (XLA
    shares the key expansion), block by block like ``chunked_attention`` so that no ``[B, H, T, T]``
    scores exist: forward memory ``B·H·q_chunk·kv_chunk``. Costs one more ``q.k`` product per MLA
    layer, and only when QK-clip is on."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, h, _ = q.shape
    cq, ck = min(q_chunk, t), min(kv_chunk, t)
    nq, nk = -(-t // cq), -(-t // ck)
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids

    def blocks(x, n, c, fill):  # [B, T, ...] -> [n, B, c, ...], padded with `fill`
        x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape((b, n, c) + x.shape[2:]), 1, 0)

    # padded queries sit before every key (index -1) and padded keys after every query: never visible
    qs = (blocks(q, nq, cq, 0), blocks(index, nq, cq, -1), blocks(seg, nq, cq, 0))
    ks = (blocks(k, nk, ck, 0), blocks(index, nk, ck, jnp.iinfo(jnp.int32).max), blocks(seg, nk, ck, 0))

    def query_block(qb):
        q_c, qi, qseg = qb

        def key_block(best, kb):
            k_c, ki, kseg = kb
            scores = jnp.einsum("bthd,bshd->bhts", q_c, k_c, preferred_element_type=jnp.float32) * scale
            visible = attention_mask(qi, ki, qseg, kseg)[:, None]  # [B, 1, C, C']
            return jnp.maximum(best, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=(0, 2, 3))), None

        return jax.lax.scan(key_block, jnp.full((h,), -jnp.inf, jnp.float32), ks)[0]

    return jnp.max(jax.lax.map(query_block, qs), axis=0)

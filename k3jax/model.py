"""The K3 decoder: embedding, the layer stack of SPEC §1, Block AttnRes readout, final norm, lm_head.

Layers whose (mixer, FFN) pattern repeats with the layout period (``[KDA, KDA, KDA, MLA]`` for K3)
are stacked into one parameter tree with a leading ``layers`` axis and run with ``jax.lax.scan``,
so compile time does not grow with depth; the few layers outside the repeating run (the dense
layer 0, the final MLA) are ordinary modules. ``model(tokens, ...)`` is the one forward function
training and decoding share.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import ModelCache, init_cache
from k3jax.config import ModelConfig
from k3jax.layers import attn_res
from k3jax.layers.attn_res import AttnResMix
from k3jax.layers.ffn import GatedFFN
from k3jax.layers.initializers import abstract_init, cast, normal
from k3jax.layers.kda import KDA
from k3jax.layers.latent_moe import LatentMoE
from k3jax.layers.mla import MLA
from k3jax.layers.norm import RMSNorm
from k3jax.vision.inputs import VisionInputs
from k3jax.vision.moonvit import MoonViT
from k3jax.vision.projector import Projector
from k3jax.vision.splice import splice_image_features

LayerKind = tuple[str, str]  # (mixer, ffn), e.g. ("kda", "moe")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """Which layers run unrolled and which are stacked and scanned.

    ``prefix`` layers run first, then ``num_groups`` repetitions of ``group_kinds`` starting at layer
    ``group_start``, then the ``suffix`` layers.
    """

    prefix: tuple[int, ...]
    group_start: int
    group_kinds: tuple[LayerKind, ...]
    num_groups: int
    suffix: tuple[int, ...]


def layer_kind(cfg: ModelConfig, i: int) -> LayerKind:
    return (cfg.mixer(i), cfg.ffn(i))


def plan_layers(cfg: ModelConfig) -> LayerPlan:
    """Find the longest periodic run of layers after the dense prefix (period = ``mla_period`` for a
    hybrid layout, 1 for a uniform one) and scan it."""
    n = cfg.num_layers
    if not cfg.scan_layers:
        return LayerPlan(tuple(range(n)), n, (), 0, ())
    period = cfg.mla_period if cfg.layout == "hybrid" or cfg.mla_layers is not None else 1
    kinds = [layer_kind(cfg, i) for i in range(n)]
    best = (0, n)  # (num_groups, start)
    for start in range(cfg.first_dense_layers, min(cfg.first_dense_layers + period, n)):
        pattern = kinds[start:start + period]
        groups = 0
        while start + (groups + 1) * period <= n and kinds[start + groups * period:start + (groups + 1) * period] == pattern:
            groups += 1
        if groups > best[0]:
            best = (groups, start)
    groups, start = best
    if groups < 2:  # nothing worth scanning
        return LayerPlan(tuple(range(n)), n, (), 0, ())
    end = start + groups * period
    return LayerPlan(tuple(range(start)), start, tuple(kinds[start:start + period]), groups, tuple(range(end, n)))


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token within its packed document. segment_ids ``[B, T]`` -> ``[B, T]``."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class DecoderLayer(nnx.Module):
    """Pre-norm mixer + FFN, with either a plain residual or Block AttnRes around each sublayer."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs):
        mixer, ffn = kind
        pd = jnp.dtype(cfg.param_dtype)
        self.kind, self.attn_res = kind, cfg.attn_res
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.mixer = KDA(cfg, rngs=rngs) if mixer == "kda" else MLA(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.ffn = GatedFFN(cfg, cfg.dense_ffn_dim, rngs=rngs) if ffn == "dense" else LatentMoE(cfg, rngs=rngs)
        if cfg.attn_res.enabled:
            self.attn_res_mix = AttnResMix(cfg.hidden_size, cfg.attn_res.eps, param_dtype=pd)
            self.ffn_res_mix = AttnResMix(cfg.hidden_size, cfg.attn_res.eps, param_dtype=pd)

    def _mix(self, h, ctx: "_Context", cache):
        with jax.named_scope(self.kind[0]):  # "kda" / "mla": the part names of k3jax.breakdown
            return self._mix_unscoped(h, ctx, cache)

    def _mix_unscoped(self, h, ctx: "_Context", cache):
        if self.kind[0] == "kda":
            return self.mixer(self.attn_norm(h), segment_ids=ctx.segment_ids, cache=cache,
                              token_valid=ctx.token_valid)
        return self.mixer(self.attn_norm(h), positions=ctx.positions, segment_ids=ctx.segment_ids, cache=cache,
                          cache_index=ctx.cache_index, kv_valid=ctx.kv_valid)

    def _ffn(self, h, ctx: "_Context"):
        if self.kind[1] == "dense":
            with jax.named_scope("dense_ffn"):
                return self.ffn(self.ffn_norm(h)), None
        return self.ffn(self.ffn_norm(h), token_mask=ctx.token_valid)

    def __call__(self, carry, layer_idx, ctx: "_Context", cache=None):
        """carry: the residual stream ``[B, T, d]``, or an AttnResState when AttnRes is on.
        Returns (carry, router statistics or None, updated layer cache or None)."""
        if not self.attn_res.enabled:
            y, cache = self._mix(carry, ctx, cache)
            h = carry + y.astype(carry.dtype)
            y, stats = self._ffn(h, ctx)
            return h + y.astype(h.dtype), stats, cache
        with jax.named_scope("attn_res"):
            h = self.attn_res_mix(carry)
            state = attn_res.close_block(carry, layer_idx % self.attn_res.block_size == 0)
        y, cache = self._mix(h, ctx, cache)
        with jax.named_scope("attn_res"):
            state = attn_res.add(state, y)
            h = self.ffn_res_mix(state)
        y, stats = self._ffn(h, ctx)
        with jax.named_scope("attn_res"):
            return attn_res.add(state, y), stats, cache


class LayerGroup(nnx.Module):
    """One period of the repeating layout, e.g. ``[KDA, KDA, KDA, MLA]``; stacked for the scan."""

    def __init__(self, cfg: ModelConfig, kinds: tuple[LayerKind, ...], *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, kind, rngs=rngs) for kind in kinds])
        self.remat = cfg.remat

    def __call__(self, carry, first_layer, ctx, caches=None):
        stats, new_caches = [], []
        for j, layer in enumerate(self.layers):
            carry, st, c = call_layer(layer, self.remat, carry, first_layer + j, ctx,
                                      None if caches is None else caches[j])
            stats.append(st)
            new_caches.append(c)
        return carry, (tuple(stats), tuple(new_caches))


def call_layer(layer: DecoderLayer, remat: str, carry, layer_idx, ctx: "_Context", cache):
    """``layer(carry, layer_idx, ctx, cache)``, rematerialised per layer when ``remat`` is on.

    With ``full`` the scan saves every layer's input (the residual stream with its AttnRes bank) and
    the backward pass runs each layer's forward once more: 8N FLOPs per token instead of 6N. With
    ``nested`` (and ``dots``) this nests in a checkpoint of the whole scanned group: the scan saves one
    input per group, and the group's backward pass recomputes its layers' inputs first (one more
    forward, 10N, for a group's worth of saved inputs less: K3 at 1024 tokens per device saves
    ~9 GiB less). The unrolled prefix / suffix layers are checkpointed per layer in every mode.
    """
    if remat == "none":
        return layer(carry, layer_idx, ctx, cache)
    graphdef, state = nnx.split(layer)

    def run(state, carry, layer_idx, ctx, cache):
        return nnx.merge(graphdef, state)(carry, layer_idx, ctx, cache)

    return jax.checkpoint(run, policy=_REMAT_POLICIES[remat])(state, carry, layer_idx, ctx, cache)


class _Context(NamedTuple):
    """Per-call inputs every layer sees (everything but the residual stream and the cache)."""

    positions: jax.Array  # [B, T]
    segment_ids: jax.Array | None  # [B, T]
    token_valid: jax.Array | None  # [B, T] False = padding
    cache_index: jax.Array | None  # [] first cache slot written by this call
    kv_valid: jax.Array | None  # [B, S] valid cache slots after this call


def _stack(modules: list[nnx.Module]) -> nnx.Module:
    """Stack identical modules into the first one: every leaf gets a leading ``layers`` axis (and
    its logical axis names get ``layers`` prepended), ready for ``jax.lax.scan``."""
    per_module = [[v for _, v in nnx.iter_graph(m) if isinstance(v, nnx.Variable)] for m in modules]
    for same in zip(*per_module):
        head = same[0]
        values = [v.get_raw_value() for v in same]
        if isinstance(values[0], jax.ShapeDtypeStruct):
            stacked = jax.ShapeDtypeStruct((len(values),) + values[0].shape, values[0].dtype)
        else:
            stacked = jnp.stack(values)
        head.set_raw_value(stacked)
        if head.has_metadata("out_sharding"):
            head.set_metadata(out_sharding=("layers",) + tuple(head.get_metadata()["out_sharding"]))
    return modules[0]


_REMAT_POLICIES = {
    "full": None,  # save nothing inside a layer; recompute it in the backward pass
    "nested": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
# Remat modes that also checkpoint a whole scanned group: the scan then saves one input per group
# instead of one per layer, and the backward pass runs the group's forward once more to rebuild them.
_GROUP_REMAT = ("nested", "dots")


class K3Model(nnx.Module):
    """Parameters: ``embed (V, d)``, the layers, ``final_res_mix`` (AttnRes readout), ``final_norm``,
    ``lm_head (d, V)`` (absent when ``tie_embeddings``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.plan = plan = plan_layers(cfg)
        pd = jnp.dtype(cfg.param_dtype)
        self.embed = normal(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg.init_std, pd)
        self.prefix = nnx.List([DecoderLayer(cfg, layer_kind(cfg, i), rngs=rngs) for i in plan.prefix])
        self.groups = _stack([LayerGroup(cfg, plan.group_kinds, rngs=rngs) for _ in range(plan.num_groups)]) \
            if plan.num_groups else None
        self.suffix = nnx.List([DecoderLayer(cfg, layer_kind(cfg, i), rngs=rngs) for i in plan.suffix])
        if cfg.attn_res.enabled:
            self.final_res_mix = AttnResMix(cfg.hidden_size, cfg.attn_res.eps, param_dtype=pd)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        if not cfg.tie_embeddings:
            self.lm_head = normal(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pd)
        if cfg.vision.enabled:  # after the LM's parameters: a text model's init stays the same
            self.vision_tower = MoonViT(cfg.vision, init_std=cfg.init_std, dtype=cfg.dtype, param_dtype=pd, rngs=rngs)
            self.mm_projector = Projector(cfg.vision, cfg.hidden_size, init_std=cfg.init_std, dtype=cfg.dtype,
                                          param_dtype=pd, rngs=rngs)

    def encode_images(self, images: VisionInputs) -> jax.Array:
        """Packed images (``k3jax.vision.inputs.pack_images``) -> LM-width features ``[B, M, d]``."""
        if not self.cfg.vision.enabled:
            raise ValueError("this model has no vision tower (model.vision.enabled is false)")
        return self.mm_projector(self.vision_tower(images))

    def _run_groups(self, carry, ctx: _Context, caches):
        plan, cfg = self.plan, self.cfg
        graphdef, stacked = nnx.split(self.groups)
        period = len(plan.group_kinds)
        starts = plan.group_start + period * jnp.arange(plan.num_groups, dtype=jnp.int32)

        def body(carry, xs):
            state, first_layer, group_caches = xs
            return nnx.merge(graphdef, state)(carry, first_layer, ctx, group_caches)

        if cfg.remat in _GROUP_REMAT:
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        return jax.lax.scan(body, carry, (stacked, starts, caches))

    def init_cache(self, batch_size: int, max_len: int) -> ModelCache:
        """An empty decoding cache (layout and sizes: ``k3jax.cache``)."""
        return init_cache(self.cfg, self.plan, batch_size, max_len)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, cache: ModelCache | None = None,
                 token_valid: jax.Array | None = None,
                 images: VisionInputs | jax.Array | None = None) -> tuple[jax.Array, ModelCache | None]:
        """tokens ``[B, T]`` int -> (logits ``[B, T, V]`` float32, updated cache or None).

        Training / full forward (``cache=None``): ``segment_ids [B, T]`` marks packed documents,
        which never see each other (KDA state, conv window and MLA are all reset at document
        starts); id 0 marks padding. ``positions`` default to the position within each document.

        Prefill / decode (``cache=model.init_cache(B, S)``): the tokens continue the cached
        sequences (any T: a whole prompt, a chunk of one, or one token); ``token_valid [B, T]``
        marks left padding of ragged prompts. Returns the cache holding the new tokens.

        ``images`` (vision models): packed pixel patches (``VisionInputs``, one batch row per token
        row) or their projected features ``[B, M, d]``; row b's j-th ``<|media_pad|>`` token is
        replaced by its j-th image token. Without images the text path is unchanged.
        """
        logits, cache, _ = self.forward(tokens, segment_ids=segment_ids, positions=positions, cache=cache,
                                        token_valid=token_valid, images=images)
        return logits, cache

    def forward(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                positions: jax.Array | None = None, cache: ModelCache | None = None,
                token_valid: jax.Array | None = None,
                images: VisionInputs | jax.Array | None = None) -> tuple[jax.Array, ModelCache | None, dict]:
        """Like ``__call__``, plus the Quantile Balancing statistics of every MoE layer, keyed by the
        path of that layer's ``router_bias`` in the model (see ``quantile_balancing.apply``)."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        b, t = tokens.shape
        for name, arr in (("segment_ids", segment_ids), ("positions", positions), ("token_valid", token_valid)):
            if arr is not None and arr.shape != tokens.shape:
                raise ValueError(f"{name} shape {arr.shape} != tokens shape {tokens.shape}")
        if cache is None:
            if positions is None:
                positions = (segment_positions(segment_ids) if segment_ids is not None
                             else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape))
            if token_valid is None and segment_ids is not None:
                token_valid = segment_ids != 0
            ctx = _Context(positions, segment_ids, token_valid, None, None)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids (document packing) is for training; with a cache mark left "
                                 "padding with token_valid")
            if cache.valid.shape[0] != b:
                raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {b}")
            valid = jnp.ones((b, t), bool) if token_valid is None else token_valid.astype(bool)
            if positions is None:
                positions = jnp.maximum(cache.positions[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
            kv_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.length, axis=1)
            ctx = _Context(positions, None, valid, cache.length, kv_valid)
        layer_caches = cache if cache is not None else ModelCache(
            (None,) * len(self.plan.prefix), None, (None,) * len(self.plan.suffix), None, None, None)
        stats, new_prefix, new_suffix = {}, [], []
        with jax.named_scope("embedding"):
            x = jnp.take(cast(self.embed, dt), tokens, axis=0)
        if images is not None:
            with jax.named_scope("vision"):
                features = self.encode_images(images) if isinstance(images, VisionInputs) else images
            x = splice_image_features(x, tokens, features, cfg.vision.media_pad_id)
        carry = attn_res.init_state(x, cfg.num_attn_res_sources - 1) if cfg.attn_res.enabled else x
        for j, (layer, i) in enumerate(zip(self.prefix, self.plan.prefix)):
            carry, stats[("prefix", j, "ffn", "router_bias")], c = call_layer(layer, cfg.remat, carry, i, ctx,
                                                                              layer_caches.prefix[j])
            new_prefix.append(c)
        new_groups = None
        if self.groups is not None:
            carry, (group_stats, new_groups) = self._run_groups(carry, ctx, layer_caches.groups)
            for j, st in enumerate(group_stats):
                stats[("groups", "layers", j, "ffn", "router_bias")] = st
        for j, (layer, i) in enumerate(zip(self.suffix, self.plan.suffix)):
            carry, stats[("suffix", j, "ffn", "router_bias")], c = call_layer(layer, cfg.remat, carry, i, ctx,
                                                                              layer_caches.suffix[j])
            new_suffix.append(c)
        with jax.named_scope("attn_res"):
            h = self.final_res_mix(carry) if cfg.attn_res.enabled else carry
        with jax.named_scope("lm_head_loss"):
            h = self.final_norm(h)
            head = cast(self.embed, dt).T if cfg.tie_embeddings else cast(self.lm_head, dt)
            logits = jnp.einsum("btd,dv->btv", h.astype(dt), head, preferred_element_type=jnp.float32)
        new_cache = None
        if cache is not None:
            new_cache = ModelCache(tuple(new_prefix), tuple(new_groups) if new_groups is not None else (),
                                   tuple(new_suffix), cache.length + t,
                                   cache.positions + jnp.sum(ctx.token_valid, axis=1, dtype=jnp.int32), ctx.kv_valid)
        return logits, new_cache, {k: v for k, v in stats.items() if v is not None}


def _no_eager_sharding():
    # Params carry logical axis names; they are resolved to a mesh only by the sharding code.
    return nnx.use_eager_sharding(False)


def create_model(cfg: ModelConfig, *, seed: int = 0) -> K3Model:
    """A randomly initialised model on the default device (initialised under one jit: eager
    initialisation would compile one tiny program per parameter shape)."""
    with _no_eager_sharding():
        return K3Model(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> K3Model:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes, nothing allocated."""
    with _no_eager_sharding(), abstract_init():
        return K3Model(cfg, rngs=nnx.Rngs(0))


__all__ = ["K3Model", "LayerPlan", "abstract_model", "create_model", "plan_layers", "segment_positions"]

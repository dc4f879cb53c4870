"""The K3 decoder: embedding, the layer stack (README "The architecture"), Block AttnRes readout,
final norm, lm_head.

Layers whose (mixer, FFN) pattern repeats with the layout period are stacked into one parameter tree
with a leading ``layers`` axis and run with ``jax.lax.scan``, so compile time does not grow with
depth; the few layers outside the repeating run (the dense layer 0, the final MLA) are ordinary
modules (``k3jax.layer_plan`` decides which, and maps layer indices to places in the model).
``model(tokens, ...)`` is the one forward function training and decoding share.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.cache import ModelCache, init_cache
from k3jax.config import LoRAConfig, ModelConfig
from k3jax.layer_plan import LayerKind, LayerPlan, layer_kind, plan_layers
from k3jax.layers import lora
from k3jax.ops import saved_names
from k3jax.layers.attn_res import AttnResMix, ResidualStream
from k3jax.layers.ffn import GatedFFN
from k3jax.layers.initializers import abstract_init, cast, normal
from k3jax.layers.kda import KDA
from k3jax.layers.latent_moe import LatentMoE
from k3jax.layers.mla import MLA
from k3jax.layers.norm import RMSNorm
from k3jax.sharding import constrain_activation
from k3jax.vision.inputs import VisionInputs
from k3jax.vision.moonvit import MoonViT
from k3jax.vision.projector import Projector
from k3jax.vision.splice import splice_image_features


def check_cache_room(cache: ModelCache, t: int) -> None:
    """T new tokens must fit the cache's slots (``init_cache``'s ``max_len``): the slot writes would otherwise
    clamp and overwrite the last entries. The cache position is checked when it is concrete (eager calls)."""
    slots = cache.valid.shape[1]
    if t > slots:
        raise ValueError(f"{t} new tokens do not fit a cache of {slots} slots (init_cache max_len)")
    if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) + t > slots:
        raise ValueError(f"{int(cache.length)} cached + {t} new tokens exceed the cache's {slots} slots "
                         "(init_cache max_len)")


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token within its packed document. segment_ids ``[B, T]`` -> ``[B, T]``."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class LayerStats(NamedTuple):
    """What one layer's forward pass measures for the train step (None where it does not apply)."""

    router: object  # Quantile Balancing statistics of an MoE layer (quantile_balancing.router_statistics)
    max_logits: jax.Array | None  # [H] float32, an MLA layer's largest pre-softmax logit per head (QK-clip)
    experts: jax.Array | None = None  # [B, T, k] int32, an MoE layer's selected experts (record_routes)


class ForwardStats(NamedTuple):
    """Statistics of one ``model.forward``, keyed by model layer index (ascending)."""

    router: dict  # {layer: Quantile Balancing statistics} of every MoE layer with a router bias
    max_logits: dict  # {layer: [H] float32} of every MLA layer, when asked for (``max_logits=True``)
    # [B, T, M, k] int32: each token's selected experts in every MoE layer (M of them, in the order of
    # ``moe_layers``), when asked for (``record_routes=True``): what routing replay feeds back
    routes: jax.Array | None = None


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The model's MoE layers in ascending order: the layers of the ``M`` axis of recorded and replayed
    routes (``ForwardStats.routes``, ``forward(replay_routes=...)``)."""
    return [i for i in range(cfg.num_layers) if cfg.ffn(i) == "moe"]


def _route_slots(cfg: ModelConfig) -> np.ndarray:
    """``[num_layers]`` int32: each layer's index on the routes' ``M`` axis (-1: not an MoE layer)."""
    slots = np.full(cfg.num_layers, -1, np.int32)
    slots[moe_layers(cfg)] = np.arange(len(moe_layers(cfg)), dtype=np.int32)
    return slots


# Logical axes of the residual stream [B, T, d] between sublayers (k3jax.sharding.constrain_activation): rows
# over the data-like axes, tokens over `sequence`, the hidden width whole. Left to GSPMD, K3's backward on
# v5p-1024 took another split of the rows and gathered whole-batch activations to switch (docs/scale.md).
RESIDUAL_AXES = ("batch", "length", None)


class DecoderLayer(nnx.Module):
    """Pre-norm mixer + FFN, with either a plain residual or Block AttnRes around each sublayer."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind, *, rngs: nnx.Rngs):
        mixer, ffn = kind
        pd = jnp.dtype(cfg.param_dtype)
        self.kind, self.residual = kind, ResidualStream.of(cfg)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.mixer = KDA(cfg, rngs=rngs) if mixer == "kda" else MLA(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, param_dtype=pd)
        self.ffn = GatedFFN(cfg, cfg.dense_ffn_dim, rngs=rngs) if ffn == "dense" else LatentMoE(cfg, rngs=rngs)
        if cfg.attn_res.enabled:
            self.attn_res_mix = AttnResMix(cfg.hidden_size, cfg.attn_res.eps, param_dtype=pd)
            self.ffn_res_mix = AttnResMix(cfg.hidden_size, cfg.attn_res.eps, param_dtype=pd)

    def _mix(self, h, ctx: "_Context", cache, cache_layer, lora_key):
        """-> (y ``[B, T, d]``, updated cache or None, max logit per head ``[H]`` or None)."""
        with jax.named_scope(self.kind[0]):  # "kda" / "mla": the part names of k3jax.aot.breakdown
            y, cache, max_logits = self._mix_unscoped(constrain_activation(h, RESIDUAL_AXES), ctx, cache, cache_layer,
                                                      lora_key)
            y = checkpoint_name(y, saved_names.MIXER_PROJECTED)  # kept by remat=outputs
            return constrain_activation(y, RESIDUAL_AXES), cache, max_logits

    def _mix_unscoped(self, h, ctx: "_Context", cache, cache_layer, lora_key):
        if self.kind[0] == "kda":
            # a KDA cache is small (a state and conv tails, no slots): its layer is read and written whole
            stack = cache
            if cache_layer is not None:
                cache = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, cache_layer, 0, keepdims=False), stack)
            y, cache = self.mixer(self.attn_norm(h), segment_ids=ctx.segment_ids, cache=cache,
                                  token_valid=ctx.token_valid, lora_key=lora_key)
            if cache_layer is not None:
                cache = jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x, cache_layer, 0), stack,
                                     cache)
            return y, cache, None
        out = self.mixer(self.attn_norm(h), positions=ctx.positions, segment_ids=ctx.segment_ids, cache=cache,
                         cache_index=ctx.cache_index, cache_layer=cache_layer, kv_valid=ctx.kv_valid,
                         max_logits=ctx.max_logits, lora_key=lora_key)
        return out if ctx.max_logits else (*out, None)

    def _ffn(self, h, ctx: "_Context", layer_idx, lora_key):
        """-> (y ``[B, T, d]``, Quantile Balancing statistics or None, selected experts ``[B, T, k]`` or None)."""
        h = self.ffn_norm(constrain_activation(h, RESIDUAL_AXES))
        if self.kind[1] == "dense":
            with jax.named_scope("dense_ffn"):
                return constrain_activation(self.ffn(h, lora_key=lora_key), RESIDUAL_AXES), None, None
        replay = None
        if ctx.replay_routes is not None:  # this layer's slice of the [B, T, M, k] routes
            slot = jnp.asarray(ctx.route_slots)[layer_idx]
            replay = jax.lax.dynamic_index_in_dim(ctx.replay_routes, slot, axis=2, keepdims=False)
        y, router, experts = self.ffn(h, token_mask=ctx.token_valid, lora_key=lora_key, replay=replay)
        return constrain_activation(y, RESIDUAL_AXES), router, experts if ctx.record_routes else None

    def lora_modules(self) -> list[tuple[nnx.Module, str]]:
        """The modules whose projections may get adapters, with their kind (a key of ``LORA_SITES``)."""
        out = [(self.mixer, self.kind[0])]
        if self.kind[1] == "dense":
            out.append((self.ffn, "ffn"))
        elif self.ffn.shared is not None:
            out.append((self.ffn.shared, "shared"))
        return out

    def __call__(self, carry, layer_idx, ctx: "_Context", cache=None, cache_layer=None):
        """carry: the residual stream ``[B, T, d]``, or an AttnResState when AttnRes is on (the protocol:
        ``ResidualStream``); layer_idx: this layer's index (an int, traced inside the scan); cache: this
        layer's cache, or (``cache_layer``, traced) a scanned group's stacked caches of its slot, whose
        entry ``cache_layer`` on the leading axis is this layer's. Returns (carry, LayerStats, updated cache
        or None: the stack, when given one)."""
        # adapters' dropout: one key per layer (and per weight, lora.site_key)
        lora_key = None if ctx.lora_key is None else jax.random.fold_in(ctx.lora_key, layer_idx)
        mixes = (self.attn_res_mix, self.ffn_res_mix) if self.residual.attn_res else (None, None)
        h, carry = self.residual.mixer_input(carry, layer_idx, mixes[0])
        y, cache, max_logits = self._mix(h, ctx, cache, cache_layer, lora_key)
        h, carry = self.residual.ffn_input(carry, y, mixes[1])
        y, router, experts = self._ffn(h, ctx, layer_idx, lora_key)
        return self.residual.layer_output(carry, y), LayerStats(router, max_logits, experts), cache


class LayerGroup(nnx.Module):
    """One period of the repeating layout, e.g. ``[KDA, KDA, MLA, KDA]``; stacked for the scan."""

    def __init__(self, cfg: ModelConfig, kinds: tuple[LayerKind, ...], *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, kind, rngs=rngs) for kind in kinds])
        self.remat, self.residual = cfg.remat, ResidualStream.of(cfg)

    def __call__(self, carry, first_layer, ctx, caches=None, group=None):
        """caches: one stacked cache per layer of the group (``[num_groups, ...]`` leaves), of which this is
        group ``group`` (traced); each layer reads and writes its entry in place. Returns (carry, (stats,
        the updated stacked caches))."""
        stats, new_caches = [], []
        for j, layer in enumerate(self.layers):
            carry, st, c = call_layer(layer, self.remat, carry, first_layer + j, ctx,
                                      None if caches is None else caches[j], group)
            carry = self.residual.after_group_layer(carry, j, len(self.layers))
            stats.append(st)
            new_caches.append(c)
        return carry, (tuple(stats), tuple(new_caches))


def call_layer(layer: DecoderLayer, remat: str, carry, layer_idx, ctx: "_Context", cache, cache_layer=None):
    """``layer(carry, layer_idx, ctx, cache, cache_layer)``, rematerialised per layer when ``remat`` is on.

    With ``full`` the scan saves every layer's input (the residual stream; the AttnRes bank, which the
    layers of a group share, once per group) and the backward pass runs each layer's forward once
    more: 8N FLOPs per token instead of 6N. With ``nested`` (and ``dots``) this nests in a checkpoint
    of the whole scanned group: the scan saves one input per group, and the group's backward pass
    recomputes its layers' inputs first (one more forward, 10N, for a group's worth of saved inputs
    less). The unrolled prefix / suffix layers are checkpointed per layer in every mode.
    """
    if remat == "none":
        return layer(carry, layer_idx, ctx, cache, cache_layer)
    graphdef, state = nnx.split(layer)

    def run(state, carry, layer_idx, ctx, cache, cache_layer):
        out, stats, cache = nnx.merge(graphdef, state)(carry, layer_idx, ctx, cache, cache_layer)
        return layer.residual.without_bank(out, carry), stats, cache  # the AttnRes bank goes in, not out

    out, stats, cache = jax.checkpoint(run, policy=_REMAT_POLICIES[remat])(state, carry, layer_idx, ctx, cache,
                                                                           cache_layer)
    return layer.residual.with_bank(out, carry), stats, cache


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "segment_ids", "token_valid", "cache_index", "kv_valid", "lora_key",
                                "replay_routes", "route_slots"],
                   meta_fields=["max_logits", "record_routes"])
@dataclasses.dataclass(frozen=True)
class _Context:
    """Per-call inputs every layer sees (everything but the residual stream and the cache)."""

    positions: jax.Array  # [B, T]
    segment_ids: jax.Array | None  # [B, T]
    token_valid: jax.Array | None  # [B, T] False = padding
    cache_index: jax.Array | None  # [] first cache slot written by this call
    kv_valid: jax.Array | None  # [B, S] valid cache slots after this call
    max_logits: bool = False  # static: MLA layers also return their max logit per head (QK-clip)
    lora_key: jax.Array | None = None  # dropout key of the LoRA adapters' inputs (training); None: no dropout
    replay_routes: jax.Array | None = None  # [B, T, M, k] int32 experts to use instead of the top-k (replay)
    route_slots: np.ndarray | None = None  # [num_layers] int32: each layer's index on the routes' M axis
    record_routes: bool = False  # static: MoE layers return their selected experts (LayerStats.experts)


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
    # full, but keeping the values of k3jax.ops.saved_names: no expert matmul, attention or KDA pass
    # runs twice
    "selective": jax.checkpoint_policies.save_only_these_names(*saved_names.SELECTIVE),
    # full, but keeping each sublayer's small outputs (k3jax.ops.saved_names.SUBLAYER_OUTPUTS): no output
    # projection, routed down projection or expert return exchange runs twice
    "outputs": jax.checkpoint_policies.save_only_these_names(*saved_names.SUBLAYER_OUTPUTS),
    # outputs, plus MLA's attention residuals kept on the device and the mixers' projections of the layer
    # input in host memory (saved_names.HOST_SAVED): no attention forward, no KDA q, k, v or gate projection
    # and no MLA gate projection runs twice
    "outputs_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved_names.OUTPUTS_AND_ATTENTION, names_which_can_be_offloaded=saved_names.HOST_SAVED,
        offload_src="device", offload_dst="pinned_host"),
}
# Remat modes that also checkpoint a whole scanned group: the scan then saves one input per group
# instead of one per layer, and the backward pass runs the group's forward once more to rebuild them.
_GROUP_REMAT = ("nested", "dots")


class K3Model(nnx.Module):
    """Parameters: ``embed (V, d)``, the layers, ``final_res_mix`` (AttnRes readout), ``final_norm``,
    ``lm_head (d, V)`` (absent when ``tie_embeddings``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.lora_config: LoRAConfig | None = None  # set by add_lora
        self.plan = plan = plan_layers(cfg)
        self.residual = ResidualStream.of(cfg)  # plain or Block AttnRes: what each layer reads and writes
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

    def _run_unrolled(self, layers, indices, carry, ctx: _Context, caches, stats: dict):
        """The prefix or suffix layers (model layers ``indices``), one after another; each one's LayerStats
        goes into ``stats``. Returns (carry, their updated caches)."""
        new_caches = []
        for layer, i, cache in zip(layers, indices, caches):
            carry, stats[i], c = call_layer(layer, self.cfg.remat, carry, i, ctx, cache)
            carry = self.residual.after_unrolled_layer(carry, i)
            new_caches.append(c)
        return carry, new_caches

    def _run_groups(self, carry, ctx: _Context, caches):
        plan, cfg = self.plan, self.cfg
        graphdef, stacked = nnx.split(self.groups)
        starts = plan.layer_at(jnp.arange(plan.num_groups, dtype=jnp.int32), 0)  # each group's first layer

        remat = (lambda f: jax.checkpoint(f, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
                 if cfg.remat in _GROUP_REMAT else f)

        if caches is None:
            @remat
            def body(carry, xs):
                state, first_layer = xs
                return nnx.merge(graphdef, state)(carry, first_layer, ctx, None)

            return jax.lax.scan(body, carry, (stacked, starts))

        # The stacked caches ride in the scan's carry, aliasing the donated input (as scan xs -> ys, XLA
        # gave the ys a second buffer of the whole stacked cache: 22 GiB per device for K3's MLA caches at
        # 1M tokens). Group g's layers get the whole stacks and g: an MLA layer writes its new slots into
        # the stack and reads its slots from it in place (reading its slice out and writing it back copied
        # the layer's cache twice per step).
        @remat
        def body(c, xs):
            carry, caches, g = c
            state, first_layer = xs
            carry, (stats, caches) = nnx.merge(graphdef, state)(carry, first_layer, ctx, caches, g)
            return (carry, caches, g + 1), stats

        (carry, caches, _), stats = jax.lax.scan(body, (carry, caches, jnp.zeros((), jnp.int32)), (stacked, starts))
        return carry, (stats, caches)

    def init_cache(self, batch_size: int, max_len: int) -> ModelCache:
        """An empty decoding cache (layout and sizes: ``k3jax.cache``)."""
        return init_cache(self.cfg, self.plan, batch_size, max_len)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, cache: ModelCache | None = None,
                 token_valid: jax.Array | None = None,
                 images: VisionInputs | jax.Array | None = None) -> tuple[jax.Array, ModelCache | None]:
        """tokens ``[B, T]`` int ids in ``[0, V)`` -> (logits ``[B, T, V]`` float32, updated cache or None).
        An id outside raises when the ids are concrete and gives NaN logits at its position under ``jit``
        (:func:`check_token_ids`).

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
                token_valid: jax.Array | None = None, images: VisionInputs | jax.Array | None = None,
                max_logits: bool = False, lora_key: jax.Array | None = None, record_routes: bool = False,
                replay_routes: jax.Array | None = None) -> tuple[jax.Array, ModelCache | None, ForwardStats]:
        """Like ``__call__``, plus the statistics the train step uses (``ForwardStats``, keyed by layer
        index): the Quantile Balancing statistics of every MoE layer (``quantile_balancing.apply``)
        and, with ``max_logits=True`` (QK-clip, training only), every MLA layer's largest
        pre-softmax logit per head over the batch. ``lora_key`` (a LoRA train step with
        ``train.lora.dropout > 0``): the key the adapters' input dropout draws from.

        Routing replay (MoE; reinforcement learning, ``k3jax.rl``): ``record_routes=True`` returns every token's
        selected experts in every MoE layer (``ForwardStats.routes`` ``[B, T, M, k]``, M = ``moe_layers``);
        ``replay_routes`` (that shape) makes each MoE layer use those experts instead of its top-k, the
        combine weights still from this forward's router scores."""
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        chex.assert_type(tokens, int)  # before check_token_ids compares float "ids" with the vocabulary
        b, t = tokens.shape
        for name, arr in (("segment_ids", segment_ids), ("positions", positions), ("token_valid", token_valid)):
            if arr is not None and arr.shape != tokens.shape:
                raise ValueError(f"{name} shape {arr.shape} != tokens shape {tokens.shape}")
        if max_logits and cache is not None:
            raise ValueError("max_logits is a training statistic (expanded attention); it is not measured "
                             "with a cache")
        in_vocab = check_token_ids(tokens, cfg.vocab_size)
        slots = _route_slots(cfg)
        if replay_routes is not None:
            chex.assert_shape(replay_routes, (b, t, len(moe_layers(cfg)), cfg.moe.top_k))
            replay_routes = replay_routes.astype(jnp.int32)
        routing = dict(replay_routes=replay_routes, route_slots=slots if replay_routes is not None else None,
                       record_routes=record_routes)
        if cache is None:
            if positions is None:
                positions = (segment_positions(segment_ids) if segment_ids is not None
                             else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape))
            if token_valid is None and segment_ids is not None:
                token_valid = segment_ids != 0
            ctx = _Context(positions, segment_ids, token_valid, None, None, max_logits, lora_key, **routing)
        else:
            if segment_ids is not None:
                raise ValueError("segment_ids (document packing) is for training; with a cache mark left "
                                 "padding with token_valid")
            if cache.valid.shape[0] != b:
                raise ValueError(f"cache batch {cache.valid.shape[0]} != tokens batch {b}")
            check_cache_room(cache, t)
            valid = jnp.ones((b, t), bool) if token_valid is None else token_valid.astype(bool)
            if positions is None:
                positions = jnp.maximum(cache.positions[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
            kv_valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, valid, cache.length, axis=1)
            ctx = _Context(positions, None, valid, cache.length, kv_valid, lora_key=lora_key, **routing)
        plan = self.plan
        layer_caches = cache if cache is not None else ModelCache(
            (None,) * len(plan.prefix), None, (None,) * len(plan.suffix), None, None, None)
        stats = {}  # {layer: LayerStats}
        with jax.named_scope("embedding"):
            # out-of-vocabulary ids (only possible under a trace) read row 0 or V-1, never NaN
            x = jnp.take(cast(self.embed, dt), tokens, axis=0, mode="clip")
        if images is not None:
            with jax.named_scope("vision"):
                features = self.encode_images(images) if isinstance(images, VisionInputs) else images
            chex.assert_shape(features, (b, None, cfg.hidden_size))  # [B, M, d]: one feature row per image token
            x = splice_image_features(x, tokens, features, cfg.vision.media_pad_id)
        residual = self.residual
        carry = residual.start(x)
        carry, new_prefix = self._run_unrolled(self.prefix, plan.prefix, carry, ctx, layer_caches.prefix, stats)
        new_groups = None
        if self.groups is not None:
            carry, (group_stats, new_groups) = self._run_groups(carry, ctx, layer_caches.groups)
            for j, st in enumerate(group_stats):  # leaves [num_groups, ...]: one slice per layer
                for g, i in enumerate(plan.slot_layers(j)):
                    stats[i] = jax.tree.map(lambda x, g=g: x[g], st)
        carry, new_suffix = self._run_unrolled(self.suffix, plan.suffix, carry, ctx, layer_caches.suffix, stats)
        h = residual.readout(carry, self.final_res_mix if residual.attn_res else None)
        with jax.named_scope("lm_head_loss"):
            h = self.final_norm(h)
            if in_vocab is not None:  # the flag of a traced out-of-vocabulary id: NaN logits at its position only
                h = jnp.where(in_vocab[..., None], h, jnp.nan)  # (on [B, T, d], cheaper than on the logits)
            head = cast(self.embed, dt).T if cfg.tie_embeddings else cast(self.lm_head, dt)
            logits = jnp.einsum("btd,dv->btv", h.astype(dt), head, preferred_element_type=jnp.float32)
        new_cache = None
        if cache is not None:
            new_cache = ModelCache(tuple(new_prefix), tuple(new_groups) if new_groups is not None else (),
                                   tuple(new_suffix), cache.length + t,
                                   cache.positions + jnp.sum(ctx.token_valid, axis=1, dtype=jnp.int32), ctx.kv_valid)
        layers = sorted(stats)
        routes = None
        if record_routes:
            routes = (jnp.stack([stats[i].experts for i in moe_layers(cfg)], axis=2) if moe_layers(cfg)
                      else jnp.zeros((b, t, 0, cfg.moe.top_k), jnp.int32))
        return logits, new_cache, ForwardStats(
            router={i: stats[i].router for i in layers if stats[i].router is not None},
            max_logits={i: stats[i].max_logits for i in layers if stats[i].max_logits is not None}, routes=routes)

    def add_lora(self, cfg: LoRAConfig, rngs: nnx.Rngs) -> None:
        """Attach LoRA adapters (``k3jax.layers.lora``) to the projections ``cfg.targets`` names, in place;
        the model's own weights are untouched (the same seed gives the same base with or without them)."""
        if self.lora_config is not None:
            raise ValueError("this model already has LoRA adapters")
        with _no_eager_sharding():
            for layer, _ in self.layer_modules():
                for module, kind in layer.lora_modules():
                    lora.attach(module, cfg.sites(kind), cfg, rngs)
        self.lora_config = cfg

    def merge_lora(self) -> None:
        """Fold the adapters into the weights they adapt (``W + s A B``) and drop them, in place."""
        for layer, _ in self.layer_modules():
            for module, _ in layer.lora_modules():
                lora.merge(module)
        self.lora_config = None

    def layer_modules(self) -> list[tuple[DecoderLayer, tuple[int, ...]]]:
        """Every ``DecoderLayer`` module with the model layers it holds: one layer for an unrolled
        module, one per group (axis 0 of its leaves) for a slot of the stacked groups."""
        plan = self.plan
        out = [(layer, (i,)) for layer, i in zip(self.prefix, plan.prefix)]
        if self.groups is not None:
            out += [(layer, plan.slot_layers(j)) for j, layer in enumerate(self.groups.layers)]
        return out + [(layer, (i,)) for layer, i in zip(self.suffix, plan.suffix)]


def check_token_ids(tokens: jax.Array, vocab_size: int) -> jax.Array | None:
    """Token ids must lie in ``[0, vocab_size)``: an id outside would read no embedding row (``jnp.take``
    fills NaN, which the mixers spread over the whole row; -1 would wrap to the last token).

    Concrete ids (eager calls) are checked here: a ValueError names the first bad id and its position.
    Traced ids (under ``jit``) cannot raise: returns the ``[B, T]`` in-range mask, with which the model
    clamps the embedding lookup and sets the logits of exactly those positions to NaN (a loss over them
    is NaN, so the train step's NaN guard skips the update). None when the ids are concrete."""
    if isinstance(tokens, jax.core.Tracer) or not getattr(tokens, "is_fully_addressable", True):
        return (tokens >= 0) & (tokens < vocab_size)
    ids = np.asarray(tokens)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if len(bad):
        b, t = (int(v) for v in bad[0])
        raise ValueError(f"token id {int(ids[b, t])} at position (row {b}, column {t}) is outside the vocabulary "
                         f"[0, {vocab_size}) ({len(bad)} such ids)")
    return None


def _no_eager_sharding():
    # Params carry logical axis names; they are resolved to a mesh only by the sharding code.
    return nnx.use_eager_sharding(False)


def create_model(cfg: ModelConfig, *, seed: int = 0) -> K3Model:
    """A randomly initialised model on the default device. Eager: the initialisers draw on the host with
    NumPy (``layers/initializers.py``; no program to compile per parameter shape), so the values differ
    from ``training.init_train_state``, the jitted, mesh-independent init that training uses."""
    with _no_eager_sharding():
        return K3Model(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig, *, lora: LoRAConfig | None = None) -> K3Model:
    """The model with ``jax.ShapeDtypeStruct`` leaves: shapes and dtypes, nothing allocated (with LoRA
    adapters when ``lora`` is enabled)."""
    with _no_eager_sharding(), abstract_init():
        model = K3Model(cfg, rngs=nnx.Rngs(0))
        if lora is not None and lora.enabled:
            model.add_lora(lora, nnx.Rngs(0))
        return model


def unroll_layers(model: K3Model) -> K3Model:
    """The same model with every layer an ordinary module (``model.scan_layers=false``): each scanned
    group's stacked weights are split into per-layer arrays (a copy of them). Same parameters, same
    outputs; eager or under ``jit``. Returns ``model`` itself when nothing is scanned.

    Why: a scan slices each layer's weights out of the stack at every step; XLA:CPU copies every
    slice, so a decode step on CPU copies all the weights it reads (the serving engine unrolls there).
    """
    if model.groups is None:
        return model
    unrolled = abstract_model(dataclasses.replace(model.cfg, scan_layers=False), lora=model.lora_config)
    layers, plan = unrolled.prefix, model.plan  # the unrolled model's layers are all in its prefix
    for layer, i in [*zip(model.prefix, plan.prefix), *zip(model.suffix, plan.suffix)]:
        nnx.update(layers[i], nnx.state(layer))
    for slot, stacked in enumerate(model.groups.layers):
        state = nnx.state(stacked)
        for g, i in enumerate(plan.slot_layers(slot)):
            nnx.update(layers[i], jax.tree.map(lambda x: x[g], state))
    top = nnx.state(model)
    nnx.update(unrolled, nnx.State({k: v for k, v in top.items() if k not in ("prefix", "groups", "suffix")}))
    return unrolled


__all__ = ["ForwardStats", "K3Model", "LayerPlan", "LayerStats", "abstract_model", "check_token_ids", "create_model",
           "moe_layers", "plan_layers", "segment_positions", "unroll_layers"]

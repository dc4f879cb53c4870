"""Stable LatentMoE (docs/design.md "Stable LatentMoE and Quantile Balancing"): sigmoid router on the full-width input, routed experts in a latent
width, RMSNorm on the weighted expert sum before the up-projection, shared experts on the full width.

With ``moe.latent_dim = 0`` this is a plain DeepSeek-V3 / Kimi K2 MoE (no projections, no norm).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax import kernels
from k3jax.ops import quantile_balancing as qb
from k3jax.config import ModelConfig
from k3jax.layers.ffn import GatedFFN
from k3jax.layers.initializers import RouterBias, cast, constant, normal
from k3jax.layers.norm import RMSNorm
from k3jax.ops.moe import combine_experts, sigmoid_topk_route
from k3jax.ops.saved_names import EXPERT_SUMS
from k3jax.sharding import current_mesh, keep_split
from k3jax.parallel import sequence as seq_parallel
from k3jax.parallel.expert import expert_parallel_experts
from k3jax.layers.quantized_experts import activation_quantizer, expert_operand, expert_param
from pallas_kernels.platform import target_platform


# Weights stored and read in float32 whatever param_dtype / dtype: the router decides the routing.
FLOAT32_WEIGHTS = frozenset({"router"})
# The latent tokens [N, L] between the projections and the routed experts: the latent split where the
# projections' weights are used split (the serving layout), so the exchange moves tokens, not weights.
LATENT_AXES = (None, "latent")


class LatentMoE(nnx.Module):
    """Parameters: ``router (d, E)``, ``router_bias (E)`` (RouterBias state), ``down (d, L)``,
    ``up (L, d)``, ``latent_norm (L)``, experts ``w_gate / w_up (E, L, F)``, ``w_down (E, F, L)``,
    and ``shared`` (a GatedFFN of width ``F * num_shared``)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m, d, pd, std = cfg.moe, cfg.hidden_size, jnp.dtype(cfg.param_dtype), cfg.init_std
        self.cfg = m
        self.activation, self.beta, self.linear_beta = cfg.activation, cfg.situ_beta, cfg.situ_linear_beta
        self.dtype = jnp.dtype(cfg.dtype)
        self.quant = cfg.quant  # routed experts: dense, MXFP4 QAT or packed MXFP4 (k3jax/quant)
        # ``auto`` is resolved when traced, for the platform compiled for (k3jax/kernels.py)
        self.impl = cfg.moe_impl
        self.router = normal(rngs, (d, m.num_experts), ("embed", "expert"), std, jnp.float32)  # FLOAT32_WEIGHTS
        self.router_bias = constant(0.0, (m.num_experts,), ("expert",), jnp.float32, RouterBias) \
            if m.router_bias else None
        width = m.latent_dim or d
        if m.latent_dim:
            self.down = normal(rngs, (d, width), ("embed", "latent"), std, pd)
            self.up = normal(rngs, (width, d), ("latent", "embed"), std, pd)
            self.latent_norm = RMSNorm(width, cfg.norm_eps, param_dtype=pd) if m.latent_norm else None
        e, f = m.num_experts, m.expert_dim
        self.w_gate = expert_param(rngs, (e, width, f), ("expert", "expert_in", "expert_mlp"), std, pd, cfg.quant)
        self.w_up = expert_param(rngs, (e, width, f), ("expert", "expert_in", "expert_mlp"), std, pd, cfg.quant)
        self.w_down = expert_param(rngs, (e, f, width), ("expert", "expert_mlp", "expert_in"), std, pd, cfg.quant)
        self.shared = GatedFFN(cfg, f * m.num_shared_experts, rngs=rngs) if m.num_shared_experts else None

    def __call__(self, x: jax.Array, *, token_mask: jax.Array | None = None, lora_key: jax.Array | None = None,
                 replay: jax.Array | None = None):
        """x ``[B, T, d]`` -> (``[B, T, d]``, Quantile Balancing statistics or None, the selected experts
        ``[B, T, k]`` int32).

        token_mask ``[B, T]`` (True = real token) keeps padding out of the balancing statistics.
        lora_key: the dropout key of the shared experts' adapters (training).
        replay ``[B, T, k]`` int: routing replay, the experts each token uses instead of its top-k
        (``ops.moe.sigmoid_topk_route``).
        """
        b, t, d = x.shape
        m, dt = self.cfg, self.dtype
        xf = x.reshape(b * t, d)
        # named scopes: the part names of k3jax.aot.breakdown
        with jax.named_scope("router"):
            logits = jnp.einsum("nd,de->ne", xf.astype(jnp.float32), self.router[...].astype(jnp.float32))
            bias = self.router_bias[...] if self.router_bias is not None else None
            route_fn = functools.partial(sigmoid_topk_route, top_k=m.top_k, renormalize=m.renormalize,
                                         scaling_factor=m.routed_scaling_factor)
            # per token: the logits, and the replayed experts when there are
            own = logits if replay is None else (logits, replay.reshape(b * t, m.top_k))
            if replay is None:
                route_one = route_fn
            else:
                def route_one(own, bias):
                    lg, ids = own
                    return route_fn(lg, bias, replay=ids)
            if bias is None:
                route = seq_parallel.on_own_tokens(lambda own: route_one(own, None), own, batch=b, seq_len=t)
            else:  # on each device's tokens: GSPMD gathers top_k's tokens otherwise
                route = seq_parallel.on_own_tokens(route_one, own, bias, batch=b, seq_len=t)
        z = xf.astype(dt)
        if m.latent_dim:
            with jax.named_scope("latent_proj"):
                z = keep_split(jnp.einsum("nd,dl->nl", z, cast(self.down, dt)), LATENT_AXES)
        with jax.named_scope("routed_experts"):
            u = self._routed_experts(z, route)
        if m.latent_dim:
            with jax.named_scope("latent_proj"):
                if self.latent_norm is not None:
                    u = self.latent_norm(checkpoint_name(u, EXPERT_SUMS))
                y = jnp.einsum("nl,ld->nd", keep_split(u.astype(dt), LATENT_AXES), cast(self.up, dt))
        else:
            y = u.astype(dt)
        y = y.reshape(b, t, d)
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y = y + self.shared(x, lora_key=lora_key)
        stats = None
        if m.balancing == "quantile" and bias is not None:
            with jax.named_scope("quantile_balancing"):
                mask = None if token_mask is None else token_mask.reshape(-1)
                stats = qb.router_statistics(route.scores, route.threshold, bias, mask, method=m.qb_method,
                                             num_bins=m.qb_bins)
        return y, stats, route.experts.reshape(b, t, m.top_k)

    def _routed_experts(self, z: jax.Array, route) -> jax.Array:
        """Latent tokens z ``[N, L]`` -> the weighted routed-expert sum ``u [N, L]`` float32."""
        m = self.cfg
        # the platform of the ambient mesh (a TPU mesh in an AOT compile on a CPU host), else the default
        # backend: the rule the expert-parallel path follows too
        platform = target_platform()
        impl = kernels.resolve_moe_impl(self.impl, platform)
        packed = kernels.packed_mxfp4(impl, platform)  # MXFP4 experts decoded in the kernel, not before it
        experts = tuple(expert_operand(w, self.dtype, self.quant, packed_mxfp4=packed)
                        for w in (self.w_gate, self.w_up, self.w_down))
        glu = dict(activation=self.activation, beta=self.beta, linear_beta=self.linear_beta)
        act_quant = activation_quantizer(self.quant)
        if act_quant is not None:
            glu["act_quant"] = act_quant
        if current_mesh() is None:
            pair_out = kernels.grouped_glu_experts(impl)(z, route.experts, *experts, **glu)
            return combine_experts(route.weights, pair_out)
        # under a mesh: experts sharded over `expert`, u summed across devices (before the norm)
        return expert_parallel_experts(z, route.experts, route.weights, *experts, dispatch=m.ep_dispatch,
                                       capacity_factor=m.ep_capacity_factor, impl=impl, **glu)

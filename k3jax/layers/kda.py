"""Kimi Delta Attention layer (docs/design.md "KDA").

``q, k, v = silu(conv(x W))`` (q, k then L2-normalised per head), ``beta = sigmoid(x W_b)``, per-channel
log-decay ``g`` from a low-rank projection through the lower-bounded sigmoid (K3) or softplus (Kimi
Linear) gate, the gated delta rule, then ``(RMSNorm_head(o) * sigmoid(x W_g)) W_o``.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.cache import KDACache
from k3jax.config import ModelConfig
from k3jax.layers import lora
from k3jax.layers.initializers import cast, constant, normal, param, uniform
from k3jax.ops.conv import causal_conv1d
from k3jax import kernels
from k3jax.ops.kda import kda_gate_lower_bound, kda_gate_softplus, kda_step
from k3jax.ops.norms import l2_norm, rms_norm
from k3jax.ops.saved_names import MIXER_OUTPUTS, MIXER_PROJECTIONS
from k3jax.parallel import sequence as seq_parallel

# fla's dt initialisation range for the softplus gate: dt ~ logU(1e-3, 1e-1), floor 1e-4.
_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 1e-1, 1e-4
# fla's A_log initialisation for the softplus gate: A ~ U(1, 16).
_A_MIN, _A_MAX = 1.0, 16.0


def _softplus_inverse_dt(rngs: nnx.Rngs, shape) -> jax.Array:
    """fla's dt_bias init: softplus^-1(dt), dt ~ logU(1e-3, 1e-1) floored at 1e-4."""
    dt = jnp.maximum(jnp.exp(uniform(rngs, shape, math.log(_DT_MIN), math.log(_DT_MAX))), _DT_FLOOR)
    return dt + jnp.log(-jnp.expm1(-dt))


class KDA(nnx.Module):
    """Parameters (H heads, K = V = head_dim, r = gate rank, W = conv width):
    ``q_proj/k_proj/v_proj (d, H, K)``, ``q_conv/k_conv/v_conv (W, H, K)``, ``f_a (d, r)``,
    ``f_b (r, H, K)``, ``A_log (H)``, ``dt_bias (H, K)``, ``b_proj (d, H)``, output gate
    ``g_proj (d, H, K)`` (full) or ``g_a (d, r)`` + ``g_b (r, H, K)`` (low rank), ``o_norm (K)``,
    ``o_proj (H, K, d)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        c, d, pd, std = cfg.kda, cfg.hidden_size, jnp.dtype(cfg.param_dtype), cfg.init_std
        h, k, r = c.num_heads, c.head_dim, c.rank
        self.cfg, self.dtype = c, jnp.dtype(cfg.dtype)
        self.chunk_kda = kernels.chunk_kda(cfg.kda_impl)  # the pure-JAX op or the Pallas kernel
        hk = ("embed", "heads", "head_dim")
        self.q_proj = normal(rngs, (d, h, k), hk, std, pd)
        self.k_proj = normal(rngs, (d, h, k), hk, std, pd)
        self.v_proj = normal(rngs, (d, h, k), hk, std, pd)
        if c.conv_size:
            conv_std = 1.0 / math.sqrt(c.conv_size)  # torch Conv1d default scale for fan_in = W
            conv_axes = ("conv", "heads", "head_dim")
            self.q_conv = normal(rngs, (c.conv_size, h, k), conv_axes, conv_std, pd)
            self.k_conv = normal(rngs, (c.conv_size, h, k), conv_axes, conv_std, pd)
            self.v_conv = normal(rngs, (c.conv_size, h, k), conv_axes, conv_std, pd)
        self.f_a = normal(rngs, (d, r), ("embed", "gate_rank"), std, pd)
        self.f_b = normal(rngs, (r, h, k), ("gate_rank", "heads", "head_dim"), std, pd)
        if c.gate == "lower_bound":
            make_a_log = lambda: jnp.zeros((h,), jnp.float32)  # fla's safe-gate init  # noqa: E731
        else:
            make_a_log = lambda: jnp.log(uniform(rngs, (h,), _A_MIN, _A_MAX))  # noqa: E731
        self.A_log = param((h,), ("heads",), jnp.float32, make_a_log)
        self.dt_bias = param((h, k), ("heads", "head_dim"), jnp.float32, lambda: _softplus_inverse_dt(rngs, (h, k)))
        self.b_proj = normal(rngs, (d, h), ("embed", "heads"), std, pd)
        if c.output_gate == "full":
            self.g_proj = normal(rngs, (d, h, k), hk, std, pd)
        elif c.output_gate == "low_rank":
            self.g_a = normal(rngs, (d, r), ("embed", "gate_rank"), std, pd)
            self.g_b = normal(rngs, (r, h, k), ("gate_rank", "heads", "head_dim"), std, pd)
        self.o_norm = constant(1.0, (k,), ("head_dim",), pd)
        self.o_proj = normal(rngs, (h, k, d), ("heads", "head_dim", "embed"), std, pd)

    def _short_conv(self, x: jax.Array, w: nnx.Param | None, segment_ids, conv_state, sequence_parallel: bool):
        """silu(causal depthwise conv) of ``x [B, T, H, K]``; returns (y, new conv state or None)."""
        if w is None:
            return jax.nn.silu(x), conv_state
        b, t, h, k = x.shape
        conv = seq_parallel.causal_conv1d if sequence_parallel else causal_conv1d
        y, conv_state = conv(x.reshape(b, t, h * k), cast(w, x.dtype).reshape(-1, h * k), segment_ids=segment_ids,
                             initial_state=conv_state, output_final_state=conv_state is not None)
        return jax.nn.silu(y).reshape(b, t, h, k), conv_state

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None, cache: KDACache | None = None,
                 token_valid: jax.Array | None = None,
                 lora_key: jax.Array | None = None) -> tuple[jax.Array, KDACache | None]:
        """x ``[B, T, d]`` -> (``[B, T, d]``, updated cache or None).

        Packed documents (segment_ids ``[B, T]``) are isolated. With a ``cache`` the layer continues
        from its state; ``token_valid [B, T]`` marks left padding, which leaves the state untouched.
        ``lora_key``: the dropout key of the adapters' inputs (training).
        """
        c, dt = self.cfg, self.dtype
        x = x.astype(dt)
        if token_valid is not None:
            x = jnp.where(token_valid[..., None], x, jnp.zeros((), dt))
        conv = c.conv_size > 0
        # time split over mesh axes (a training row or a prefill chunk; each shard needs the conv's W-1 halo
        # from its predecessor): the conv and the state fold run per shard, a cache's state entering shard 0
        halo = max(c.conv_size - 1, 1)
        sequence_parallel = seq_parallel.sequence_shards(x.shape[1], halo, batch=x.shape[0]) > 1

        def proj(name):  # q, k, v (before the conv) and the output gate: kept by some remat policies
            return checkpoint_name(lora.project(self, name, x, "btd,dhk->bthk", dt, lora_key), MIXER_PROJECTIONS)

        cq, ck, cv = (cache.conv_q, cache.conv_k, cache.conv_v) if cache is not None else (None, None, None)
        q, cq = self._short_conv(proj("q_proj"), self.q_conv if conv else None, segment_ids, cq,
                                  sequence_parallel)
        k, ck = self._short_conv(proj("k_proj"), self.k_conv if conv else None, segment_ids, ck,
                                  sequence_parallel)
        v, cv = self._short_conv(proj("v_proj"), self.v_conv if conv else None, segment_ids, cv,
                                  sequence_parallel)
        q, k = l2_norm(q), l2_norm(k)
        beta = jax.nn.sigmoid(lora.project(self, "b_proj", x, "btd,dh->bth", dt, lora_key).astype(jnp.float32))
        z = jnp.einsum("btr,rhk->bthk", jnp.einsum("btd,dr->btr", x, cast(self.f_a, dt)), cast(self.f_b, dt))
        z = z.astype(jnp.float32)
        if c.gate == "lower_bound":
            g = kda_gate_lower_bound(z, self.A_log[...], self.dt_bias[...], c.gate_lower_bound)
        else:
            g = kda_gate_softplus(z, self.A_log[...], self.dt_bias[...])
        if token_valid is not None:  # padding: no decay, no write
            g = jnp.where(token_valid[..., None, None], g, 0.0)
            beta = jnp.where(token_valid[..., None], beta, 0.0)
        initial = cache.state if cache is not None else None
        if cache is not None and x.shape[1] == 1:  # decode: one recurrent step (no scan of length 1)
            o, state = kda_step(initial, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o = o[:, None]
        else:
            kda = (functools.partial(seq_parallel.chunk_kda, chunk_fn=self.chunk_kda) if sequence_parallel
                   else self.chunk_kda)
            o, state = kda(q, k, v, g, beta, chunk_size=c.chunk_size, segment_ids=segment_ids,
                           initial_state=initial, output_final_state=cache is not None)
        o = rms_norm(checkpoint_name(o, MIXER_OUTPUTS), self.o_norm[...], c.norm_eps)
        if c.output_gate == "full":
            o = o * jax.nn.sigmoid(proj("g_proj").astype(jnp.float32)).astype(dt)
        elif c.output_gate == "low_rank":
            gate = lora.project(self, "g_b", lora.project(self, "g_a", x, "btd,dr->btr", dt, lora_key), "btr,rhk->bthk",
                                dt, lora_key)
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dt)
        y = lora.project(self, "o_proj", o.astype(dt), "bthk,hkd->btd", dt, lora_key)
        new_cache = KDACache(state, cq, ck, cv) if cache is not None else None
        return y, new_cache

"""MoonViT: the native-resolution vision tower of K3 (MoonViT-V2) and K2.5 (MoonViT), one switch apart.

patches -> patch embedding (a stride-p conv as one matmul) + the learned position table resampled to
the image's grid -> ``num_layers`` pre-norm blocks (block-diagonal self-attention over each image's
patches with 2-D RoPE on q and k; tanh-GELU MLP) -> final norm -> ``m x m`` space-to-depth merge.
The merge's output ``[B, M, m*m, D]`` feeds the projector (``k3jax.vision.projector``).

Switches (``VisionConfig``): norm (RMSNorm with eps = finfo(dtype).eps for K3, LayerNorm 1e-5 for
K2.5), biases, the position-table interpolation (bilinear / bicubic), widths and head_dim. Video
(t > 1 frames, the K2.5 sincos time table and temporal mean pool) is not implemented: K3's released
processor is image-only.

Parameters carry ``vision_*`` logical axis names, which the sharding rules leave replicated: the
tower runs data-parallel over the batch rows on the LM's mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import VisionConfig
from k3jax.layers.initializers import cast, constant, normal
from k3jax.ops.attention import chunked_attention
from k3jax.vision.inputs import VisionInputs
from k3jax.vision.position import apply_rope2d, resample_position_table, rope2d_angles

NUM_CHANNELS = 3  # RGB


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis, in float32; x's dtype out."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class VisionNorm(nnx.Module):
    """RMSNorm (gain only) or LayerNorm (gain and bias). ``eps = 0`` means ``finfo(x.dtype).eps``,
    which is what ``torch.nn.RMSNorm(dim)`` (eps=None) does in the release: exact parity depends on
    the compute dtype."""

    def __init__(self, dim: int, kind: str, eps: float, *, param_dtype):
        self.kind, self.eps = kind, eps
        self.weight = constant(1.0, (dim,), ("norm",), param_dtype)
        if kind == "layernorm":
            self.bias = constant(0.0, (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., D]`` -> ``[..., D]`` in x's dtype."""
        eps = self.eps or float(jnp.finfo(x.dtype).eps)
        if self.kind == "layernorm":
            return layer_norm(x, self.weight[...], self.bias[...], eps)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class VisionBlock(nnx.Module):
    """``x += wo(attn(rope(qkv(norm0(x)))))``, then ``x += fc1(gelu_tanh(fc0(norm1(x))))``.

    wqkv ``[D, 3*H*K]`` (columns q | k | v, each head-major, as the release's fused ``wqkv`` rows),
    wo ``[H*K, D]``, fc0 ``[D, F]``, fc1 ``[F, D]``; biases only with ``cfg.bias``. The projections are
    stored as plain matrices so that Muon treats them as the release's matrices (whole-matrix).
    """

    def __init__(self, cfg: VisionConfig, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        d, h, k, f, pd = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, param_dtype
        self.bias = cfg.bias
        self.norm0 = VisionNorm(d, cfg.norm, cfg.norm_eps, param_dtype=pd)
        self.heads = (h, k)
        self.wqkv = normal(rngs, (d, 3 * h * k), ("vision_embed", "vision_qkv"), init_std, pd)
        self.wo = normal(rngs, (h * k, d), ("vision_qkv", "vision_embed"), init_std, pd)
        self.norm1 = VisionNorm(d, cfg.norm, cfg.norm_eps, param_dtype=pd)
        self.fc0 = normal(rngs, (d, f), ("vision_embed", "vision_mlp"), init_std, pd)
        self.fc1 = normal(rngs, (f, d), ("vision_mlp", "vision_embed"), init_std, pd)
        if cfg.bias:
            self.wqkv_bias = constant(0.0, (3 * h * k,), ("vision_qkv",), pd)
            self.wo_bias = constant(0.0, (d,), ("vision_embed",), pd)
            self.fc0_bias = constant(0.0, (f,), ("vision_mlp",), pd)
            self.fc1_bias = constant(0.0, (d,), ("vision_embed",), pd)

    def __call__(self, x: jax.Array, angles: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, P, D]``, angles ``[B, P, K/2]``, segment_ids ``[B, P]`` -> ``[B, P, D]``."""
        dt = x.dtype
        y = self.norm0(x)
        qkv = jnp.einsum("bpd,de->bpe", y, cast(self.wqkv, dt))
        if self.bias:
            qkv = qkv + cast(self.wqkv_bias, dt)
        qkv = qkv.reshape(qkv.shape[:2] + (3,) + self.heads)  # [B, P, 3, H, K]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = apply_rope2d(q, angles), apply_rope2d(k, angles)
        # Non-causal: every index 0, so only the segment (image) test masks. Padding (segment 0)
        # attends among itself and is dropped by the merge.
        index = jnp.zeros(segment_ids.shape, jnp.int32)
        o = chunked_attention(q, k, v, index, index, scale=q.shape[-1] ** -0.5, q_segment_ids=segment_ids,
                              kv_segment_ids=segment_ids)
        o = jnp.einsum("bpe,ed->bpd", o.reshape(o.shape[:2] + (-1,)), cast(self.wo, dt))
        if self.bias:
            o = o + cast(self.wo_bias, dt)
        x = x + o
        y = jnp.einsum("bpd,df->bpf", self.norm1(x), cast(self.fc0, dt))
        if self.bias:
            y = y + cast(self.fc0_bias, dt)
        y = jax.nn.gelu(y.astype(jnp.float32), approximate=True).astype(dt)
        y = jnp.einsum("bpf,fd->bpd", y, cast(self.fc1, dt))
        if self.bias:
            y = y + cast(self.fc1_bias, dt)
        return x + y


class MoonViT(nnx.Module):
    """patch_embed ``[C*p*p, D]`` (a stride-p conv over (C, kh, kw)-ordered pixels; + patch_bias
    ``[D]``), pos_emb ``[S, S, D]``, blocks, final_norm."""

    def __init__(self, cfg: VisionConfig, *, init_std: float, dtype, param_dtype, rngs: nnx.Rngs):
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        d, p, s, pd = cfg.hidden_size, cfg.patch_size, cfg.pos_emb_size, param_dtype
        self.patch_embed = normal(rngs, (NUM_CHANNELS * p * p, d), ("vision_patch", "vision_embed"), init_std, pd)
        if cfg.bias:
            self.patch_bias = constant(0.0, (d,), ("vision_embed",), pd)
        self.pos_emb = normal(rngs, (s, s, d), (None, None, "vision_embed"), init_std, pd)
        self.blocks = nnx.List([VisionBlock(cfg, init_std=init_std, param_dtype=pd, rngs=rngs)
                                for _ in range(cfg.num_layers)])
        self.final_norm = VisionNorm(d, cfg.norm, cfg.norm_eps, param_dtype=pd)

    def __call__(self, inputs: VisionInputs) -> jax.Array:
        """Packed images (``VisionInputs``, batch-first) -> merged features ``[B, M, m*m, D]``
        (padding slots of ``M`` hold junk; ``inputs.merged_valid`` marks the real ones)."""
        cfg, dt = self.cfg, self.dtype
        patches = jnp.asarray(inputs.patches).astype(dt)
        x = jnp.einsum("bpi,id->bpd", patches.reshape(patches.shape[:2] + (-1,)), cast(self.patch_embed, dt))
        if cfg.bias:
            x = x + cast(self.patch_bias, dt)
        rows, cols = jnp.asarray(inputs.rows), jnp.asarray(inputs.cols)
        pos = resample_position_table(self.pos_emb[...], rows, cols, jnp.asarray(inputs.grid_h),
                                      jnp.asarray(inputs.grid_w), cfg.pos_interpolation)
        x = x + pos.astype(dt)
        angles = rope2d_angles(rows, cols, cfg.head_dim, cfg.rope_theta)
        segment_ids = jnp.asarray(inputs.segment_ids)
        for block in self.blocks:
            x = block(x, angles, segment_ids)
        x = self.final_norm(x)
        # Space-to-depth merge: a gather of each LM token's m x m patches.
        return jax.vmap(lambda xb, ib: xb[ib])(x, jnp.asarray(inputs.merge_index))


__all__ = ["MoonViT", "VisionBlock", "VisionNorm", "layer_norm"]

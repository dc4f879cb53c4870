"""QK-clip (Kimi K2's MuonClip): after the optimizer step, rescale the q / k columns of every MLA head
whose largest pre-softmax logit passed ``tau`` (``train.optim.qk_clip_tau``). It edits weights in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx



def qk_clip_gamma(max_logits: jax.Array, tau: float) -> jax.Array:
    """``gamma_h = min(1, tau / S_max^h)`` (1 where the logit is below tau or not positive)."""
    m = jnp.asarray(max_logits, jnp.float32)
    return jnp.where(m > tau, tau / jnp.where(m > 0, m, 1.0), 1.0)


def qk_clip_mla(q_b: jax.Array, kv_b: jax.Array, max_logits: jax.Array, tau: float, *,
                qk_nope_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """K2's MuonClip for one (or a stack of) MLA layer(s), applied after the optimizer step.

    q_b ``[..., r_q, H, nope + rope]`` (or the plain ``q_proj [..., d, H, P]``), kv_b
    ``[..., r_kv, H, nope + v]``, max_logits ``[..., H]``: each head's largest pre-softmax logit
    (already multiplied by the softmax scale) seen in the step's forward pass. With
    ``gamma = min(1, tau / max_logit)``: the head's q nope columns and k nope columns are scaled by
    ``sqrt(gamma)`` (their product by gamma), its q rope columns by ``gamma`` (the shared k_rope,
    in ``kv_a``, is untouched), the value columns are untouched.
    """
    gamma = qk_clip_gamma(max_logits, tau)  # [..., H]
    g = gamma[..., None, :, None]
    sg = jnp.sqrt(g)
    n = qk_nope_head_dim
    p = q_b.shape[-1]
    col = jnp.arange(p)
    q_scale = jnp.where(col < n, sg, g)  # [..., 1, H, P]
    q_new = (q_b.astype(jnp.float32) * q_scale).astype(q_b.dtype)
    kcol = jnp.arange(kv_b.shape[-1])
    kv_scale = jnp.where(kcol < n, sg, 1.0)
    kv_new = (kv_b.astype(jnp.float32) * kv_scale).astype(kv_b.dtype)
    return q_new, kv_new


def qk_clip(model: nnx.Module, max_logits: dict[int, jax.Array], tau: float) -> None:
    """Apply :func:`qk_clip_mla` in place to the MLA layers of ``model`` (a ``K3Model``).

    max_logits: ``{layer index: [H]}``, each MLA layer's largest pre-softmax logit per head in this
    step's forward pass (``model.forward(..., max_logits=True)``: ``ForwardStats.max_logits``).
    ``tau <= 0`` is a no-op. Pure array math on the Variables: works under ``jit``.
    """
    if tau <= 0:
        return
    unused = set(max_logits)
    for layer, layers in model.layer_modules():
        if not unused & set(layers):
            continue
        if not hasattr(layer.mixer, "kv_b"):
            raise KeyError(f"qk_clip: layer {layers[0]} is not an MLA layer")
        unused -= set(layers)
        mla = layer.mixer
        stacked = mla.kv_b[...].ndim == 4  # a slot of the scanned groups: [G, r, H, nope + v]
        logits = jnp.stack([max_logits[i] for i in layers]) if stacked else max_logits[layers[0]]
        q_var = mla.q_b if hasattr(mla, "q_b") else mla.q_proj
        q_new, kv_new = qk_clip_mla(q_var[...], mla.kv_b[...], logits, tau, qk_nope_head_dim=mla.cfg.qk_nope_head_dim)
        q_var[...] = q_new
        mla.kv_b[...] = kv_new
    if unused:
        raise KeyError(f"qk_clip: no layers {sorted(unused)} in this model")



__all__ = ["qk_clip", "qk_clip_gamma", "qk_clip_mla"]

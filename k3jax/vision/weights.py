"""The vision tower and projector in the official checkpoint layout (``vision_tower.*``, ``mm_projector.*``).

Names and orientation are the release's (torch ``[out, in]`` matrices, as its safetensors hold them):
``vision_tower.patch_embed.proj.weight [D, 3, p, p]``, ``vision_tower.patch_embed.pos_emb.weight
[S, S, D]``, ``vision_tower.encoder.blocks.{i}.{norm0, norm1, wqkv, wo, mlp.fc0, mlp.fc1}``,
``vision_tower.encoder.final_layernorm``, ``mm_projector.{proj.0, proj.2, post_norm | pre_norm}``;
``.bias`` entries exist only for the K2.5 variant (biases, LayerNorm). ``wqkv`` rows are
``[q | k | v]``, each ``H x K`` head-major with RoPE pairs adjacent, which is this implementation's
layout, so nothing is permuted (HF transformers' ``kimi_k25`` permutes q/k to its half-split RoPE).
"""

from __future__ import annotations

from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

TOWER, PROJECTOR = "vision_tower", "mm_projector"


def _pairs(tower, projector) -> Iterator[tuple[str, object, str, Callable, Callable]]:
    """(official name, owner module, attribute, to_official, from_official) for every vision tensor."""
    cfg = tower.cfg
    d = cfg.hidden_size
    same = (lambda a: a, lambda a: a)
    t2 = (lambda a: a.T, lambda a: a.T)
    p = cfg.patch_size
    yield (f"{TOWER}.patch_embed.proj.weight", tower, "patch_embed",
           lambda a: a.T.reshape(d, 3, p, p), lambda a: a.reshape(d, -1).T)
    if cfg.bias:
        yield (f"{TOWER}.patch_embed.proj.bias", tower, "patch_bias", *same)
    yield (f"{TOWER}.patch_embed.pos_emb.weight", tower, "pos_emb", *same)
    for i, blk in enumerate(tower.blocks):
        pre = f"{TOWER}.encoder.blocks.{i}"
        yield from _norm(f"{pre}.norm0", blk.norm0)
        yield from _norm(f"{pre}.norm1", blk.norm1)
        yield (f"{pre}.wqkv.weight", blk, "wqkv", *t2)
        yield (f"{pre}.wo.weight", blk, "wo", *t2)
        yield (f"{pre}.mlp.fc0.weight", blk, "fc0", *t2)
        yield (f"{pre}.mlp.fc1.weight", blk, "fc1", *t2)
        if cfg.bias:
            yield (f"{pre}.wqkv.bias", blk, "wqkv_bias", *same)
            yield (f"{pre}.wo.bias", blk, "wo_bias", *same)
            yield (f"{pre}.mlp.fc0.bias", blk, "fc0_bias", *same)
            yield (f"{pre}.mlp.fc1.bias", blk, "fc1_bias", *same)
    yield from _norm(f"{TOWER}.encoder.final_layernorm", tower.final_norm)
    yield (f"{PROJECTOR}.proj.0.weight", projector, "in_proj", *t2)
    yield (f"{PROJECTOR}.proj.2.weight", projector, "out_proj", *t2)
    if projector.kind == "patchmerger":
        yield from _norm(f"{PROJECTOR}.pre_norm", projector.pre_norm)
        yield (f"{PROJECTOR}.proj.0.bias", projector, "in_bias", *same)
        yield (f"{PROJECTOR}.proj.2.bias", projector, "out_bias", *same)
    else:
        yield from _norm(f"{PROJECTOR}.post_norm", projector.post_norm)


def _norm(name: str, norm):
    yield (f"{name}.weight", norm, "weight", lambda a: a, lambda a: a)
    if norm.kind == "layernorm":
        yield (f"{name}.bias", norm, "bias", lambda a: a, lambda a: a)


def official_names(model) -> list[str]:
    """Every ``vision_tower.*`` / ``mm_projector.*`` name of ``model`` (a K3Model with vision on)."""
    return [name for name, *_ in _pairs(model.vision_tower, model.mm_projector)]


def export_vision(model) -> Iterator[tuple[str, np.ndarray]]:
    """(official name, numpy array in the parameter dtype) for every vision tensor, in the release's
    orientation."""
    for name, owner, attr, to_off, _ in _pairs(model.vision_tower, model.mm_projector):
        yield name, np.ascontiguousarray(to_off(np.asarray(getattr(owner, attr)[...])))


def load_vision(model, get: Callable[[str], np.ndarray], *, put: Callable | None = None) -> list[str]:
    """Assign every vision tensor from ``get(official name)`` (numpy, any float dtype; cast to the
    parameter dtype; ``put`` places it, e.g. ``jax.device_put`` with a sharding). Works on an
    abstract model too. Shape mismatches raise ``ValueError`` naming the tensor. Returns the names."""
    names = []
    for name, owner, attr, _, from_off in _pairs(model.vision_tower, model.mm_projector):
        var = getattr(owner, attr)
        value = from_off(np.asarray(get(name)))
        current = var.get_raw_value()
        if value.shape != current.shape:
            raise ValueError(f"{name}: shape {tuple(np.shape(get(name)))} does not fit the config "
                             f"(expects {current.shape} in k3jax layout)")
        value = jnp.asarray(value, current.dtype)
        var.set_raw_value(put(value) if put is not None else value)
        names.append(name)
    return names


def is_vision_tensor(name: str) -> bool:
    return name.startswith((TOWER + ".", PROJECTOR + "."))


def vision_config_from_hf(vc: dict, text_hidden: int | None = None) -> dict:
    """The release's ``vision_config`` (its config.json's ``vt_*`` keys) -> ``VisionConfig``
    fields (``enabled`` left out). Missing keys take K3's values."""
    from k3jax.config import VisionConfig

    k3 = VisionConfig()
    heads = int(vc.get("vt_num_attention_heads", k3.num_heads))
    hidden = int(vc.get("vt_hidden_size", k3.hidden_size))
    merge = vc.get("merge_kernel_size", [k3.merge_size, k3.merge_size])
    if isinstance(merge, (list, tuple)):
        if len(set(merge)) != 1:
            raise ValueError(f"vision_config.merge_kernel_size={merge}: only square merges are supported")
        merge = merge[0]
    if int(vc.get("init_pos_emb_height", k3.pos_emb_size)) != int(vc.get("init_pos_emb_width", k3.pos_emb_size)):
        raise ValueError("vision_config.init_pos_emb_height != init_pos_emb_width: only square tables are supported")
    if text_hidden is not None and int(vc.get("text_hidden_size", text_hidden)) != text_hidden:
        raise ValueError(f"vision_config.text_hidden_size={vc['text_hidden_size']} != the LM's hidden size {text_hidden}")
    norm = vc.get("norm_type", "rmsnorm")
    return {
        "patch_size": int(vc.get("patch_size", k3.patch_size)), "hidden_size": hidden,
        "num_layers": int(vc.get("vt_num_hidden_layers", k3.num_layers)), "num_heads": heads,
        "head_dim": int(vc.get("qkv_hidden_size", hidden)) // heads,
        "mlp_dim": int(vc.get("vt_intermediate_size", k3.mlp_dim)),
        "norm": "layernorm" if norm == "layernorm" else "rmsnorm",
        "norm_eps": 1e-5 if norm == "layernorm" else 0.0,
        "bias": bool(vc.get("attn_bias", False) or vc.get("linear_bias", False) or vc.get("patch_embed_proj_bias", False)),
        "pos_emb_size": int(vc.get("init_pos_emb_height", k3.pos_emb_size)),
        "pos_interpolation": vc.get("pos_emb_interpolation_mode", k3.pos_interpolation),
        "merge_size": int(merge),
        "projector": "patchmerger" if vc.get("mm_projector_type") == "patchmerger" else "patchmergerv2",
        "projector_eps": float(vc.get("projector_ln_eps", k3.projector_eps)),
    }


def vision_config_to_hf(cfg, text_hidden: int) -> dict:
    """``VisionConfig`` -> the release's ``vision_config`` dict (K3 key set)."""
    layer_norm = cfg.norm == "layernorm"
    return {
        "patch_size": cfg.patch_size, "patch_embed_proj_bias": cfg.bias, "vt_hidden_size": cfg.hidden_size,
        "vt_intermediate_size": cfg.mlp_dim, "vt_num_attention_heads": cfg.num_heads,
        "vt_num_hidden_layers": cfg.num_layers, "qkv_hidden_size": cfg.num_heads * cfg.head_dim,
        "norm_type": "layernorm" if layer_norm else "rmsnorm", "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh", "attn_bias": cfg.bias, "linear_bias": cfg.bias,
        "pos_emb_type": "divided_fixed", "init_pos_emb_height": cfg.pos_emb_size,
        "init_pos_emb_width": cfg.pos_emb_size, "init_pos_emb_time": 4,
        "pos_emb_interpolation_mode": cfg.pos_interpolation, "merge_kernel_size": [cfg.merge_size] * 2,
        "merge_type": "sd2_tpool", "mm_projector_type": cfg.projector, "mm_hidden_size": cfg.hidden_size,
        "projector_hidden_act": "gelu", "projector_ln_eps": cfg.projector_eps, "text_hidden_size": text_hidden,
    }


__all__ = ["PROJECTOR", "TOWER", "export_vision", "is_vision_tensor", "load_vision", "official_names",
           "vision_config_from_hf", "vision_config_to_hf"]

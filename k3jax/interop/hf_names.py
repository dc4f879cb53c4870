"""The map between Hugging Face tensor names and k3jax leaves, and the orientation rule of each.

Orientation: HF stores every matrix as a torch ``nn.Linear`` weight ``[out, in]``; k3jax stores
``x @ W`` weights ``(in, out)`` with explicit head axes, e.g. ``q_proj (d, H, K)`` <- HF
``[H*K, d]``, ``o_proj (H, K, d)`` <- HF ``[d, H*K]``, depthwise convs ``(W, H, K)`` <- HF
``[H*K, 1, W]``. Scanned layers are stacked (``model.groups``, leading group axis) and routed
experts carry an expert axis, so one HF tensor fills one slice ``leaf[g, e, ...]`` of a leaf.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import numpy as np

from k3jax.config import ModelConfig
from k3jax.interop.model_leaves import Path
from k3jax.layer_plan import LayerPlan

# Conversion kinds between an HF tensor and a k3jax block (the leaf minus its indexed leading axes).
SAME = "same"  # identical shape
FLAT = "flat"  # HF [prod(shape)] <-> block (dt_bias [H*K] <-> (H, K))
ROW = "row"  # HF [1, d] <-> (d,) (AttnRes pseudo-queries, an nn.Linear(d, 1))
LINEAR = "linear"  # HF [out, in] <-> (in, *out): projections into heads
LINEAR_IN2 = "linear_in2"  # HF [out, in] <-> (*in(2 axes), out): o_proj (H, K, d)
CONV = "conv"  # HF [C, 1, W] <-> (W, H, K)
A_LOG = "a_log"  # HF [1, 1, H, 1] (kimi_linear) or zero-padded [max(K, H)] (kimi_k3) <-> (H,)

LANGUAGE_MODEL_PREFIX = "language_model."  # the multimodal kimi_k3 / kimi_k25 releases' text weights
# model types with the DeepSeek-V3 text layout (MLA with RoPE, MoE blocks named mlp.*); kimi_k25's text model is K2
DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


@dataclasses.dataclass(frozen=True)
class Binding:
    """One HF tensor <-> one slice of one k3jax leaf."""

    hf: str  # HF name (with prefix); for packed experts the base name without ".weight"
    leaf: Path  # path of the nnx.Variable in the model
    index: tuple[int, ...]  # leading indices into the leaf
    kind: str
    expert: bool = False  # a routed-expert matrix (may be MXFP4-packed)
    optional_leaf: bool = False  # the leaf may be absent (router bias): export zeros, ignore on import


def _family(model_type: str) -> str:
    return "deepseek" if model_type in DEEPSEEK_TYPES else "kimi"


def bindings(cfg: ModelConfig, plan: LayerPlan, model_type: str, prefix: str = "") -> list[Binding]:
    """Every HF tensor of ``model_type``'s layout for a model with config ``cfg``, in file order."""
    fam = _family(model_type)
    out: list[Binding] = []
    top = prefix + "model."
    out.append(Binding(top + "embed_tokens.weight", ("embed",), (), SAME))
    for i in range(cfg.num_layers):
        base, idx = plan.locate(i)
        L = f"{top}layers.{i}."

        def b(name, sub, kind, extra=(), **kw):
            out.append(Binding(L + name, base + sub, idx + extra, kind, **kw))

        b("input_layernorm.weight", ("attn_norm", "weight"), SAME)
        b("post_attention_layernorm.weight", ("ffn_norm", "weight"), SAME)
        if cfg.attn_res.enabled:
            b("self_attention_res_proj.weight", ("attn_res_mix", "query"), ROW)
            b("self_attention_res_norm.weight", ("attn_res_mix", "norm"), SAME)
            b("mlp_res_proj.weight", ("ffn_res_mix", "query"), ROW)
            b("mlp_res_norm.weight", ("ffn_res_mix", "norm"), SAME)
        A = "self_attn."
        if cfg.mixer(i) == "kda":
            for x in "qkv":
                b(f"{A}{x}_proj.weight", ("mixer", f"{x}_proj"), LINEAR)
            for x in "qkv":
                b(f"{A}{x}_conv1d.weight", ("mixer", f"{x}_conv"), CONV)
            b(A + "f_a_proj.weight", ("mixer", "f_a"), LINEAR)
            b(A + "f_b_proj.weight", ("mixer", "f_b"), LINEAR)
            b(A + "A_log", ("mixer", "A_log"), A_LOG)
            b(A + "dt_bias", ("mixer", "dt_bias"), FLAT)
            b(A + "b_proj.weight", ("mixer", "b_proj"), LINEAR)
            if cfg.kda.output_gate == "full":
                b(A + "g_proj.weight", ("mixer", "g_proj"), LINEAR)
            elif cfg.kda.output_gate == "low_rank":
                b(A + "g_a_proj.weight", ("mixer", "g_a"), LINEAR)
                b(A + "g_b_proj.weight", ("mixer", "g_b"), LINEAR)
            b(A + "o_norm.weight", ("mixer", "o_norm"), SAME)
            b(A + "o_proj.weight", ("mixer", "o_proj"), LINEAR_IN2)
        else:
            if cfg.mla.q_lora_rank:
                b(A + "q_a_proj.weight", ("mixer", "q_a"), LINEAR)
                b(A + "q_a_layernorm.weight", ("mixer", "q_a_norm", "weight"), SAME)
                b(A + "q_b_proj.weight", ("mixer", "q_b"), LINEAR)
            else:
                b(A + "q_proj.weight", ("mixer", "q_proj"), LINEAR)
            b(A + "kv_a_proj_with_mqa.weight", ("mixer", "kv_a"), LINEAR)
            b(A + "kv_a_layernorm.weight", ("mixer", "kv_a_norm", "weight"), SAME)
            b(A + "kv_b_proj.weight", ("mixer", "kv_b"), LINEAR)
            if cfg.mla.output_gate:
                b(A + "g_proj.weight", ("mixer", "g_proj"), LINEAR)
            b(A + "o_proj.weight", ("mixer", "o_proj"), LINEAR_IN2)
        if cfg.ffn(i) == "dense":
            for x in ("gate", "up", "down"):
                b(f"mlp.{x}_proj.weight", ("ffn", f"w_{x}"), LINEAR)
        else:
            M = "block_sparse_moe." if fam == "kimi" else "mlp."
            b(M + "gate.weight", ("ffn", "router"), LINEAR)
            b(M + "gate.e_score_correction_bias", ("ffn", "router_bias"), SAME, optional_leaf=True)
            if cfg.moe.latent_dim:
                b(M + "routed_expert_down_proj.weight", ("ffn", "down"), LINEAR)
                b(M + "routed_expert_up_proj.weight", ("ffn", "up"), LINEAR)
                if cfg.moe.latent_norm:
                    b(M + "routed_expert_norm.weight", ("ffn", "latent_norm", "weight"), SAME)
            names = ({"w_gate": "w1", "w_down": "w2", "w_up": "w3"} if fam == "kimi"
                     else {"w_gate": "gate_proj", "w_down": "down_proj", "w_up": "up_proj"})
            for e in range(cfg.moe.num_experts):
                for leaf, hf in names.items():
                    b(f"{M}experts.{e}.{hf}", ("ffn", leaf), LINEAR, (e,), expert=True)
            if cfg.moe.num_shared_experts:
                for x in ("gate", "up", "down"):
                    b(f"{M}shared_experts.{x}_proj.weight", ("ffn", "shared", f"w_{x}"), LINEAR)
    out.append(Binding(top + "norm.weight", ("final_norm", "weight"), (), SAME))
    if cfg.attn_res.enabled:
        out.append(Binding(top + "output_attn_res_proj.weight", ("final_res_mix", "query"), (), ROW))
        out.append(Binding(top + "output_attn_res_norm.weight", ("final_res_mix", "norm"), (), SAME))
    if not cfg.tie_embeddings:
        out.append(Binding(prefix + "lm_head.weight", ("lm_head",), (), LINEAR))
    return out



# ---------------------------------------------------------------------------------------------
# Orientation conversions


def hf_to_block(kind: str, x: np.ndarray, block_shape: tuple[int, ...]) -> np.ndarray:
    """An HF tensor -> the k3jax block of shape ``block_shape``."""
    if kind in (SAME, FLAT, ROW):
        if math.prod(x.shape) != math.prod(block_shape) or (kind == SAME and x.shape != block_shape):
            raise ValueError(f"expected {block_shape}, got {x.shape}")
        return x.reshape(block_shape)
    if kind in (LINEAR, LINEAR_IN2):
        if x.ndim != 2:
            raise ValueError(f"expected a 2-D linear weight, got shape {x.shape}")
        return x.T.reshape(block_shape)
    if kind == CONV:
        if x.ndim != 3 or x.shape[1] != 1:
            raise ValueError(f"expected a depthwise conv weight [C, 1, W], got shape {x.shape}")
        return x[:, 0, :].T.reshape(block_shape)
    if kind == A_LOG:
        (h,) = block_shape
        flat = x.reshape(-1)
        if flat.shape[0] < h:
            raise ValueError(f"A_log has {flat.shape[0]} entries, need {h} (one per head)")
        if np.any(flat[h:].astype(np.float32) != 0):
            warnings.warn(f"A_log holds {flat.shape[0]} entries with nonzero padding beyond the first {h} heads; "
                          "only the first num_heads are used", stacklevel=4)
        return flat[:h]
    raise ValueError(kind)


def block_to_hf(kind: str, x: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
    """A k3jax block -> the HF tensor of shape ``hf_shape``."""
    if kind in (SAME, FLAT, ROW):
        return x.reshape(hf_shape)
    if kind == LINEAR:
        return x.reshape(x.shape[0], -1).T.reshape(hf_shape)
    if kind == LINEAR_IN2:
        return x.reshape(-1, x.shape[-1]).T.reshape(hf_shape)
    if kind == CONV:
        return x.reshape(x.shape[0], -1).T[:, None, :].reshape(hf_shape)
    if kind == A_LOG:
        out = np.zeros(math.prod(hf_shape), x.dtype)
        out[: x.shape[0]] = x
        return out.reshape(hf_shape)
    raise ValueError(kind)


def hf_shape_of(kind: str, block_shape: tuple[int, ...], cfg: ModelConfig, model_type: str) -> tuple[int, ...]:
    """The HF tensor shape of a k3jax block of ``block_shape`` in ``model_type``'s layout."""
    if kind == SAME:
        return tuple(block_shape)
    if kind == FLAT:
        return (math.prod(block_shape),)
    if kind == ROW:
        return (1, math.prod(block_shape))
    if kind == LINEAR:
        return (math.prod(block_shape[1:]), block_shape[0])
    if kind == LINEAR_IN2:
        return (block_shape[-1], math.prod(block_shape[:-1]))
    if kind == CONV:
        return (math.prod(block_shape[1:]), 1, block_shape[0])
    if kind == A_LOG:
        h = cfg.kda.num_heads
        if model_type == "kimi_k3":
            return (max(cfg.kda.head_dim, h),)  # the release zero-pads A_log to [head_dim]
        return (1, 1, h, 1)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------
# Names in a checkpoint

# Tensors a checkpoint may hold that the language model has no place for by design: rotary caches,
# the vision tower (placed separately, k3jax/vision/weights.py) and multi-token-prediction modules.
SKIPPED = [re.compile(p) for p in (r"(^|\.)rotary_emb\.", r"^vision_tower\.", r"^mm_projector\.",
                                   r"^(language_model\.)?mtp\.", r"^model\.mtp\.")]
LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")


def canonical_name(name: str) -> str:
    """Aliases collapse to one spelling: transformers' in-memory ``forget_gate.`` submodule, and
    ``block_sparse_moe.`` vs ``mlp.`` (transformers 5 saves Kimi Linear's dense layer 0 as
    ``block_sparse_moe.gate_proj``, the hub has ``mlp.gate_proj``)."""
    name = name.replace(".self_attn.forget_gate.", ".self_attn.")
    return name.replace(".block_sparse_moe.", ".mlp.")


def split_part(name: str) -> tuple[str, str]:
    """``x.weight_packed`` / ``x.weight_scale`` (MXFP4, INT4) / ``x.weight_shape`` (INT4) /
    ``x.weight_scale_inv`` (fp8) -> (``x.weight``, part); any other name -> (name, "value")."""
    for suffix, part in ((".weight_packed", "packed"), (".weight_scale_inv", "scale_inv"), (".weight_scale", "scale"),
                         (".weight_shape", "shape")):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", part
    return name, "value"


__all__ = ["A_LOG", "CONV", "FLAT", "LANGUAGE_MODEL_PREFIX", "LAYER_RE", "LINEAR", "LINEAR_IN2", "ROW", "SAME",
           "SKIPPED", "DEEPSEEK_TYPES", "Binding", "bindings", "block_to_hf", "canonical_name", "hf_shape_of", "hf_to_block",
           "split_part"]

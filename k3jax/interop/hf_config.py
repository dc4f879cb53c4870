"""Hugging Face ``config.json`` -> k3jax ``ModelConfig`` (``config_from_hf``), and what reading and writing
share: the model types, the keys carried through unchanged, and when two configs are the same maths
(``runtime_fields_equal``). The other direction is ``k3jax.interop.hf_config_export``.

Supported model types (the config.json of each release):

- ``kimi_k3``: the multimodal release; the text model is ``text_config`` (itself ``kimi_linear``
  with K3 extras: ``hidden_act: situ``, ``attn_res_block_size``, ``linear_attn_config.
  gate_lower_bound`` / ``use_full_rank_gate``, ``mla_use_output_gate``,
  ``routed_expert_hidden_size``, ``latent_moe_use_norm``) and weights live under
  ``language_model.``;
- ``kimi_linear``: Kimi Linear 48B (and text-only K3 derivatives);
- ``deepseek_v3`` / ``kimi_k2``: the DeepSeek-V3 layout of Kimi K2;
- ``kimi_k25``: Kimi K2.5 / K2.6 (transformers' ``kimi_k25``): the K2 text model as ``text_config``
  (``deepseek_v3``, or ``kimi_k2`` in the hub's files), weights under ``language_model.``, and K2.5's
  MoonViT as ``vision_config`` (mapped onto k3jax/vision's switches, off unless asked for).

Quantized releases (``quantization_config``): compressed-tensors ``mxfp4-pack-quantized`` (K3's
experts) and ``pack-quantized`` INT4 (K2 Thinking's experts, ``k3jax.interop.compressed_tensors``),
DeepSeek block ``fp8`` (K2). They are decoded on load, or kept compressed (``from_hf(keep_quantized=True)``).

Every field that changes the maths is either mapped or refused with a :class:`HFConfigError`
that names it; fields without effect on the forward pass (token ids, ``use_cache``, ...) are
ignored on import and carried through ``extra`` for export.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from typing import Any

from k3jax.config import ModelConfig, TrainConfig, from_dict, parse_overrides, without_runtime_fields
from k3jax.config.loading import merge_nested
from k3jax.interop.compressed_tensors import CompressedTensorsError, PackQuantized, parse_config
from k3jax.interop.hf_names import DEEPSEEK_TYPES

MODEL_TYPES = ("kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2", "kimi_k25")
# K2.5's MoonViT in the release vision_config's terms (k3jax.vision.weights.vision_config_from_hf): the
# switches that tell it from K3's MoonViT-V2 (VisionConfig's docstring), and transformers' names of its widths
K25_VISION_SWITCHES = {"norm_type": "layernorm", "attn_bias": True, "pos_emb_interpolation_mode": "bicubic",
                       "mm_projector_type": "patchmerger"}
K25_VISION_KEYS = {"hidden_size": "vt_hidden_size", "num_attention_heads": "vt_num_attention_heads",
                   "num_hidden_layers": "vt_num_hidden_layers", "intermediate_size": "vt_intermediate_size",
                   "pos_emb_height": "init_pos_emb_height", "pos_emb_width": "init_pos_emb_width"}
K25_VISION_DEFAULTS = {"vt_hidden_size": 1152, "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
                       "vt_intermediate_size": 4304, "init_pos_emb_height": 64, "init_pos_emb_width": 64}
# MLA's q_a_layernorm / kv_a_layernorm: the HF modeling code (kimi_linear, deepseek_v3, K3's
# release code) constructs them without an eps argument, i.e. the RMSNorm default.
HF_MLA_NORM_EPS = 1e-6
# Keys carried from an imported config to an export (no effect on the maths).
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "ignore_index", "image_placeholder",
                 "media_placeholder_token_id")
_CARRIED_ATTR = "hf_carried_config"  # where a loaded model keeps them (carry_config)


class HFConfigError(ValueError):
    """A Hugging Face config that k3jax cannot represent exactly; the message names the field."""


@dataclasses.dataclass
class HFInfo:
    """What ``config_from_hf`` learned besides the ModelConfig."""

    model_type: str
    weight_prefix: str = ""  # "language_model." for the multimodal kimi_k3 release (detected from keys)
    mxfp4: bool = False  # routed experts stored as compressed-tensors mxfp4-pack-quantized
    fp8_block: tuple[int, int] | None = None  # DeepSeek-style fp8 block quantization
    int4: PackQuantized | None = None  # compressed-tensors pack-quantized INT4 weights
    num_mtp_layers: int = 0  # next-token-prediction modules present in the checkpoint (skipped)
    has_vision: bool = False  # vision_config present (vision weights are skipped)
    extra: dict = dataclasses.field(default_factory=dict)  # carried keys (token ids, ...)


def _refuse(field: str, msg: str):
    raise HFConfigError(f"{field}: {msg}")


def _get(d: dict, *names, default=None):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def model_type_of(hf: dict) -> str:
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFConfigError(f"model_type: {mt!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    return mt


def _layout_fields(n: int, mla: set[int]) -> dict:
    """The compact ModelConfig layout fields for a set of 0-based MLA layer indices."""
    if not mla:
        return {"layout": "kda"}
    if len(mla) == n:
        return {"layout": "mla"}
    for period in range(2, n + 1):
        for last in (True, False):
            s = {i for i in range(n) if (i + 1) % period == 0 or (last and i == n - 1)}
            if s == mla:
                return {"layout": "hybrid", "mla_period": period, "last_layer_mla": last}
    return {"layout": "hybrid", "mla_layers": sorted(mla)}


def _mla_layers(t: dict, n: int, model_type: str) -> set[int]:
    """0-based indices of the full-attention (MLA) layers."""
    if model_type in DEEPSEEK_TYPES:
        return set(range(n))
    lac = t.get("linear_attn_config") or {}
    if "full_attn_layers" in lac or "kda_layers" in lac:
        full = [int(i) - 1 for i in lac.get("full_attn_layers") or []]  # 1-based in the checkpoint
        kda = [int(i) - 1 for i in lac.get("kda_layers") or []]
        if sorted(full + kda) != list(range(n)):
            _refuse("linear_attn_config", f"full_attn_layers + kda_layers (1-based) must cover layers 1..{n} "
                    "exactly once")
        return set(full)
    types = t.get("layer_types")
    if types is not None:
        if len(types) != n or any(x not in ("full_attention", "linear_attention") for x in types):
            _refuse("layer_types", f"expected {n} entries of 'full_attention' / 'linear_attention'")
        return {i for i, x in enumerate(types) if x == "full_attention"}
    # transformers' KimiLinearConfig default
    return {i for i in range(n) if i and i % 4 == 0}


def _first_dense(t: dict, n: int) -> int:
    mlp_types = t.get("mlp_layer_types")
    k = int(_get(t, "first_k_dense_replace", default=1 if mlp_types is None else 0))
    if mlp_types is not None:
        dense = [x == "dense" for x in mlp_types]
        k = sum(dense)
        if len(mlp_types) != n or dense != [i < k for i in range(n)]:
            _refuse("mlp_layer_types", "only a dense prefix followed by MoE layers is supported")
    freq = _get(t, "moe_layer_freq", default=1)
    if freq != 1:
        _refuse("moe_layer_freq", f"only 1 (every layer after the dense prefix is MoE) is supported, got {freq}")
    return min(k, n)


def _rope(t: dict) -> dict:
    """MLA rope fields for deepseek_v3 / kimi_k2 (HF 5 ``rope_parameters`` or legacy ``rope_scaling``)."""
    params = dict(t.get("rope_parameters") or {})
    legacy = t.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    theta = float(_get(params, "rope_theta", default=_get(t, "rope_theta", default=10000.0)))
    rtype = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse("rope_parameters.partial_rotary_factor", "must be 1")
    out = {"rope_theta": theta, "rope_interleave": bool(t.get("rope_interleave", True))}
    if rtype == "default":
        return {**out, "rope": "rope"}
    if rtype != "yarn":
        _refuse("rope_parameters.rope_type", f"only 'default' and 'yarn' are supported, got {rtype!r}")
    if params.get("truncate", True) is not True:
        _refuse("rope_parameters.truncate", "only the truncated YaRN correction range is supported")
    max_pos = _get(t, "max_position_embeddings")
    orig = _get(params, "original_max_position_embeddings", default=max_pos)
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / orig
    yarn = {"factor": float(factor), "original_max_position": int(orig),
            "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0),
            # HF uses mscale only when both mscale and mscale_all_dim are set; k3jax's YarnConfig does the
            # same with mscale = 0 meaning "absent"
            "mscale": float(params.get("mscale") or 0.0), "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0)}
    if params.get("attention_factor") is not None:
        from k3jax.config import YarnConfig
        from k3jax.ops.rope import rope_frequencies

        dim = int(t.get("qk_rope_head_dim", 64))
        _, computed = rope_frequencies(dim, theta, YarnConfig(**yarn))
        if not math.isclose(float(params["attention_factor"]), computed, rel_tol=1e-6):
            _refuse("rope_parameters.attention_factor", f"an explicit attention factor {params['attention_factor']} "
                    f"different from YaRN's {computed} is not supported")
    return {**out, "rope": "yarn", "yarn": yarn}


def _quantization(q: dict | None, info: HFInfo) -> None:
    if not q:
        return
    method = q.get("quant_method")
    fmt = q.get("format")
    if method == "compressed-tensors" and fmt == "pack-quantized":
        try:
            info.int4 = parse_config(q)
        except CompressedTensorsError as err:
            raise HFConfigError(str(err)) from None
        return
    if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
        for name, group in (q.get("config_groups") or {}).items():
            w = (group or {}).get("weights") or {}
            if group.get("format", fmt) != "mxfp4-pack-quantized" or w.get("num_bits", 4) != 4 or \
                    w.get("group_size", 32) != 32 or w.get("type", "float") != "float":
                _refuse(f"quantization_config.config_groups.{name}", "only 4-bit float (E2M1) weights in groups of 32 "
                        "are supported")
            if group.get("input_activations") is not None:
                warnings.warn("quantization_config: input activation quantization (MXFP8 at run time) is not "
                              "applied by from_hf; weights are decoded exactly", stacklevel=3)
        info.mxfp4 = True
        return
    if method == "fp8":
        block = q.get("weight_block_size")
        if not block or len(block) != 2 or q.get("fmt", "e4m3") != "e4m3":
            _refuse("quantization_config", "only block-wise e4m3 fp8 (weight_block_size [bo, bi]) is supported")
        info.fp8_block = (int(block[0]), int(block[1]))
        return
    _refuse("quantization_config", f"quant_method={method!r} format={fmt!r} is not supported (supported: "
            "compressed-tensors mxfp4-pack-quantized and pack-quantized (INT4), fp8 block-wise)")


def config_from_hf(hf: dict, *, dtype: str | None = None, overrides=()) -> tuple[ModelConfig, HFInfo]:
    """A HF ``config.json`` dict -> (``ModelConfig``, ``HFInfo``).

    ``dtype`` ("float32" / "bfloat16") sets both the parameter and the compute dtype; ``overrides``
    are dotted ``key=value`` strings applied to the model config (e.g. ``"kda.chunk_size=16"``).
    """
    mt = model_type_of(hf)
    info = HFInfo(model_type=mt)
    t = hf
    if mt in ("kimi_k3", "kimi_k25"):
        if not isinstance(hf.get("text_config"), dict):
            _refuse("text_config", f"a {mt} config needs a text_config mapping")
        t = hf["text_config"]
        info.has_vision = bool(hf.get("vision_config"))
        text_types = ("kimi_linear",) if mt == "kimi_k3" else ("deepseek_v3", "kimi_k2")
        if t.get("model_type", text_types[0]) not in text_types:
            _refuse("text_config.model_type", f"expected {' or '.join(map(repr, text_types))}, got {t.get('model_type')!r}")
    for k in _CARRIED_KEYS:
        if k in hf:
            info.extra[k] = hf[k]
        elif k in t:
            info.extra[k] = t[k]
    _quantization(hf.get("quantization_config") or t.get("quantization_config"), info)
    kimi = mt in ("kimi_k3", "kimi_linear")

    n = int(t["num_hidden_layers"])
    d = int(t["hidden_size"])
    if t.get("attention_bias"):
        _refuse("attention_bias", "biases in attention projections are not supported")
    if t.get("mlp_bias"):
        _refuse("mlp_bias", "biases in MLPs are not supported")
    act = t.get("hidden_act", "silu")
    if act == "situ":
        activation = {"activation": "situ_glu", "situ_beta": float(t.get("activation_situ_beta", 4.0)),
                      "situ_linear_beta": float(t.get("activation_situ_linear_beta", 25.0))}
    elif act == "silu":
        activation = {"activation": "swiglu"}
    else:
        _refuse("hidden_act", f"only 'silu' (SwiGLU) and 'situ' (SiTU-GLU) are supported, got {act!r}")
    eps = float(t.get("rms_norm_eps", 1e-6))
    mla_layers = _mla_layers(t, n, mt)

    # KDA ----------------------------------------------------------------------------------
    lac = t.get("linear_attn_config") or {}
    kda_heads = int(_get(lac, "num_heads", default=_get(t, "linear_num_heads", default=32)))
    kda_dim = int(_get(lac, "head_dim", default=_get(t, "linear_head_dim", default=128)))
    for key in ("num_v_heads", "expand_v"):
        if lac.get(key) not in (None, kda_heads if key == "num_v_heads" else 1):
            _refuse(f"linear_attn_config.{key}", "grouped-value / expanded-value KDA is not supported")
    if lac.get("allow_neg_eigval"):
        _refuse("linear_attn_config.allow_neg_eigval", "negative eigenvalues (beta in (0, 2)) are not supported")
    lower = lac.get("gate_lower_bound")
    kda = {"num_heads": kda_heads, "head_dim": kda_dim,
           "conv_size": int(_get(lac, "short_conv_kernel_size", default=_get(t, "linear_conv_kernel_dim", default=4))),
           "gate": "softplus" if lower is None else "lower_bound",
           "output_gate": "full" if lac.get("use_full_rank_gate") else "low_rank",
           "norm_eps": eps}
    if lower is not None:
        kda["gate_lower_bound"] = float(lower)

    # MLA ----------------------------------------------------------------------------------
    heads = int(t.get("num_attention_heads", 32))
    kv_heads = _get(t, "num_key_value_heads", default=heads)
    if int(kv_heads) != heads:
        _refuse("num_key_value_heads", f"MLA needs num_key_value_heads == num_attention_heads ({heads}), got {kv_heads}")
    mla = {"num_heads": heads, "q_lora_rank": int(t.get("q_lora_rank") or 0),
           "kv_lora_rank": int(t.get("kv_lora_rank", 512)), "qk_nope_head_dim": int(t.get("qk_nope_head_dim", 128)),
           "qk_rope_head_dim": int(t.get("qk_rope_head_dim", 64)), "v_head_dim": int(t.get("v_head_dim", 128)),
           "output_gate": bool(t.get("mla_use_output_gate", False)), "norm_eps": HF_MLA_NORM_EPS}
    if kimi:
        if t.get("mla_use_nope", True) is not True:
            _refuse("mla_use_nope", "Kimi MLA layers are NoPE; mla_use_nope=false (rotary MLA) is not supported "
                    "for kimi_linear / kimi_k3")
        mla["rope"] = "none"
    else:
        if t.get("mla_use_output_gate"):
            _refuse("mla_use_output_gate", "not a DeepSeek-V3 field")
        mla.update(_rope(t))

    # MoE ----------------------------------------------------------------------------------
    n_dense = _first_dense(t, n)
    num_experts = _get(t, "num_experts", "n_routed_experts", "num_local_experts", default=0)
    top_k = _get(t, "num_experts_per_token", "num_experts_per_tok", default=1)
    moe: dict[str, Any] = {}
    if n_dense < n:
        scoring = _get(t, "moe_router_activation_func", "scoring_func", default="sigmoid")
        if scoring != "sigmoid":
            _refuse("scoring_func", f"only sigmoid routing is supported, got {scoring!r}")
        topk_method = t.get("topk_method", "noaux_tc")
        if topk_method not in ("noaux_tc", None):
            _refuse("topk_method", f"only 'noaux_tc' (bias-corrected sigmoid top-k) is supported, got {topk_method!r}")
        groups = int(_get(t, "num_expert_group", "n_group", default=1))
        topk_group = int(_get(t, "topk_group", default=groups))
        if groups > 1 and topk_group < groups:
            _refuse("n_group/topk_group", f"group-limited routing (n_group={groups}, topk_group={topk_group}) "
                    "changes which experts can be selected and is not supported")
        moe = {"num_experts": int(num_experts), "top_k": int(top_k),
               "num_shared_experts": int(_get(t, "num_shared_experts", "n_shared_experts", default=0)),
               "expert_dim": int(t["moe_intermediate_size"]),
               "latent_dim": int(t.get("routed_expert_hidden_size") or 0),
               "latent_norm": bool(t.get("latent_moe_use_norm", True)),
               "routed_scaling_factor": float(_get(t, "routed_scaling_factor", default=1.0)),
               "router_bias": True,
               "renormalize": bool(_get(t, "moe_renormalize", "norm_topk_prob", default=True))}
    mtp = int(_get(t, "num_nextn_predict_layers", "num_mtp_layers", default=0))
    if mtp:
        info.num_mtp_layers = mtp
        warnings.warn(f"num_nextn_predict_layers={mtp}: k3jax has no multi-token-prediction module; "
                      "MTP weights are skipped", stacklevel=2)

    max_pos = int(_get(t, "max_position_embeddings", "model_max_length", default=4096))
    model: dict[str, Any] = {
        "vocab_size": int(t["vocab_size"]), "hidden_size": d, "num_layers": n,
        **_layout_fields(n, mla_layers),
        "first_dense_layers": n_dense,
        "dense_ffn_dim": int(t.get("intermediate_size", 4 * d)),
        **activation,
        "norm_eps": eps,
        "tie_embeddings": bool(_get(hf, "tie_word_embeddings", default=_get(t, "tie_word_embeddings", default=False))),
        "init_std": float(t.get("initializer_range", 0.02)),
        "max_seq_len": max_pos,
        "attn_res": ({"enabled": True, "block_size": int(t["attn_res_block_size"]), "eps": eps}
                     if t.get("attn_res_block_size") else {"enabled": False}),
    }
    if len(mla_layers) < n:
        model["kda"] = kda
    if mla_layers:
        model["mla"] = mla
    if moe:
        model["moe"] = moe
    if info.int4 is not None:  # what from_hf(keep_quantized=True) holds the experts with
        model["quant"] = {"int4_group_size": info.int4.group_size}
    elif info.fp8_block is not None:
        model["quant"] = {"fp8_block": list(info.fp8_block)}
    if info.has_vision:  # mapped but off: a text model unless overrides say vision.enabled=true
        from k3jax.vision.weights import vision_config_from_hf

        vc = hf["vision_config"] if mt == "kimi_k3" else _k25_vision_config(hf)
        model["vision"] = {**vision_config_from_hf(vc, d), "enabled": False,
                           "media_pad_id": int(hf.get("media_placeholder_token_id", 163605))}
    if dtype is not None:
        model["dtype"] = model["param_dtype"] = _dtype_name(dtype)
    cfg = _build(model, overrides)
    if info.has_vision and not cfg.vision.enabled:
        warnings.warn(f"{mt} vision_config: the vision tower and projector are not loaded (text model only; "
                      "pass overrides=['vision.enabled=true'] to load them)", stacklevel=2)
    return cfg, info


def _k25_vision_config(hf: dict) -> dict:
    """A kimi_k25 ``vision_config`` (transformers' key names, or the release's ``vt_*`` ones) -> the release
    vision_config that ``vision_config_from_hf`` reads, with K2.5's switches and its projector eps."""
    vc = dict(hf["vision_config"])
    for name, release in K25_VISION_KEYS.items():
        if name in vc:
            vc.setdefault(release, vc[name])
    for key, value in {**K25_VISION_DEFAULTS, **K25_VISION_SWITCHES}.items():
        vc.setdefault(key, value)
    if hf.get("projection_hidden_size") not in (None, vc["vt_hidden_size"]):
        _refuse("projection_hidden_size", f"the patchmerger pre-norm is as wide as the tower ({vc['vt_hidden_size']}), "
                f"got {hf['projection_hidden_size']}")
    vc.setdefault("projector_ln_eps", float(hf.get("projection_layer_norm_eps", 1e-5)))
    return vc


def _dtype_name(dtype) -> str:
    import numpy as np

    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {name}")
    return name


def _build(model: dict, overrides) -> ModelConfig:
    if overrides:
        extra = parse_overrides(list(overrides))
        extra = extra.get("model", extra)
        model = merge_nested(model, extra)
    # validated as a run config whose rows fit the context (a tiny model's may be under the default row)
    seq_len = min(TrainConfig.seq_len, model.get("max_seq_len", TrainConfig.seq_len))
    return from_dict({"name": "hf", "model": model, "train": {"seq_len": seq_len}}).model


# Model fields an HF config does not carry (besides the runtime fields of k3jax.config): how the weights
# are laid out and stored, and the training-time rule of the router bias.
_NOT_IN_HF = ("scan_layers", "dtype", "param_dtype")
_MOE_NOT_IN_HF = ("balancing", "qb_method", "qb_bins")


def runtime_fields_equal(a: ModelConfig, b: ModelConfig) -> bool:
    """Whether two configs describe the same maths: equal but for runtime fields
    (``k3jax.config.runtime_fields``), fields an HF config does not carry and the spelling of the layout."""
    def strip(c: ModelConfig) -> dict:
        d = without_runtime_fields(c)
        for k in _NOT_IN_HF:  # checkpoint layout and precision: a choice of the loader (config_from_hf)
            d.pop(k)
        d["mixers"] = [c.mixer(i) for i in range(c.num_layers)]  # the layout, however it is spelled
        for k in ("layout", "mla_period", "last_layer_mla", "mla_layers"):
            d.pop(k)
        d["moe"] = {k: v for k, v in d["moe"].items() if k not in _MOE_NOT_IN_HF}
        if not c.uses("kda"):
            d.pop("kda")
        if not c.uses("mla"):
            d.pop("mla")
        if c.first_dense_layers == c.num_layers:
            d.pop("moe")
        if not c.attn_res.enabled:
            d["attn_res"] = {"enabled": False}
        if not c.vision.enabled:
            d["vision"] = {"enabled": False}
        return d

    return strip(a) == strip(b)


def carry_config(model, extra: dict) -> None:
    """Keep ``extra`` (the carried keys of the config.json ``model`` was loaded from) on the model,
    so that ``to_hf`` writes them back. Stored as a JSON string: a static, hashable attribute of the
    model's graph, so it follows the model through ``nnx.split`` / ``merge`` and is no part of its
    state (a checkpoint does not hold it; ``k3jax.convert --tokenizer-from`` supplies the token ids)."""
    setattr(model, _CARRIED_ATTR, json.dumps(extra, sort_keys=True))


def carried_config(model) -> dict:
    """The keys ``carry_config`` kept on ``model`` ({} for a model not loaded by ``from_hf``)."""
    return json.loads(getattr(model, _CARRIED_ATTR, "{}"))


__all__ = ["HF_MLA_NORM_EPS", "HFConfigError", "HFInfo", "MODEL_TYPES", "carried_config", "carry_config",
           "config_from_hf", "model_type_of", "runtime_fields_equal"]

"""k3jax ``ModelConfig`` -> Hugging Face ``config.json`` in the official layout of a model type
(``config_to_hf``), and whether a config can be written as one without changing the maths
(``check_exportable``: every field the layout cannot express is refused, naming it). The reading side is
``k3jax.interop.hf_config``."""

from __future__ import annotations

from typing import Any

from k3jax.config import ModelConfig
from k3jax.interop.hf_config import HF_MLA_NORM_EPS, MODEL_TYPES, HFConfigError


def check_exportable(cfg: ModelConfig, model_type: str) -> None:
    """Raise HFConfigError if ``cfg`` cannot be written as ``model_type`` without changing the maths."""
    if model_type not in MODEL_TYPES:
        raise HFConfigError(f"model_type: {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    uses_kda, uses_mla = cfg.uses("kda"), cfg.uses("mla")
    uses_moe = cfg.first_dense_layers < cfg.num_layers

    def need(cond, field, msg):
        if not cond:
            raise HFConfigError(f"{field}: {msg} (cannot export as {model_type})")

    if uses_mla:
        need(cfg.mla.norm_eps == HF_MLA_NORM_EPS, "mla.norm_eps",
             f"the HF modeling code fixes the MLA latent norms' eps at {HF_MLA_NORM_EPS}")
    if uses_moe:
        need(cfg.moe.num_shared_experts >= 1, "moe.num_shared_experts", "HF layouts always have shared experts")
    if uses_kda:
        need(cfg.kda.norm_eps == cfg.norm_eps, "kda.norm_eps", "the output norm uses rms_norm_eps")
        need(cfg.kda.conv_size > 0, "kda.conv_size", "the HF layer always has the short convolution")
        need(cfg.kda.gate_rank in (0, cfg.kda.head_dim), "kda.gate_rank", "the HF gate rank is head_dim")
        need(cfg.kda.output_gate != "none", "kda.output_gate", "the HF layer always has an output gate")
    need(model_type != "kimi_k25", "model_type", "kimi_k25 is read, not written: export the text model as kimi_k2")
    if model_type in ("deepseek_v3", "kimi_k2"):
        need(not uses_kda, "layout", "DeepSeek-V3 has MLA layers only")
        need(cfg.mla.rope in ("rope", "yarn"), "mla.rope", "DeepSeek-V3 always rotates the rope dims")
        need(not cfg.mla.output_gate, "mla.output_gate", "DeepSeek-V3 has no attention output gate")
    else:
        if uses_mla:
            need(cfg.mla.rope == "none", "mla.rope", "Kimi MLA layers are NoPE")
    if model_type in ("deepseek_v3", "kimi_k2", "kimi_linear"):
        need(cfg.activation == "swiglu", "activation", "SiTU-GLU needs the kimi_k3 layout")
        need(not cfg.attn_res.enabled, "attn_res.enabled", "Block AttnRes needs the kimi_k3 layout")
        if uses_moe:
            need(cfg.moe.latent_dim == 0, "moe.latent_dim", "LatentMoE needs the kimi_k3 layout")
    if model_type == "kimi_linear":
        if uses_kda:
            need(cfg.kda.gate == "softplus", "kda.gate", "transformers' kimi_linear has the softplus gate only")
            need(cfg.kda.output_gate == "low_rank", "kda.output_gate", "transformers' kimi_linear has a low-rank gate")
        if uses_mla:
            need(not cfg.mla.output_gate, "mla.output_gate", "transformers' kimi_linear has no MLA output gate")
    if cfg.vision.enabled:
        need(model_type == "kimi_k3", "vision.enabled", "the vision tower is part of the kimi_k3 layout only")
    if model_type == "kimi_k3" and cfg.attn_res.enabled:
        need(cfg.attn_res.eps == cfg.norm_eps, "attn_res.eps", "K3 uses rms_norm_eps for the AttnRes norms")


def _moe_fields(cfg: ModelConfig, kimi: bool) -> dict:
    m = cfg.moe
    if kimi:
        out = {"num_experts": m.num_experts, "num_experts_per_token": m.top_k, "num_shared_experts": m.num_shared_experts,
               "moe_intermediate_size": m.expert_dim, "moe_router_activation_func": "sigmoid",
               "moe_renormalize": m.renormalize, "routed_scaling_factor": m.routed_scaling_factor,
               "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1}
        if m.latent_dim:
            out.update(routed_expert_hidden_size=m.latent_dim, latent_moe_use_norm=m.latent_norm)
        return out
    return {"n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k, "n_shared_experts": m.num_shared_experts,
            "moe_intermediate_size": m.expert_dim, "scoring_func": "sigmoid", "norm_topk_prob": m.renormalize,
            "routed_scaling_factor": m.routed_scaling_factor, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1}


def _mla_fields(cfg: ModelConfig) -> dict:
    c = cfg.mla
    return {"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_heads,
            "q_lora_rank": c.q_lora_rank or None, "kv_lora_rank": c.kv_lora_rank,
            "qk_nope_head_dim": c.qk_nope_head_dim, "qk_rope_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim}


def _kimi_text_config(cfg: ModelConfig, model_type: str, dtype: str) -> dict:
    n = cfg.num_layers
    full = [i + 1 for i in range(n) if cfg.mixer(i) == "mla"]
    kda = [i + 1 for i in range(n) if cfg.mixer(i) == "kda"]
    lac: dict[str, Any] = {"full_attn_layers": full, "kda_layers": kda, "num_heads": cfg.kda.num_heads,
                           "head_dim": cfg.kda.head_dim, "short_conv_kernel_size": cfg.kda.conv_size}
    if cfg.kda.gate == "lower_bound":
        lac["gate_lower_bound"] = cfg.kda.gate_lower_bound
    if model_type == "kimi_k3" or cfg.kda.output_gate == "full":
        lac["use_full_rank_gate"] = cfg.kda.output_gate == "full"
    t: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": n,
        "intermediate_size": cfg.dense_ffn_dim, "first_k_dense_replace": cfg.first_dense_layers, "moe_layer_freq": 1,
        "hidden_act": "situ" if cfg.activation == "situ_glu" else "silu",
        "linear_attn_config": lac, **_mla_fields(cfg), "mla_use_nope": True,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std, "num_nextn_predict_layers": 0, "dtype": dtype,
    }
    if cfg.activation == "situ_glu":
        t.update(activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_linear_beta)
    if model_type == "kimi_k3":
        t["mla_use_output_gate"] = cfg.mla.output_gate
        t["max_position_embeddings"] = cfg.max_seq_len
        if cfg.attn_res.enabled:
            t["attn_res_block_size"] = cfg.attn_res.block_size
    else:
        t["model_max_length"] = cfg.max_seq_len
    if cfg.first_dense_layers < n:
        t.update(_moe_fields(cfg, kimi=True))
    return t


def mxfp4_quantization_config() -> dict:
    """The release's ``quantization_config`` (compressed-tensors, MXFP4 routed experts)."""
    weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "observer": "minmax", "scale_dtype": "torch.uint8", "zp_dtype": None,
               "actorder": None, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": None, "global_compression_ratio": None,
            "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                          "input_activations": None, "output_activations": None, "weights": weights}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def config_to_hf(cfg: ModelConfig, model_type: str = "kimi_k3", *, mxfp4: bool = False, extra: dict | None = None,
                 dtype: str = "bfloat16") -> dict:
    """``ModelConfig`` -> a HF ``config.json`` dict in the official layout of ``model_type``.

    ``mxfp4`` adds the release's ``quantization_config`` (kimi_k3 only); ``extra`` adds keys with
    no effect on the maths (token ids, ...); ``dtype`` is the ``dtype`` field written.
    """
    check_exportable(cfg, model_type)
    extra = dict(extra or {})
    if mxfp4 and model_type != "kimi_k3":
        raise HFConfigError(f"mxfp4: packed experts are only part of the kimi_k3 layout, not {model_type}")
    if model_type == "kimi_k3":
        t = _kimi_text_config(cfg, model_type, dtype)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if k in extra:
                t[k] = extra[k]
        out = {"architectures": ["KimiK3ForConditionalGeneration"],
               "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
               "model_type": "kimi_k3", "dtype": dtype, "tie_word_embeddings": cfg.tie_embeddings,
               **extra, "text_config": t}
        if mxfp4:
            q = mxfp4_quantization_config()
            out["quantization_config"] = q
            t["quantization_config"] = q
        if cfg.vision.enabled:
            from k3jax.vision.weights import vision_config_to_hf

            out["media_placeholder_token_id"] = cfg.vision.media_pad_id
            out["vision_config"] = vision_config_to_hf(cfg.vision, cfg.hidden_size)
        return out
    if model_type == "kimi_linear":
        t = _kimi_text_config(cfg, model_type, dtype)
        return {**t, **extra}
    # deepseek_v3 / kimi_k2
    c = cfg.mla
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": model_type,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
           "intermediate_size": cfg.dense_ffn_dim, "first_k_dense_replace": cfg.first_dense_layers, "moe_layer_freq": 1,
           "hidden_act": "silu", **_mla_fields(cfg), "rope_theta": c.rope_theta, "rope_interleave": c.rope_interleave,
           "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
           "initializer_range": cfg.init_std, "max_position_embeddings": cfg.max_seq_len,
           "num_nextn_predict_layers": 0, "attention_bias": False, "dtype": dtype}
    if c.rope == "yarn":
        y = c.yarn
        scaling = {"type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.original_max_position,
                   "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
        if y.mscale:
            scaling["mscale"] = y.mscale
        if y.mscale_all_dim:
            scaling["mscale_all_dim"] = y.mscale_all_dim
        out["rope_scaling"] = scaling
    if cfg.first_dense_layers < cfg.num_layers:
        out.update(_moe_fields(cfg, kimi=False))
    if model_type == "kimi_k2":
        out["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                           "AutoModel": "modeling_deepseek.DeepseekV3Model",
                           "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    return {**out, **extra}


__all__ = ["check_exportable", "config_to_hf", "mxfp4_quantization_config"]

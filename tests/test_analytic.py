"""k3jax.aot.analytic: the closed-form parameter counts equal the abstract model's leaves, part by part, for
every config and expert storage (and with LoRA adapters); the KDA FLOP formula equals what the compiled
chunkwise op does."""

import collections
import dataclasses
import math
import pathlib

import jax
import pytest
from flax import nnx

from k3jax.aot import analytic
from k3jax.aot import breakdown as bd
from k3jax.config import CONFIG_DIR, LoRAConfig, load_config
from k3jax.layers.lora import LoRAParam
from k3jax.model import DecoderLayer, abstract_model
from k3jax.quant.storage import QuantizedWeight

CONFIGS = sorted(p.stem for p in pathlib.Path(CONFIG_DIR).glob("*.yaml"))
EXPERTS = ("none", "mxfp4", "int4", "fp8_block", "mxfp4_qat")
# A MoE layer's parameters by name -> part (everything else under a dense layer's ``ffn`` is dense_ffn).
_MOE_PARTS = {"router": "router", "down": "latent_proj", "up": "latent_proj", "latent_norm": "latent_proj",
              "w_gate": "routed_experts", "w_up": "routed_experts", "w_down": "routed_experts",
              "shared": "shared_experts"}


def _leaf_part(path: tuple, kinds: dict) -> str:
    """The part of a leaf at ``path`` from where it sits in the model (``kinds``: each DecoderLayer's
    path -> its (mixer, ffn))."""
    for n in range(len(path), 0, -1):
        if path[:n] in kinds:
            mixer, ffn = kinds[path[:n]]
            name = path[n]
            if name in ("attn_res_mix", "ffn_res_mix"):
                return "attn_res"
            if name in ("mixer", "attn_norm"):
                return mixer
            if ffn == "dense":
                return "dense_ffn"
            return _MOE_PARTS[path[n + 1]] if name == "ffn" else "router"  # ffn_norm: the router's input
    return {"embed": "embedding", "final_res_mix": "attn_res", "vision_tower": "vision",
            "mm_projector": "vision"}.get(path[0], "lm_head_loss")  # final_norm, lm_head


def leaf_counts(model) -> dict[str, int]:
    """Logical weights per part: ``nnx.Param`` leaves by their size, a compressed weight by the dense
    shape it stands for (its codes and scales are not parameters), LoRA factors as ``lora``."""
    kinds = {tuple(p): v.kind for p, v in nnx.iter_graph(model) if isinstance(v, DecoderLayer)}
    out = collections.Counter()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, QuantizedWeight):
            out[_leaf_part(tuple(path), kinds)] += math.prod(node.shape)
        elif isinstance(node, LoRAParam):
            out["lora"] += math.prod(node.get_raw_value().shape)
        elif isinstance(node, nnx.Param):
            out[_leaf_part(tuple(path), kinds)] += math.prod(node.get_raw_value().shape)
    return dict(out)


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_params_by_part_equal_the_abstract_models_leaves(config, experts):
    cfg = load_config(config, [f"quant.experts={experts}"]).model
    model = abstract_model(cfg)
    if experts in ("mxfp4", "int4", "fp8_block"):  # the experts really are held compressed
        assert any(isinstance(n, QuantizedWeight) for _, n in nnx.iter_graph(model))
    assert analytic.params_by_part(cfg) == leaf_counts(model)


def test_params_by_part_are_storage_independent():
    dense = analytic.params_by_part(load_config("k3").model)
    assert analytic.params_by_part(load_config("k3", ["quant.experts=mxfp4"]).model) == dense
    assert dense["routed_experts"] == 92 * 896 * 3 * 3584 * 3072


# Variants the configs in configs/ do not cover: every KDA output gate, no conv, plain MLA query, no
# gate, no latent / shared experts / AttnRes, tied embeddings, unrolled layers, a K2.5-style vision tower.
VARIANTS = [
    ["model.kda.output_gate=low_rank", "model.kda.gate_rank=8", "model.kda.conv_size=0", "model.mla.q_lora_rank=0",
     "model.mla.output_gate=false"],
    ["model.kda.output_gate=none", "model.moe.latent_dim=0", "model.moe.num_shared_experts=0",
     "model.attn_res.enabled=false", "model.tie_embeddings=true", "model.scan_layers=false"],
    ["model.moe.latent_norm=false", "model.layout=kda", "model.first_dense_layers=0"],
    ["model.vision.enabled=true", "model.vision.norm=layernorm", "model.vision.bias=true",
     "model.vision.projector=patchmerger", "model.vision.num_layers=2", "model.vision.hidden_size=32",
     "model.vision.num_heads=2", "model.vision.head_dim=16", "model.vision.mlp_dim=48",
     "model.vision.pos_emb_size=8", "model.vision.media_begin_id=256", "model.vision.media_content_id=257",
     "model.vision.media_end_id=258", "model.vision.media_pad_id=259", "model.vocab_size=260"],
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_params_by_part_of_layer_variants(overrides):
    cfg = load_config("tiny", overrides).model
    assert analytic.params_by_part(cfg) == leaf_counts(abstract_model(cfg))


@pytest.mark.parametrize("config,targets", [("tiny", ("mla", "kda", "ffn", "shared")),
                                             ("tiny", ("mla.q_b", "kda.o_proj", "kda.g_proj", "shared.w_down")),
                                             ("kimi_linear_48b", ("mla", "kda", "ffn", "shared"))])
def test_lora_adapters_are_their_own_part(config, targets):
    cfg = load_config(config).model
    lora = LoRAConfig(rank=4, targets=targets)
    counts = analytic.params_by_part(cfg, lora)
    assert counts == leaf_counts(abstract_model(cfg, lora=lora))
    assert counts["lora"] > 0
    assert {p: n for p, n in counts.items() if p != "lora"} == analytic.params_by_part(cfg)
    assert analytic.active_params_by_part(cfg, lora)["lora"] == counts["lora"]


def test_lora_step_flops_skip_the_frozen_weight_gradients():
    """A LoRA step: 2 N forward + 2 N input gradients for the frozen weights, 6 N for the adapters, the token
    mixing at 3x its forward as in any step, and no Newton-Schulz (AdamW trains the adapters)."""
    full = load_config("tiny", ["train.optim.optimizer=muon"])
    tuned = load_config("tiny", ["train.lora.rank=4"])
    n = analytic.active_params_by_part(tuned.model, tuned.train.lora)
    adapters = n.pop("lora")
    tokens, seq = 1024, 128
    assert analytic.model_flops(full, tokens) == 6 * tokens * sum(n.values())
    assert analytic.model_flops(tuned, tokens) == 2 * tokens * (2 * sum(n.values()) + 3 * adapters)
    assert analytic.newton_schulz_flops(full) > 0 and analytic.newton_schulz_flops(tuned) == 0
    step, mixing = analytic.step_flops(tuned, tokens, seq), analytic.mixing_flops_per_token(tuned.model, seq)
    assert "newton_schulz" not in step
    assert step["kda"] == pytest.approx(tokens * (4 * n["kda"] + 3 * mixing["kda"]))
    assert step["lora"] == pytest.approx(tokens * 6 * adapters)
    assert analytic.model_flops(tuned, tokens, "decode") == 2 * tokens * sum(n.values())


def test_active_params_by_part():
    cfg = load_config("tiny").model
    total, active = analytic.params_by_part(cfg), analytic.active_params_by_part(cfg)
    assert "embedding" not in active  # a lookup
    assert active["routed_experts"] * cfg.moe.num_experts == total["routed_experts"] * cfg.moe.top_k
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    # the tied table is the head's matmul
    assert analytic.active_params_by_part(tied)["lm_head_loss"] == analytic.params_by_part(tied)["embedding"] + \
        cfg.hidden_size


def _kda_inputs(B, T, H, K, gate):
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(ks[i], (B, T, H, K)) for i in range(3))
    g = gate * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    return q, k, v, g, jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))


@pytest.mark.usefixtures("fast_xla_test")  # LLVM's optimisations only: the HLO passes are unchanged
@pytest.mark.parametrize("T,chunk,K", [(128, 64, 32), (40, 16, 8)])
def test_kda_flops_per_token_equal_the_compiled_chunkwise_op(T, chunk, K):
    """Every dot of the compiled ``chunk_kda`` forward (``k3jax.aot.breakdown``: the scan over chunks times
    its trip count, the exact diagonal path as the costlier branch) equals the analytic count, for a
    gate that needs the exact path (softplus) and hence for the dense one too, 4 B_c K per token less.
    (At least two chunks: with one, XLA folds the product with the zero initial state away.)"""
    from k3jax.ops.kda import chunk_kda

    B, H = 1, 2
    cfg = load_config("tiny", [f"model.kda.head_dim={K}", f"model.kda.chunk_size={chunk}",
                               "model.kda.gate=softplus"]).model
    c = analytic.kda_chunk_length(chunk, T)
    assert -(-T // c) >= 2
    hlo = jax.jit(lambda *a: chunk_kda(*a, chunk_size=chunk)[0]).lower(*_kda_inputs(B, T, H, K, -1.0))
    measured = bd.breakdown(hlo.compile().as_text()).total_flops
    padded = -(-T // c) * c  # the tail chunk is padded
    assert measured == analytic.kda_flops_per_token(cfg, T) * B * H * padded
    dense = dataclasses.replace(cfg, kda=dataclasses.replace(cfg.kda, gate="lower_bound"))
    assert analytic.kda_flops_per_token(cfg, T) - analytic.kda_flops_per_token(dense, T) == 4 * min(16, c) * K


def test_kda_dense_path_is_decided_by_the_gate_bound():
    k3 = load_config("k3").model
    assert analytic.kda_dense_diagonal(k3, 64)  # -5 x 16 = -80: dense, as kda_chunk.dense_ok decides
    steep = dataclasses.replace(k3, kda=dataclasses.replace(k3.kda, gate_lower_bound=-6.0))
    assert not analytic.kda_dense_diagonal(steep, 64)
    # K3: 6 C K + 4 C V + 6 K V + the inverse (C^2 + 16 C + 12 x 16^2) per head and token
    assert analytic.kda_flops_per_token(k3, 4096) == 188416
    assert analytic.kda_flops_per_token(k3, 4096, "decode") == 6 * 128 * 128


def test_mixing_flops_and_step_flops():
    cfg = load_config("tiny", ["model.num_layers=6", "model.mla_period=2"])
    m = cfg.model
    mix = analytic.mixing_flops_per_token(m, 64)
    assert mix["mla"] == 3 * m.mla.num_heads * 2 * (m.mla.qk_head_dim + m.mla.v_head_dim) * 32
    assert mix["kda"] == 3 * m.kda.num_heads * analytic.kda_flops_per_token(m, 64)
    step = analytic.step_flops(cfg, 128, 64)
    active = analytic.active_params_by_part(m)
    assert step["dense_ffn"] == 6 * active["dense_ffn"] * 128
    assert step["kda"] == (6 * active["kda"] + 3 * mix["kda"]) * 128
    assert step["newton_schulz"] == analytic.newton_schulz_flops(cfg) > 0
    decode = analytic.step_flops(cfg, 4, 1024, "decode")
    assert "newton_schulz" not in decode
    assert decode["mla"] == (2 * active["mla"] + 3 * m.mla.num_heads * 2 * (2 * m.mla.kv_lora_rank
                             + m.mla.qk_rope_head_dim) * 1024) * 4
    # a prefill chunk: the decode step's attention per token, KDA's full chunks
    prefill = analytic.mixing_flops_per_token(m, 1024, "prefill")
    assert prefill["mla"] == analytic.mixing_flops_per_token(m, 1024, "decode")["mla"]
    assert prefill["kda"] == analytic.mixing_flops_per_token(m, 1024, "train")["kda"]


@pytest.mark.slow  # importing torch and transformers: ~15 s on 2 busy cores
@pytest.mark.parametrize("config", ["tiny", "small"])
def test_torch_param_counts_are_the_analytic_counts_of_the_hf_model(config):
    """bench/common.torch_param_counts: k3jax's counts of the HF Kimi Linear model's config, equal to
    the torch model's own parameter count (it raises otherwise)."""
    import sys

    bench = pathlib.Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))
    try:
        from common import hf_kimi_linear_config, torch_param_counts
    finally:
        sys.path.remove(str(bench))
    import torch
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM(hf_kimi_linear_config(load_config(config).model))
    counts = torch_param_counts(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.get_input_embeddings().weight.numel()
    top_k, experts = model.config.num_experts_per_tok, model.config.num_local_experts
    assert counts["active"] == counts["total"] - routed + routed * top_k // experts - embed
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight[:-1].clone())  # one vocab row short
    with pytest.raises(ValueError, match="architectures differ"):
        torch_param_counts(model)


def test_params_cli_by_part(capsys):
    import json

    from k3jax.params import main

    main(["tiny", "--by-part", "train.lora.rank=4"])
    out = json.loads(capsys.readouterr().out)
    assert sum(out["by_part"].values()) == out["total"] + out["by_part"]["lora"]  # the totals leave adapters out
    assert sum(out["active_by_part"].values()) == out["active"] + out["by_part"]["lora"]
    assert out["by_part"]["lora"] == analytic.params_by_part(load_config("tiny").model, LoRAConfig(rank=4))["lora"]

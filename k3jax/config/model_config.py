"""The model's config: the decoder's layout and widths, and one dataclass per component (KDA, MLA,
MoE, Block AttnRes, quantization, vision). Every architectural choice of K3, K2 and Kimi Linear is
a field here."""

from __future__ import annotations

import dataclasses
from typing import Literal

from k3jax.config.fields import check, check_choices, runtime
from k3jax.quant.formats import DEFAULT_ACTIVATION_SCALE_RULE, DEFAULT_SCALE_RULE, GROUP_SIZE as MX_BLOCK, ScaleRule
from k3jax.quant.int4 import PER_WORD as INT4_PER_WORD


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (docs/design.md "KDA")."""

    num_heads: int = 4
    head_dim: int = 32  # K = V
    conv_size: int = 4  # short causal depthwise conv width; 0 disables it
    gate: Literal["lower_bound", "softplus"] = "lower_bound"
    gate_lower_bound: float = -5.0
    gate_rank: int = 0  # low-rank forget-gate projection d -> r -> H*K; 0 means r = head_dim
    output_gate: Literal["full", "low_rank", "none"] = "full"
    chunk_size: int = runtime(64)
    norm_eps: float = 1e-5

    def validate(self, prefix: str) -> None:
        check(self.num_heads > 0, f"{prefix}.num_heads", "must be positive")
        check(self.head_dim > 0, f"{prefix}.head_dim", "must be positive")
        check(self.conv_size >= 0, f"{prefix}.conv_size", "must be >= 0")
        check(self.gate_lower_bound < 0, f"{prefix}.gate_lower_bound", "must be negative")
        check(self.gate_rank >= 0, f"{prefix}.gate_rank", "must be >= 0")
        check(self.chunk_size > 0, f"{prefix}.chunk_size", "must be positive")

    @property
    def rank(self) -> int:
        return self.gate_rank or self.head_dim


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling as in DeepSeek-V3 / Kimi K2 (factor 1 = plain RoPE)."""

    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Gated multi-head latent attention (README "The architecture")."""

    num_heads: int = 4
    q_lora_rank: int = 64  # 0: plain query projection (Kimi Linear)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    rope: Literal["none", "rope", "yarn"] = "none"  # "none" = NoPE: rope dims kept, never rotated
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # DeepSeek-V3 checkpoints store rope dims interleaved
    yarn: YarnConfig = YarnConfig()
    output_gate: bool = True  # sigmoid gate d -> H*v before o_proj (K3)
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm

    def validate(self, prefix: str) -> None:
        for f in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        check(self.q_lora_rank >= 0, f"{prefix}.q_lora_rank", "must be >= 0")
        check(self.qk_rope_head_dim >= 0, f"{prefix}.qk_rope_head_dim", "must be >= 0")
        if self.rope != "none":
            check(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim > 0,
                   f"{prefix}.qk_rope_head_dim", "must be a positive even number when rope is on")
        if self.rope == "yarn":
            check(self.yarn.factor >= 1.0, f"{prefix}.yarn.factor", "must be >= 1")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """(Stable Latent)MoE (docs/design.md "Stable LatentMoE and Quantile Balancing"). ``latent_dim = 0``
    gives a plain DeepSeek-style MoE."""

    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    expert_dim: int = 64  # routed (and each shared) expert's intermediate width
    latent_dim: int = 0  # routed experts live in this width; 0 = no latent projection
    latent_norm: bool = True  # RMSNorm on the weighted expert sum, before the up-projection
    routed_scaling_factor: float = 1.0
    router_bias: bool = True  # selection-only balancing bias (Quantile Balancing state)
    renormalize: bool = True  # p_i = s_i / sum_topk s
    # Quantile Balancing of the router bias (k3jax/ops/quantile_balancing.py).
    balancing: Literal["quantile", "none"] = "quantile"
    qb_method: Literal["exact", "histogram"] = "histogram"
    qb_bins: int = 256
    # Expert-parallel token exchange over the ``expert`` mesh axis (k3jax/parallel/expert.py):
    # "auto" = ragged_all_to_all on TPU / GPU, all_gather on CPU (which lacks ragged_all_to_all).
    ep_dispatch: Literal["auto", "ragged_all_to_all", "all_to_all", "all_gather"] = runtime("auto")
    # Rows each device reserves for the (token, expert) pairs it receives, in units of its fair share
    # n*k: 0 = the worst case (dropless); c > 0 caps it at c*n*k and drops what overflows.
    ep_capacity_factor: float = 0.0

    def validate(self, prefix: str) -> None:
        check(self.num_experts > 0, f"{prefix}.num_experts", "must be positive")
        check(self.ep_capacity_factor >= 0, f"{prefix}.ep_capacity_factor", "must be >= 0 (0 = dropless)")
        check(0 < self.top_k <= self.num_experts, f"{prefix}.top_k",
               f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        check(self.num_shared_experts >= 0, f"{prefix}.num_shared_experts", "must be >= 0")
        check(self.expert_dim > 0, f"{prefix}.expert_dim", "must be positive")
        check(self.latent_dim >= 0, f"{prefix}.latent_dim", "must be >= 0")
        check(self.routed_scaling_factor > 0, f"{prefix}.routed_scaling_factor", "must be positive")
        check(self.qb_bins > 1, f"{prefix}.qb_bins", "must be > 1")
        if self.balancing == "quantile":
            check(self.router_bias, f"{prefix}.balancing", "quantile balancing needs router_bias: true")


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Block Attention Residuals (docs/design.md "Block Attention Residuals"). ``enabled = False`` gives a
    plain pre-norm stack."""

    enabled: bool = True
    block_size: int = 12  # decoder layers per block (the protocol: k3jax.layers.attn_res.ResidualStream)
    eps: float = 1e-5

    def validate(self, prefix: str) -> None:
        check(self.block_size > 0, f"{prefix}.block_size", "must be positive")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Quantization of the routed experts: MXFP4 (QAT or packed), INT4 and FP8 kept compressed
    (docs/quantization.md, ``k3jax/quant``).

    Only the routed experts' w1 / w3 / w2 are quantized, as in the K3 and K2 Thinking releases; attention, the latent
    projections, shared experts, dense FFNs and routers stay in ``param_dtype``. Also accepted as a
    top-level ``quant`` section / ``quant.*`` overrides (an alias of ``model.quant``).
    """

    # "none": dense experts. "mxfp4_qat": quantization-aware training, the experts' MXFP4
    # fake-quantized values in the forward pass, a straight-through gradient to the high-precision
    # master weights. "mxfp4": deployment, experts held packed (uint8 codes + E8M0 scales, 4.25 bits
    # per weight) and dequantized on the fly in the forward pass; not trainable.
    # "int4": Kimi K2 Thinking's compressed-tensors pack-quantized experts held as they are (int32
    # words of eight signed 4-bit values + a scale per int4_group_size inputs, k3jax/quant/int4.py);
    # "fp8_block": K2 / DeepSeek-V3 block-scaled FP8 experts held as they are (float8_e4m3fn + a
    # float32 scale per fp8_block tile, k3jax/quant/fp8_block.py). Both dequantized in the forward
    # pass, not trainable (docs/quantization.md), like "mxfp4".
    experts: Literal["none", "mxfp4_qat", "mxfp4", "int4", "fp8_block"] = "none"
    # "mxfp8": the expert matmuls' inputs fake-quantized to MXFP8 E4M3 (per token, blocks of 32 along
    # the contraction axis), with a straight-through gradient in training, as K3 serves them.
    activations: Literal["none", "mxfp8"] = "none"
    # MX scale rule (k3jax/quant/formats.py): "ceil" (default, the release's rule as far as its bytes
    # tell: the smallest scale that does not clip; idempotent), "aiter" (the same but ties round the
    # scale up, AITER's e8m0 rounding), "ocp" (the OCP spec's floor rule; clips block peaks).
    scale_rule: ScaleRule = DEFAULT_SCALE_RULE
    activation_scale_rule: ScaleRule = DEFAULT_ACTIVATION_SCALE_RULE  # MXFP8 inputs: the serving kernels' rule
    int4_group_size: int = 32  # experts: int4: inputs per scale (quantization_config's weights.group_size)
    fp8_block: tuple[int, int] = (128, 128)  # experts: fp8_block: [out, in] tile of one scale (weight_block_size)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """MoonViT vision tower + projector + image processor (k3jax/vision; docs/design.md "Vision").

    Defaults are K3's MoonViT-V2. K2.5's MoonViT (HF transformers ``kimi_k25``) is ``norm:
    layernorm, norm_eps: 1e-5, bias: true, pos_interpolation: bicubic, hidden_size: 1152,
    num_heads: 16, head_dim: 72, mlp_dim: 4304, projector: patchmerger, max_patches: 16384``.
    """

    enabled: bool = False
    patch_size: int = 14
    hidden_size: int = 1024
    num_layers: int = 27
    num_heads: int = 12
    head_dim: int = 128  # K3: 12 x 128 = 1536 != hidden_size
    mlp_dim: int = 4096
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 0.0  # 0: finfo(compute dtype).eps, as the release's torch.nn.RMSNorm(eps=None)
    bias: bool = False  # patch conv, qkv, wo, MLP biases (K2.5)
    pos_emb_size: int = 64  # learned [S, S, D] position table, resampled to each image's grid
    pos_interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    rope_theta: float = 10000.0
    merge_size: int = 2  # m x m patches -> one LM token (space-to-depth)
    # "patchmergerv2" (K3): Linear -> GELU -> Linear -> RMSNorm; "patchmerger" (K2.5): LayerNorm
    # per sub-patch -> Linear -> GELU -> Linear, with biases.
    projector: Literal["patchmergerv2", "patchmerger"] = "patchmergerv2"
    projector_eps: float = 1e-5
    # Image processor (media_proc_cfg of the release).
    max_patches: int = 65536  # in_patch_limit
    max_patches_per_side: int = 512
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # Placeholder token ids (K3 / K2.5 tokenizer: <|media_begin|>, <|media_content|>, <|media_end|>,
    # <|media_pad|>); a byte-tokenizer model puts them right after the 256 bytes.
    media_begin_id: int = 163602
    media_content_id: int = 163603
    media_end_id: int = 163604
    media_pad_id: int = 163605

    def validate(self, prefix: str, vocab_size: int) -> None:
        for f in ("patch_size", "hidden_size", "num_layers", "num_heads", "head_dim", "mlp_dim", "pos_emb_size",
                  "merge_size", "max_patches", "max_patches_per_side"):
            check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        check(self.head_dim % 4 == 0, f"{prefix}.head_dim", "must be a multiple of 4 (2-D RoPE pairs per axis)")
        check(self.norm_eps >= 0, f"{prefix}.norm_eps", "must be >= 0")
        check(len(self.image_mean) == 3 and len(self.image_std) == 3, f"{prefix}.image_mean",
               "image_mean and image_std need 3 (RGB) values")
        for f in ("media_begin_id", "media_content_id", "media_end_id", "media_pad_id"):
            check(0 <= getattr(self, f) < vocab_size, f"{prefix}.{f}", f"must be a token id < vocab_size={vocab_size}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder: layer layout, widths and the switches shared by every layer."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 8
    # Layer layout: "hybrid" = layer i is MLA when (i + 1) % mla_period == 0 (plus the last layer if
    # last_layer_mla); "mla" = all MLA (K2); "kda" = all KDA. ``mla_layers`` (0-based) overrides.
    layout: Literal["hybrid", "mla", "kda"] = "hybrid"
    mla_period: int = 4
    last_layer_mla: bool = True
    mla_layers: tuple[int, ...] | None = None
    first_dense_layers: int = 1  # layers [0, n) use a dense FFN, the rest MoE
    dense_ffn_dim: int = 256
    activation: Literal["situ_glu", "swiglu"] = "situ_glu"
    situ_beta: float = 4.0  # softcap of the gate branch
    situ_linear_beta: float = 25.0  # softcap of the linear branch
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = runtime(0.02)  # initialisation only
    max_seq_len: int = runtime(4096)  # longest input (cache) allowed
    kda: KDAConfig = KDAConfig()
    mla: MLAConfig = MLAConfig()
    moe: MoEConfig = MoEConfig()
    attn_res: AttnResConfig = AttnResConfig()
    quant: QuantConfig = QuantConfig()
    vision: VisionConfig = VisionConfig()  # disabled: a text-only model
    # Numerics and compilation.
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True
    # none; full: each layer's forward runs once more in the backward pass (8N); nested: a scanned
    # group is checkpointed too (one more forward, 10N, for a group's worth of saved inputs); dots:
    # matmul outputs saved; selective: full, but the GLU inputs, the routed experts' outputs and the
    # mixers' core outputs are kept (k3jax/ops/saved_names.py), so no expert matmul, attention or KDA
    # pass runs twice, for about 2 x (top-k x capacity x F + k x L) bytes per token and layer more;
    # outputs: full, but each sublayer's output is kept (the mixer's projected output, the routed
    # experts' sum: 2d + 4L bytes per token and layer), so no output projection and no routed down
    # projection runs twice (k3jax/model.py); outputs_offload: outputs, plus MLA's attention residuals
    # kept and the mixers' input projections kept in host memory (pinned_host), so no attention forward,
    # KDA or gate projection runs twice either (k3jax/ops/saved_names.py)
    remat: Literal["none", "full", "nested", "dots", "selective", "outputs", "outputs_offload"] = runtime("none")
    # Kernels (k3jax/kernels.py): the pure-JAX ops, or the Pallas kernels of pallas_kernels/ (Mosaic
    # on TPU, Triton on GPU, the Pallas interpreter on CPU).
    kda_impl: Literal["auto", "xla", "pallas"] = runtime("auto")  # auto: xla on every platform for now
    moe_impl: Literal["auto", "ragged_dot", "pallas"] = runtime("auto")  # k3jax/kernels.py

    def validate(self, prefix: str = "model") -> None:
        check_choices(self, prefix)
        for f in ("vocab_size", "hidden_size", "num_layers", "dense_ffn_dim", "mla_period", "max_seq_len"):
            check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        check(0 <= self.first_dense_layers <= self.num_layers, f"{prefix}.first_dense_layers",
               f"must be in [0, num_layers={self.num_layers}]")
        if self.mla_layers is not None:
            bad = [i for i in self.mla_layers if not 0 <= i < self.num_layers]
            check(not bad, f"{prefix}.mla_layers", f"indices {bad} out of range [0, {self.num_layers})")
        if self.uses("kda"):
            self.kda.validate(f"{prefix}.kda")
        if self.uses("mla"):
            self.mla.validate(f"{prefix}.mla")
        if self.first_dense_layers < self.num_layers:
            self.moe.validate(f"{prefix}.moe")
        self.attn_res.validate(f"{prefix}.attn_res")
        if self.vision.enabled:
            self.vision.validate(f"{prefix}.vision", self.vocab_size)
        q = self.quant
        check(q.int4_group_size > 0 and q.int4_group_size % INT4_PER_WORD == 0, f"{prefix}.quant.int4_group_size",
              f"must be a positive multiple of {INT4_PER_WORD} (values per int32 word), got {q.int4_group_size}")
        check(len(q.fp8_block) == 2 and min(q.fp8_block) > 0, f"{prefix}.quant.fp8_block",
              f"must be two positive sizes [out, in], got {q.fp8_block}")
        width = self.moe.latent_dim or self.hidden_size  # the expert input width: w1 / w3 contract over it
        widths = (("moe.latent_dim" if self.moe.latent_dim else "hidden_size", width),
                  ("moe.expert_dim", self.moe.expert_dim))  # w2 contracts over the expert width
        if self.first_dense_layers < self.num_layers and q.experts == "int4":
            for name, n in widths:
                check(n % q.int4_group_size == 0, f"{prefix}.{name}", f"must be a multiple of quant.int4_group_size="
                      f"{q.int4_group_size} with quant.experts='int4', got {n}")
        quantized = q.experts in ("mxfp4_qat", "mxfp4") or q.activations != "none"
        if self.first_dense_layers < self.num_layers and quantized:
            # MX blocks run along each expert matmul's contraction axis
            for name, n in widths:
                check(n % MX_BLOCK == 0, f"{prefix}.{name}", f"must be a multiple of {MX_BLOCK} (the MX block) "
                       f"with quant.experts={self.quant.experts!r} / quant.activations={self.quant.activations!r}, "
                       f"got {n}")

    # Derived layout -------------------------------------------------------------------------
    def mixer(self, i: int) -> Literal["kda", "mla"]:
        """Token mixer of 0-based layer ``i``."""
        if self.mla_layers is not None:
            return "mla" if i in self.mla_layers else "kda"
        if self.layout != "hybrid":
            return self.layout
        is_mla = (i + 1) % self.mla_period == 0 or (self.last_layer_mla and i == self.num_layers - 1)
        return "mla" if is_mla else "kda"

    def ffn(self, i: int) -> Literal["dense", "moe"]:
        return "dense" if i < self.first_dense_layers else "moe"

    def uses(self, mixer: str) -> bool:
        return any(self.mixer(i) == mixer for i in range(self.num_layers))


__all__ = ["AttnResConfig", "KDAConfig", "MLAConfig", "MoEConfig", "ModelConfig", "QuantConfig", "VisionConfig",
           "YarnConfig"]

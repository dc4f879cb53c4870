"""Configs as data: frozen dataclasses loaded from YAML, with dotted ``key=value`` overrides.

Every architectural choice of K3, K2 (DeepSeek-V3 layout) and Kimi Linear is a field here, so one
code path covers all three. ``load_config("k3")`` reads ``configs/k3.yaml``; a path to any YAML file
works too. Unknown keys, typos and inconsistent values fail at load time with a message that names
the field (and suggests the closest valid name).
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from typing import Any, Literal

import yaml

from k3jax.quant.formats import GROUP_SIZE as MX_BLOCK

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config that cannot describe a valid model; the message names the offending field."""


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _runtime(default):
    """A field that says how a run executes or is observed, not what it computes: it may differ between a
    checkpoint and the config that resumes or reads it, and HF config round trips ignore it
    (:func:`without_runtime_fields`)."""
    return dataclasses.field(default=default, metadata={"runtime": True})


def runtime_fields(cls) -> frozenset[str]:
    """Names of the fields of config dataclass ``cls`` marked runtime."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("runtime"))


def without_runtime_fields(cfg) -> dict:
    """``to_dict(cfg)`` without the runtime fields, at every depth: what must match for two configs to
    describe the same model (or the same run)."""
    out = {}
    for f in dataclasses.fields(cfg):
        if f.metadata.get("runtime"):
            continue
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = without_runtime_fields(v)
        out[f.name] = list(v) if isinstance(v, tuple) else v  # as to_dict
    return out


def _check_choice(value: Any, tp: Any, where: str) -> None:
    """A value of a ``Literal[...]``-annotated field (also ``Literal | None``) must be one of the allowed
    values; the error names the field and lists them. Other annotations pass."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        (tp,) = [a for a in args if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        _check(value in typing.get_args(tp), where, f"must be one of {list(typing.get_args(tp))}, got {value!r}")


def _check_choices(cfg, prefix: str) -> None:
    """Every ``Literal[...]``-annotated field of ``cfg`` and of its nested configs holds an allowed value
    (configs built in Python skip :func:`_coerce`, which checks the same rule on loading)."""
    for name, tp in _field_types(type(cfg)).items():
        value = getattr(cfg, name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}.{name}")
        else:
            _check_choice(value, tp, f"{prefix}.{name}")


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
    chunk_size: int = _runtime(64)
    norm_eps: float = 1e-5

    def validate(self, prefix: str) -> None:
        _check(self.num_heads > 0, f"{prefix}.num_heads", "must be positive")
        _check(self.head_dim > 0, f"{prefix}.head_dim", "must be positive")
        _check(self.conv_size >= 0, f"{prefix}.conv_size", "must be >= 0")
        _check(self.gate_lower_bound < 0, f"{prefix}.gate_lower_bound", "must be negative")
        _check(self.gate_rank >= 0, f"{prefix}.gate_rank", "must be >= 0")
        _check(self.chunk_size > 0, f"{prefix}.chunk_size", "must be positive")

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
            _check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        _check(self.q_lora_rank >= 0, f"{prefix}.q_lora_rank", "must be >= 0")
        _check(self.qk_rope_head_dim >= 0, f"{prefix}.qk_rope_head_dim", "must be >= 0")
        if self.rope != "none":
            _check(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim > 0,
                   f"{prefix}.qk_rope_head_dim", "must be a positive even number when rope is on")
        if self.rope == "yarn":
            _check(self.yarn.factor >= 1.0, f"{prefix}.yarn.factor", "must be >= 1")

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
    router_dtype: Literal["float32"] = "float32"
    # Quantile Balancing of the router bias (k3jax/quantile_balancing.py).
    balancing: Literal["quantile", "none"] = "quantile"
    qb_method: Literal["exact", "histogram"] = "histogram"
    qb_bins: int = 256
    # Expert-parallel token exchange over the ``expert`` mesh axis (k3jax/parallel/expert.py):
    # "auto" = ragged_all_to_all on TPU / GPU, all_gather on CPU (which lacks ragged_all_to_all).
    ep_dispatch: Literal["auto", "ragged_all_to_all", "all_to_all", "all_gather"] = _runtime("auto")
    # Rows each device reserves for the (token, expert) pairs it receives, in units of its fair share
    # n*k: 0 = the worst case (dropless); c > 0 caps it at c*n*k and drops what overflows.
    ep_capacity_factor: float = 0.0

    def validate(self, prefix: str) -> None:
        _check(self.num_experts > 0, f"{prefix}.num_experts", "must be positive")
        _check(self.ep_capacity_factor >= 0, f"{prefix}.ep_capacity_factor", "must be >= 0 (0 = dropless)")
        _check(0 < self.top_k <= self.num_experts, f"{prefix}.top_k",
               f"must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        _check(self.num_shared_experts >= 0, f"{prefix}.num_shared_experts", "must be >= 0")
        _check(self.expert_dim > 0, f"{prefix}.expert_dim", "must be positive")
        _check(self.latent_dim >= 0, f"{prefix}.latent_dim", "must be >= 0")
        _check(self.routed_scaling_factor > 0, f"{prefix}.routed_scaling_factor", "must be positive")
        _check(self.qb_bins > 1, f"{prefix}.qb_bins", "must be > 1")
        if self.balancing == "quantile":
            _check(self.router_bias, f"{prefix}.balancing", "quantile balancing needs router_bias: true")


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Block Attention Residuals (docs/design.md "Block Attention Residuals"). ``enabled = False`` gives a
    plain pre-norm stack."""

    enabled: bool = True
    block_size: int = 12  # decoder layers per block (closes_block)
    eps: float = 1e-5

    def validate(self, prefix: str) -> None:
        _check(self.block_size > 0, f"{prefix}.block_size", "must be positive")

    def closes_block(self, layer):
        """Whether decoder layer ``layer`` (an int, or an int array traced inside the scan) first pushes
        the running partial sum into the bank: layers 0, block_size, 2 block_size, ... (at layer 0 the
        partial is the embedding)."""
        return layer % self.block_size == 0

    def num_slots(self, num_layers: int) -> int:
        """Bank rows a ``num_layers`` stack fills: one per closing layer (the embedding included). The
        final readout mixes these and the running partial: ``num_slots + 1`` sources."""
        return -(-num_layers // self.block_size)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Microscaling quantization of the routed experts (docs/quantization.md, ``k3jax/quant``).

    Only the routed experts' w1 / w3 / w2 are quantized, as in the K3 release; attention, the latent
    projections, shared experts, dense FFNs and routers stay in ``param_dtype``. Also accepted as a
    top-level ``quant`` section / ``quant.*`` overrides (an alias of ``model.quant``).
    """

    # "none": dense experts. "mxfp4_qat": quantization-aware training, the experts' MXFP4
    # fake-quantized values in the forward pass, a straight-through gradient to the high-precision
    # master weights. "mxfp4": deployment, experts held packed (uint8 codes + E8M0 scales, 4.25 bits
    # per weight) and dequantized on the fly in the forward pass; not trainable.
    experts: Literal["none", "mxfp4_qat", "mxfp4"] = "none"
    # "mxfp8": the expert matmuls' inputs fake-quantized to MXFP8 E4M3 (per token, blocks of 32 along
    # the contraction axis), with a straight-through gradient in training, as K3 serves them.
    activations: Literal["none", "mxfp8"] = "none"
    # MX scale rule (k3jax/quant/formats.py): "ceil" (default, the release's rule as far as its bytes
    # tell: the smallest scale that does not clip; idempotent), "aiter" (the same but ties round the
    # scale up, AITER's e8m0 rounding), "ocp" (the OCP spec's floor rule; clips block peaks).
    scale_rule: Literal["ceil", "aiter", "ocp"] = "ceil"
    activation_scale_rule: Literal["ceil", "aiter", "ocp"] = "ceil"  # MXFP8 inputs: the serving kernels' rule


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
            _check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        _check(self.head_dim % 4 == 0, f"{prefix}.head_dim", "must be a multiple of 4 (2-D RoPE pairs per axis)")
        _check(self.norm_eps >= 0, f"{prefix}.norm_eps", "must be >= 0")
        _check(len(self.image_mean) == 3 and len(self.image_std) == 3, f"{prefix}.image_mean",
               "image_mean and image_std need 3 (RGB) values")
        for f in ("media_begin_id", "media_content_id", "media_end_id", "media_pad_id"):
            _check(0 <= getattr(self, f) < vocab_size, f"{prefix}.{f}", f"must be a token id < vocab_size={vocab_size}")


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
    init_std: float = _runtime(0.02)  # initialisation only
    max_seq_len: int = _runtime(4096)  # longest input (cache) allowed
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
    # matmul outputs saved (k3jax/model.py)
    remat: Literal["none", "full", "nested", "dots"] = _runtime("none")
    # Kernels (k3jax/kernels.py): the pure-JAX ops, or the Pallas kernels of pallas_kernels/ (Mosaic
    # on TPU, Triton on GPU, the Pallas interpreter on CPU).
    kda_impl: Literal["xla", "pallas"] = _runtime("xla")
    moe_impl: Literal["auto", "ragged_dot", "pallas"] = _runtime("auto")  # k3jax/kernels.py

    def validate(self, prefix: str = "model") -> None:
        _check_choices(self, prefix)
        for f in ("vocab_size", "hidden_size", "num_layers", "dense_ffn_dim", "mla_period", "max_seq_len"):
            _check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        _check(0 <= self.first_dense_layers <= self.num_layers, f"{prefix}.first_dense_layers",
               f"must be in [0, num_layers={self.num_layers}]")
        _check(self.moe_impl != "pallas" or self.quant.activations == "none", f"{prefix}.moe_impl",
               "the Pallas grouped matmul has no MXFP8 input quantization; use ragged_dot with quant.activations")
        if self.mla_layers is not None:
            bad = [i for i in self.mla_layers if not 0 <= i < self.num_layers]
            _check(not bad, f"{prefix}.mla_layers", f"indices {bad} out of range [0, {self.num_layers})")
        if self.uses("kda"):
            self.kda.validate(f"{prefix}.kda")
        if self.uses("mla"):
            self.mla.validate(f"{prefix}.mla")
        if self.first_dense_layers < self.num_layers:
            self.moe.validate(f"{prefix}.moe")
        self.attn_res.validate(f"{prefix}.attn_res")
        if self.vision.enabled:
            self.vision.validate(f"{prefix}.vision", self.vocab_size)
        quantized = self.quant.experts != "none" or self.quant.activations != "none"
        if self.first_dense_layers < self.num_layers and quantized:
            # MX blocks run along each expert matmul's contraction axis: the expert input width
            # (latent or hidden) for w1 / w3, the expert width for w2
            width = self.moe.latent_dim or self.hidden_size
            for name, n in (("moe.latent_dim" if self.moe.latent_dim else "hidden_size", width),
                            ("moe.expert_dim", self.moe.expert_dim)):
                _check(n % MX_BLOCK == 0, f"{prefix}.{name}", f"must be a multiple of {MX_BLOCK} (the MX block) "
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


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Per-head Muon for matrices + AdamW for the rest (the table in k3jax/optim.py), schedule and clipping."""

    learning_rate: float = 3e-3  # Muon peak LR (the 0.2*sqrt(max(rows, cols)) scale matches AdamW RMS)
    adam_learning_rate: float | None = None  # None: same as learning_rate
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20
    decay_steps: int = 0  # WSD: length of the final decay; cosine: 0 = until the last step
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    muon_beta: float = 0.95
    ns_steps: int = 5
    # Muon momentum and Newton-Schulz dtype: bfloat16 halves the optimizer's largest state and
    # temporaries (the usual Muon setting at scale); float32 is exact to the optax reference.
    muon_dtype: Literal["float32", "bfloat16"] = "float32"
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    per_head_muon: bool = True  # False: whole-matrix Muon (ablation)
    # K2's MuonClip: after each update, MLA heads whose max pre-softmax logit in the step exceeded tau
    # are rescaled to tau (k3jax/optim.py qk_clip; K2 used 100); 0 disables
    qk_clip_tau: float = 0.0

    def validate(self, prefix: str = "train.optim") -> None:
        _check(self.learning_rate > 0, f"{prefix}.learning_rate", "must be positive")
        _check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        _check(0 <= self.end_lr_fraction <= 1, f"{prefix}.end_lr_fraction", "must be in [0, 1]")
        _check(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0")
        _check(self.ns_steps > 0, f"{prefix}.ns_steps", "must be positive")
        _check(self.qk_clip_tau >= 0, f"{prefix}.qk_clip_tau", "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes packed rows (k3jax/data)."""

    source: str = "bundled"  # "bundled" (the shipped public-domain corpus) or a local file / glob
    format: Literal["auto", "text", "jsonl", "parquet", "arrayrecord"] = "auto"
    text_field: str = "text"  # jsonl / parquet column
    tokenizer: str = "byte"  # "byte", a tokenizer.json path, or a tiktoken model path
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever
    eval_fraction: float = 0.01  # held-out documents for the eval loss

    def validate(self, prefix: str = "train.data") -> None:
        _check(0 <= self.eval_fraction < 1, f"{prefix}.eval_fraction", "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run: ``python train.py --config NAME key=value ...``."""

    # Runtime fields: how long the run is and how it is logged and saved (they may change on resume).
    steps: int = _runtime(200)
    batch_size: int = 8  # global rows per optimizer step
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    seq_len: int = 128
    seed: int = 0
    log_every: int = _runtime(20)
    eval_every: int = _runtime(0)  # 0: only at the end
    checkpoint_every: int = _runtime(100)
    keep_checkpoints: int = _runtime(3)
    out_dir: str = _runtime("runs/default")
    # Fine-tuning: a fresh run starts from the model weights of this run directory's (or checkpoint
    # directory's) latest checkpoint, e.g. MXFP4 QAT of an unquantized run; ignored when resuming.
    init_from: str | None = None
    z_loss: float = 0.0
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    def validate(self, prefix: str = "train") -> None:
        _check_choices(self, prefix)
        for f in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "checkpoint_every"):
            _check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        _check(self.batch_size % self.grad_accum == 0, f"{prefix}.grad_accum",
               f"must divide batch_size={self.batch_size}")
        self.optim.validate(f"{prefix}.optim")
        self.data.validate(f"{prefix}.data")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes (``k3jax/sharding.py``); one axis may be -1 (fill)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    sequence: int = 1
    tensor: int = 1

    def validate(self, prefix: str = "mesh") -> None:
        sizes = [self.data, self.fsdp, self.expert, self.sequence, self.tensor]
        _check(all(s == -1 or s > 0 for s in sizes), prefix, "axis sizes must be positive or -1")
        _check(sizes.count(-1) <= 1, prefix, "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = _runtime("custom")
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = _runtime(MeshConfig())  # a run may resume on another mesh: orbax reshards on restore

    def validate(self) -> None:
        self.model.validate("model")
        self.train.validate("train")
        self.mesh.validate("mesh")
        _check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
               f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")


# ---------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts with strict key checking.


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _from_dict(tp, value, where)
    if origin is Literal:
        _check_choice(value, tp, where)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (inner, _) = typing.get_args(tp)
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string; Python reads it as a number
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp} at {where}")


def _from_dict(cls, data: dict, where: str):
    types_ = _field_types(cls)
    unknown = [k for k in data if k not in types_]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, list(types_), n=1)
        hint = f"; did you mean {where + '.' if where else ''}{close[0]}?" if close else ""
        raise ConfigError(f"{where + '.' if where else ''}{k}: unknown key{hint} "
                          f"(valid: {', '.join(sorted(types_))})")
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    """The config as plain nested dicts/lists (YAML- and JSON-serialisable)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


# Top-level sections that are aliases of a deeper one (``quant.experts=...`` is ``model.quant.experts=...``).
_SECTION_ALIASES = {"quant": ("model", "quant")}


def _resolve_aliases(data: dict) -> dict:
    """Move aliased top-level sections (YAML or overrides) to where they live in the config."""
    out = dict(data)
    for alias, (section, field) in _SECTION_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            target = dict(out.get(section) or {})
            current = target.get(field)
            target[field] = _merge(current, value) if isinstance(current, dict) and isinstance(value, dict) else value
            out[section] = target
    return out


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: {p} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    """``["model.moe.top_k=4", "train.steps=10"]`` -> nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def resolve_path(name_or_path: str) -> pathlib.Path:
    p = pathlib.Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        return p
    p = CONFIG_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown config {name_or_path!r}; named configs: {', '.join(names)}")
    return p


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load ``configs/<name>.yaml`` (or a YAML path) and apply dotted ``key=value`` overrides.

    A config may start with ``base: <name>`` to inherit another config and override some fields.
    """
    data = _load_yaml(resolve_path(name_or_path))
    data.setdefault("name", pathlib.Path(name_or_path).stem)
    data = _merge(_resolve_aliases(data), _resolve_aliases(parse_overrides(overrides)))
    cfg = _from_dict(Config, data, "")
    cfg.validate()
    return cfg


def _load_yaml(path: pathlib.Path, seen: tuple = ()) -> dict:
    if path in seen:
        raise ConfigError(f"{path}: circular 'base'")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    base = data.pop("base", None)
    if base is not None:
        parent = _load_yaml(resolve_path(base), seen + (path,))
        parent.pop("name", None)
        data = _merge(parent, data)
    return data


def from_dict(data: dict) -> Config:
    """Build and validate a Config from nested dicts (e.g. the ``to_dict`` of a saved run)."""
    cfg = _from_dict(Config, _resolve_aliases(data), "")
    cfg.validate()
    return cfg

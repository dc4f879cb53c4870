"""The run's config: training (optimizer, data, batch), the device mesh, and the whole ``Config``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from k3jax.config.fields import check, check_choices, runtime
from k3jax.config.model_config import ModelConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Per-head Muon for matrices + AdamW for the rest (the table in k3jax/optim.py), schedule and clipping."""

    # muon: the above. adamw: AdamW for every parameter (the usual baseline, and what HF's trainer runs),
    # the matrices keeping their weight decay, at adam_learning_rate; Muon's own settings below
    # (learning_rate aside, when adam_learning_rate is set) then play no part.
    optimizer: Literal["muon", "adamw"] = "muon"
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
        check(self.learning_rate > 0, f"{prefix}.learning_rate", "must be positive")
        check(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        check(0 <= self.end_lr_fraction <= 1, f"{prefix}.end_lr_fraction", "must be in [0, 1]")
        check(self.grad_clip >= 0, f"{prefix}.grad_clip", "must be >= 0")
        check(self.ns_steps > 0, f"{prefix}.ns_steps", "must be positive")
        check(self.qk_clip_tau >= 0, f"{prefix}.qk_clip_tau", "must be >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes packed rows (k3jax/data)."""

    source: str = "bundled"  # "bundled" (the shipped public-domain corpus) or a local file / glob
    format: Literal["auto", "text", "jsonl", "parquet", "arrayrecord"] = "auto"
    text_field: str = "text"  # jsonl / parquet column
    tokenizer: str = "byte"  # "byte", a tokenizer.json path, or a tiktoken model path
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever
    eval_fraction: float = 0.01  # held-out documents for the eval loss; 0: none, and no eval

    def validate(self, prefix: str = "train.data") -> None:
        check(0 <= self.eval_fraction < 1, f"{prefix}.eval_fraction", "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run: ``python train.py --config NAME key=value ...``."""

    # Runtime fields: how long the run is and how it is logged and saved (they may change on resume).
    steps: int = runtime(200)
    batch_size: int = 8  # global rows per optimizer step
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    # Gradients of the matrix weights (the Muon group: projections and experts, nearly all the bytes) and
    # their micro-batch accumulator: float32, or bfloat16 (with model.dtype=bfloat16), which halves the
    # largest temporaries of a large step at bf16's 8-bit mantissa; the master weights stay in param_dtype.
    # The Muon updates of layer-stacked weights are written back into their gradients' buffers, so with
    # bfloat16 they are rounded to bf16 too (optim._in_place_over_layers).
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    seq_len: int = 128
    seed: int = 0
    log_every: int = runtime(20)
    eval_every: int = runtime(0)  # 0: only at the end
    checkpoint_every: int = runtime(100)
    keep_checkpoints: int = runtime(3)
    out_dir: str = runtime("runs/default")
    # Fine-tuning: a fresh run starts from the model weights of this run directory's (or checkpoint
    # directory's) latest checkpoint, e.g. MXFP4 QAT of an unquantized run; ignored when resuming.
    init_from: str | None = None
    z_loss: float = 0.0
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()

    def validate(self, prefix: str = "train") -> None:
        check_choices(self, prefix)
        for f in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "checkpoint_every"):
            check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        check(self.batch_size % self.grad_accum == 0, f"{prefix}.grad_accum",
               f"must divide batch_size={self.batch_size}")
        check(self.eval_every >= 0, f"{prefix}.eval_every", "must be >= 0 (0: only at the end)")
        check(not (self.eval_every and self.data.eval_fraction == 0), f"{prefix}.eval_every",
              "needs a held-out split: train.data.eval_fraction is 0")
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
        check(all(s == -1 or s > 0 for s in sizes), prefix, "axis sizes must be positive or -1")
        check(sizes.count(-1) <= 1, prefix, "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = runtime("custom")
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = runtime(MeshConfig())  # a run may resume on another mesh: orbax reshards on restore

    def validate(self) -> None:
        self.model.validate("model")
        self.train.validate("train")
        self.mesh.validate("mesh")
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
               f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        # the weights are differentiated in the gradient dtype: the forward is unchanged only when the layers
        # compute in it too
        check(self.train.grad_dtype == "float32" or self.train.grad_dtype == self.model.dtype, "train.grad_dtype",
              f"{self.train.grad_dtype} gradients need model.dtype={self.train.grad_dtype} (is {self.model.dtype})")



__all__ = ["Config", "DataConfig", "MeshConfig", "OptimConfig", "TrainConfig"]

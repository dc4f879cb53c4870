"""The run's config: training (optimizer, data, batch), the device mesh, and the whole ``Config``."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Literal

from k3jax.config.fields import check, check_choices, runtime
from k3jax.config.model_config import ModelConfig
from k3jax.config.rl_config import RLConfig


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Per-head Muon for matrices + AdamW for the rest (the table in k3jax/optim/grouping.py), schedule and clipping."""

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
    # Weights held below float32 (model.param_dtype=bfloat16, MaxText's weight_dtype): the optimizer's
    # statistics and updates stay float32 and each step's float32 sum w + u is rounded to the weights' dtype,
    # to the nearest value or stochastically (unbiased: updates below half a bf16 spacing still move the
    # weight on average; k3jax/optim/precision.py stochastic_weight_rounding)
    weight_rounding: Literal["nearest", "stochastic"] = "nearest"
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global norm; 0 disables
    per_head_muon: bool = True  # False: whole-matrix Muon (ablation)
    # K2's MuonClip: after each update, MLA heads whose max pre-softmax logit in the step exceeded tau
    # are rescaled to tau (k3jax/optim/qk_clip.py; K2 used 100); 0 disables
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

    source: str = "bundled"  # "bundled" (the shipped public-domain corpus / chat set) or a local file / glob
    # chat: records with an OpenAI-style `messages` list (JSONL, parquet or ArrayRecord; k3jax/data/chat.py)
    format: Literal["auto", "text", "jsonl", "parquet", "arrayrecord", "chat"] = "auto"
    text_field: str = "text"  # jsonl / parquet column
    # chat: the tokens the loss trains: every assistant turn (its content, reasoning, tool calls and
    # end-of-turn token), the last assistant turn only, or every token
    chat_loss: Literal["assistant", "last_assistant", "all"] = "assistant"
    # chat: a conversation longer than seq_len is cut to a prefix ending at a trained token, or dropped
    chat_overflow: Literal["truncate", "drop"] = "truncate"
    tokenizer: str = "byte"  # "byte", a tokenizer.json path, or a tiktoken model path
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever
    eval_fraction: float = 0.01  # held-out documents for the eval loss; 0: none, and no eval
    # a record that cannot be read (invalid JSON or UTF-8, a field of the wrong type, an empty document, an
    # invalid conversation, a file gone mid-run): stop naming the file and record, or skip it and count it
    # (metrics.jsonl's skipped_records; k3jax/data/sources.py). Runtime: a run stopped by one resumes with skip
    bad_records: Literal["stop", "skip"] = runtime("stop")

    def validate(self, prefix: str = "train.data") -> None:
        check(0 <= self.eval_fraction < 1, f"{prefix}.eval_fraction", "must be in [0, 1)")
        for name in ("chat_loss", "chat_overflow"):
            check(self.format == "chat" or getattr(self, name) == getattr(DataConfig, name), f"{prefix}.{name}",
                  f"applies to chat data only (train.data.format=chat), not format={self.format!r}")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (``k3jax/training/wandb_log.py``): the scalars of ``metrics.jsonl`` and the
    resolved config, from process 0; a resumed run goes on in the same W&B run (its id is kept in the run
    directory's ``wandb_run_id``). Needs ``pip install wandb`` (the ``wandb`` extra)."""

    # off: no W&B; online: stream to the server (``wandb login`` or WANDB_API_KEY); offline: write the W&B
    # run under WANDB_DIR (default ./wandb) for a later ``wandb sync``
    mode: Literal["off", "online", "offline"] = "off"
    project: str = "k3jax"  # the W&B project the run is logged to
    entity: str = ""  # the W&B user or team; "": the account's default entity
    name: str = ""  # the run's display name; "": the run directory's name
    tags: tuple[str, ...] = ()  # W&B tags of the run, e.g. [sft, lora]

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """A ``jax.profiler`` trace of a few training steps (of an RL run: whole steps, rollout, scoring and
    updates), written to ``<run_dir>/profile/`` (open it with ``tensorboard --logdir <run_dir>/profile`` and
    its profile plugin, or the ``.xplane.pb`` in Perfetto / XProf; ``k3jax/training/profiling.py``)."""

    first_step: int = 0  # the first traced step (steps count from 1, as in metrics.jsonl); 0: no trace
    steps: int = 3  # how many steps from first_step are traced (the first step compiles: start after it)

    @property
    def enabled(self) -> bool:
        return self.first_step > 0

    def validate(self, prefix: str = "train.profile") -> None:
        check(self.first_step >= 0, f"{prefix}.first_step", "must be >= 0 (0: no trace)")
        check(self.steps > 0, f"{prefix}.steps", "must be positive")


# The projections low-rank adapters may target, by the layer kind that holds them (``train.lora.targets``
# names a kind for all of its projections, or ``kind.weight`` for one). The router, norms, gates' constants,
# convolutions, embeddings, lm_head and the routed experts are never adapted.
LORA_SITES = {
    "mla": ("q_a", "q_b", "q_proj", "kv_a", "kv_b", "g_proj", "o_proj"),
    "kda": ("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "g_a", "g_b", "o_proj"),
    "ffn": ("w_gate", "w_up", "w_down"),  # the dense FFN layers
    "shared": ("w_gate", "w_up", "w_down"),  # the MoE layers' shared experts
}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the frozen model's projections (``k3jax/layers/lora.py``, docs/design.md
    "LoRA"): ``y = x W + s (dropout(x) A) B`` with ``A [*in, rank]``, ``B [rank, *out]`` (zero at
    start), ``s = alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``). ``rank = 0``: off."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapters' input (the low-rank path only), in training steps
    use_rslora: bool = False  # PEFT's rank-stabilised scale
    targets: tuple[str, ...] = ("mla", "kda", "ffn", "shared")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """The low-rank path's factor ``s`` (PEFT's ``scaling``)."""
        return self.alpha / (self.rank ** 0.5 if self.use_rslora else self.rank)

    def sites(self, kind: str) -> frozenset[str]:
        """The weights of a ``kind`` layer (a key of :data:`LORA_SITES`) that get adapters."""
        out = set()
        for t in self.targets:
            k, _, weight = t.partition(".")
            if k == kind:
                out.update([weight] if weight else LORA_SITES[kind])
        return frozenset(out)

    def validate(self, prefix: str = "train.lora") -> None:
        check(self.rank >= 0, f"{prefix}.rank", "must be >= 0 (0 = off)")
        check(self.alpha > 0, f"{prefix}.alpha", "must be positive")
        check(0 <= self.dropout < 1, f"{prefix}.dropout", "must be in [0, 1)")
        check(bool(self.targets) or not self.enabled, f"{prefix}.targets", "must name at least one projection")
        valid = [*LORA_SITES, *(f"{k}.{w}" for k, ws in LORA_SITES.items() for w in ws)]
        for t in self.targets:
            close = difflib.get_close_matches(t, valid, n=1)
            check(t in valid, f"{prefix}.targets", f"unknown target {t!r}" + (f" (did you mean {close[0]!r}?)"
                  if close else "") + f"; targets are {', '.join(LORA_SITES)} or kind.weight, e.g. mla.q_b "
                  "(never the router, norms, embeddings, lm_head or routed experts)")


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
    # bfloat16 they are rounded to bf16 too (k3jax/optim/muon.py).
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
    # NaN guard: after this many consecutive updates skipped for a non-finite loss or gradient (0: no
    # bound), stop, or go back to the latest checkpoint and go on with the next batches (once per checkpoint)
    max_nonfinite_steps: int = runtime(20)
    on_nonfinite: Literal["stop", "rollback"] = runtime("stop")
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    # LoRA fine-tuning (rank > 0): only the adapters train (AdamW); the model's weights, from init_from
    # (a k3jax run / checkpoint or a Hugging Face directory), stay frozen
    lora: LoRAConfig = LoRAConfig()
    # reinforcement learning (rl.loss != off): the batches are rollouts of the model itself (k3jax/rl)
    rl: RLConfig = RLConfig()
    wandb: WandbConfig = runtime(WandbConfig())
    profile: ProfileConfig = runtime(ProfileConfig())

    def validate(self, prefix: str = "train") -> None:
        check_choices(self, prefix)
        for f in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "checkpoint_every"):
            check(getattr(self, f) > 0, f"{prefix}.{f}", "must be positive")
        check(self.batch_size % self.grad_accum == 0, f"{prefix}.grad_accum",
               f"must divide batch_size={self.batch_size}")
        check(self.eval_every >= 0, f"{prefix}.eval_every", "must be >= 0 (0: only at the end)")
        check(self.max_nonfinite_steps >= 0, f"{prefix}.max_nonfinite_steps", "must be >= 0 (0: no bound)")
        check(not (self.eval_every and self.data.eval_fraction == 0), f"{prefix}.eval_every",
              "needs a held-out split: train.data.eval_fraction is 0")
        self.optim.validate(f"{prefix}.optim")
        self.data.validate(f"{prefix}.data")
        self.lora.validate(f"{prefix}.lora")
        self.rl.validate(f"{prefix}.rl")
        self.profile.validate(f"{prefix}.profile")
        if self.rl.enabled:
            check(self.batch_size == self.rl.rows, f"{prefix}.batch_size",
                  f"an RL step trains on its rollouts: set it to rl.prompts_per_step x rl.group_size = {self.rl.rows}")
            check(self.seq_len > self.rl.max_new_tokens, f"{prefix}.seq_len",
                  f"must exceed rl.max_new_tokens={self.rl.max_new_tokens} (a row holds the prompt and completion)")
            check(self.optim.qk_clip_tau == 0, f"{prefix}.optim.qk_clip_tau",
                  "QK-clip is not applied in RL steps: set it to 0")
        check(not (self.lora.enabled and self.optim.qk_clip_tau > 0), f"{prefix}.optim.qk_clip_tau",
              "QK-clip rescales q_b / kv_b, which a LoRA run freezes: set it to 0 with train.lora.rank > 0")


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

    @classmethod
    def of_model(cls, model: ModelConfig, name: str = "custom") -> "Config":
        """The run config of a model loaded from elsewhere (a HF checkpoint): default training settings,
        the row length cut to the model's context (``max_position_embeddings`` may be under the default)."""
        return cls(name=name, model=model,
                   train=TrainConfig(seq_len=min(TrainConfig.seq_len, model.max_seq_len)))

    def validate(self) -> None:
        self.model.validate("model")
        self.train.validate("train")
        self.mesh.validate("mesh")
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len",
               f"{self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        if self.mesh.sequence > 1:  # a row the shards do not split evenly would silently run unsharded
            check(self.train.seq_len % self.mesh.sequence == 0, "train.seq_len",
                  f"{self.train.seq_len} tokens per row do not split over mesh.sequence={self.mesh.sequence} shards")
            halo = self.model.kda.conv_size - 1 if self.model.uses("kda") else 0
            check(self.train.seq_len // self.mesh.sequence >= max(halo, 1), "train.seq_len",
                  f"{self.train.seq_len // self.mesh.sequence} tokens per sequence shard (mesh.sequence="
                  f"{self.mesh.sequence}) are fewer than the short conv's {halo}-token halo")
        check(self.train.optim.weight_rounding == "nearest" or self.model.param_dtype != "float32",
              "train.optim.weight_rounding", "stochastic rounds weights held below float32: set "
              "model.param_dtype=bfloat16 (float32 weights take the float32 sum as it is)")
        # the weights are differentiated in the gradient dtype: the forward is unchanged only when the layers
        # compute in it too
        check(self.train.grad_dtype == "float32" or self.train.grad_dtype == self.model.dtype, "train.grad_dtype",
              f"{self.train.grad_dtype} gradients need model.dtype={self.train.grad_dtype} (is {self.model.dtype})")



__all__ = ["LORA_SITES", "Config", "DataConfig", "LoRAConfig", "MeshConfig", "OptimConfig", "ProfileConfig", "TrainConfig",
           "WandbConfig"]

"""A job (one program to compile: config, mode, slice, mesh, batch) and the PLAN of the scale proof
(``python -m k3jax.aot`` without ``--config``; docs/scale.md holds its table). An ``rl`` job is two programs
on one mesh and one set of weights, its phases (:func:`rl_job`, ``k3jax.aot.compiling.compile_rl``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from k3jax.config import Config, MeshConfig, load_config


@dataclasses.dataclass(frozen=True)
class Job:
    """One program to compile. ``batch`` is the global number of rows; ``seq_len`` is tokens per row
    (train, rl) or the cache length, i.e. the context (decode, prefill). An ``rl`` job's ``phase`` names the
    program: ``rollout`` (the engine's decode step of every row, against ``seq_len + 1`` slots as the RL
    trainer's engine holds them) or ``train`` (``k3jax.rl.step.make_rl_step`` on ``[batch, seq_len]`` rows);
    ``""``: both (``compiling.compile_rl``)."""

    config: str
    mode: Literal["train", "decode", "prefill", "rl"]
    slice: str
    mesh: MeshConfig
    batch: int
    seq_len: int
    overrides: tuple[str, ...] = ()
    note: str = ""
    hbm_gib: float | None = None  # the budget the compiler is held to per device (None: the device's HBM)
    prefill_chunk: int = 0  # prefill: prompt tokens per row and call (0: the whole context in one call)
    phase: Literal["", "rollout", "train"] = ""  # rl: the program (above)
    # decode, prefill, an rl job's rollout: the weights' and caches' layout (k3jax.sharding.LAYOUTS; an rl job
    # takes train.rl.rollout_layout's); train jobs and rl updates use training's
    layout: Literal["serving", "training"] = "serving"

    def load(self) -> Config:
        return load_config(self.config, list(self.overrides))

    @property
    def program(self) -> str:
        """What the program is for the analytic model (``k3jax.aot.analytic``'s mode): the mode, and for an
        ``rl`` job its phase's (the rollout is a decode step, the update a train step)."""
        if self.mode != "rl":
            return self.mode
        return {"rollout": "decode", "train": "train"}[self.phase]


RL_LOSS = "grpo"  # the objective an rl job compiles when the config sets none (train.rl.loss=off)


def rl_job(config: str, slice: str, mesh: MeshConfig, seq_len: int | None = None, overrides: tuple[str, ...] = (),
           **kwargs) -> Job:
    """The ``rl`` job of a config (``python -m k3jax.aot --mode rl``): its rows are the rollout's,
    ``train.rl.prompts_per_step x train.rl.group_size``, each ``seq_len`` tokens (prompt + completion; default
    ``train.seq_len``). ``train.batch_size`` and ``train.seq_len`` are set to them and, where the config sets
    no RL objective, ``train.rl.loss`` to :data:`RL_LOSS` (an RL config validates them: ``k3jax.config``);
    these overrides follow the given ones in the job's."""
    probe = load_config(config, [*overrides, "train.rl.loss='off'"])  # the rows, before the RL checks
    rows, seq = probe.train.rl.rows, seq_len or probe.train.seq_len
    derived = (f"train.batch_size={rows}", f"train.seq_len={seq}")
    if load_config(config, [*overrides, *derived]).train.rl.loss == "off":
        derived += (f"train.rl.loss={RL_LOSS}",)
    job = Job(config, "rl", slice, mesh, rows, seq, (*overrides, *derived), **kwargs)
    # the rollout's layout is the run's (train.rl.rollout_layout); the RL checks (train.seq_len > max_new_tokens, ...)
    return dataclasses.replace(job, layout=job.load().train.rl.rollout_layout)


# The scale proof (docs/scale.md). Train: full K3 (float32 master weights, bf16 Muon momentum, AdamW
# for embeddings / norms / gates) on the smallest v5p slice it fits, 4096-token rows split over 4
# sequence shards, remat per layer, expert-parallel buffers at twice the fair share (QB keeps the
# busiest expert near 1.2x); dense weights FSDP over fsdp x sequence x expert, routed experts over
# expert x fsdp x sequence. Decode: one 1M-token sequence from bf16 weights, and from MXFP4 experts
# (the release's format) on half the slice.
_K3_TRAIN = ("model.remat=full", "model.moe.ep_capacity_factor=2.0", "train.optim.muon_dtype=bfloat16")
# K2 (no KDA, fewer experts per token) has the memory to keep the expert and attention outputs instead
# of recomputing them (1.33x instead of 1.64x the model FLOPs), once its expert buffers are cut to
# 1.25x the fair share (QB's busiest expert sits near 1.1-1.2x; `expert_imbalance` reports it per layer)
# float32 master weights: the precision this row was measured at (docs/scale.md) before configs/k2.yaml's
# default became bf16 weights with stochastic rounding
_K2_TRAIN = ("model.remat=selective", "model.moe.ep_capacity_factor=1.25", "train.optim.muon_dtype=bfloat16",
             "model.param_dtype=float32", "train.optim.weight_rounding=nearest")
_K3_LORA = ("train.lora.rank=16", "train.lora.targets=[mla,kda,shared]", "quant.experts=mxfp4",
            "model.param_dtype=bfloat16", "model.remat=full", "model.moe.ep_capacity_factor=2.0")
PLAN: tuple[Job, ...] = (
    Job("k3", "train", "v5p-2048", MeshConfig(data=1, fsdp=4, expert=64, sequence=4), batch=256, seq_len=4096,
        overrides=("train.batch_size=256", *_K3_TRAIN)),
    Job("k3", "train", "v5p-2048", MeshConfig(data=1, fsdp=4, expert=64, sequence=4), batch=256, seq_len=4096,
        overrides=("train.batch_size=256", *_K3_TRAIN, "model.vision.enabled=true", "model.vision.max_patches=4096"),
        note="+ MoonViT, 1024 image tokens per row"),
    # 16M tokens per step: 16 micro-batches of the row above; bf16 gradients keep the micro-batch
    # accumulator at the size of one copy of the gradients in bf16 (float32: 109 GiB, does not fit)
    Job("k3", "train", "v5p-2048", MeshConfig(data=1, fsdp=4, expert=64, sequence=4), batch=4096, seq_len=4096,
        overrides=("train.batch_size=4096", "train.grad_accum=16", "train.grad_dtype=bfloat16", *_K3_TRAIN),
        note="16 micro-batches, bf16 gradients"),
    # the same step on half the chips, held to 90 GiB per device (headroom under the 95.74): capacity 1.25, the in-place
    # optimizer, unhoisted weight casts, and the mixers' input projections offloaded to host memory (docs/scale.md)
    Job("k3", "train", "v5p-1024", MeshConfig(data=1, fsdp=2, expert=64, sequence=4), batch=256, seq_len=4096,
        overrides=("train.batch_size=256", "model.remat=outputs_offload", "model.moe.ep_capacity_factor=1.25",
                   "train.optim.muon_dtype=bfloat16"), note="capacity 1.25, outputs_offload", hbm_gib=90),
    Job("k3", "decode", "v5p-128", MeshConfig(data=1, fsdp=1, expert=64), batch=1, seq_len=1 << 20,
        overrides=("model.param_dtype=bfloat16",), note="bf16 weights"),
    Job("k3", "decode", "v5p-64", MeshConfig(data=1, fsdp=1, expert=32), batch=1, seq_len=1 << 20,
        overrides=("model.param_dtype=bfloat16", "quant.experts=mxfp4"), note="MXFP4 experts"),
    Job("k2", "train", "v5p-512", MeshConfig(data=1, fsdp=2, expert=64, sequence=2), batch=128, seq_len=4096,
        overrides=("train.batch_size=128", *_K2_TRAIN), note="selective remat, capacity 1.25"),
    # LoRA fine-tuning of the release: the routed experts frozen in MXFP4 and the rest frozen in bf16 (no
    # optimizer state, no weight gradients), rank-16 adapters on MLA, KDA and the shared experts in float32
    Job("k3", "train", "v5p-128", MeshConfig(data=1, fsdp=1, expert=64), batch=64, seq_len=4096,
        overrides=("train.batch_size=64", *_K3_LORA), note="LoRA r16, frozen MXFP4 experts + bf16"),
)


__all__ = ["PLAN", "RL_LOSS", "Job", "rl_job"]

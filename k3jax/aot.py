"""Ahead-of-time compiles for TPU pod slices on a CPU-only host: the proof that a config fits.

::

    python -m k3jax.aot --write table.md                  # the PLAN below (docs/scale.md holds its table)
    python -m k3jax.aot --config k3 --mode train --slice v5p-2048 --mesh fsdp=4,sequence=4,expert=64 --batch 256 \
        train.batch_size=256 model.remat=full model.moe.ep_capacity_factor=2.0 train.optim.muon_dtype=bfloat16
    python -m k3jax.aot --config k3 --mode decode --slice v5p-128 --mesh expert=64 --batch 1 --seq-len 1048576
    python -m k3jax.aot --config k3 --mode prefill --slice v5p-128 --mesh expert=64 --seq-len 1048576 \
        --prefill-chunk 16384

``jax[tpu]`` ships libtpu, whose compiler runs without a TPU: ``get_topology_desc`` describes the
devices of a slice, a mesh is built on them (``k3jax.sharding.make_mesh``), and the *real* programs
are lowered from ``ShapeDtypeStruct`` arguments that carry the rule-derived shardings and compiled:

- ``train``: ``k3jax.training.step.make_train_step`` over the split ``TrainState`` (model, per-head Muon +
  AdamW state, step counters), built abstractly (``abstract_model`` + ``jax.eval_shape``: nothing is
  allocated, the full K3 state builds in about a second), state donated.
- ``decode``: one token of ``model(tokens, cache=cache)`` (the step ``k3jax.generate`` loops over)
  against a cache of ``seq_len`` slots (``model.init_cache``), cache donated.
- ``prefill``: ``prefill_chunk`` prompt tokens per row of the same call, written into (and attending
  over) a cache of ``seq_len`` slots: the program the serving engine's chunked prefill runs
  ``seq_len / prefill_chunk`` times for a full-length prompt (the cache position is traced, so every
  chunk is this program; the last one attends over the whole context).

Fitting: every program is compiled with libtpu held to an HBM budget per device
(``xla_tpu_max_hbm_size_mib``; the device's HBM, or ``--hbm-gib``). The compiler refuses a program
it cannot fit in it (``RESOURCE_EXHAUSTED``), reported as "does not fit" with the size it asked for; a
program it accepts fits. ``compiled.memory_analysis()`` gives per-device argument / output / alias /
temp bytes, shown beside the verdict. For large programs its temp figure counts more than the
compiler's own check does: the optimizer update of full K3 alone compiles under a 68.4 GiB budget
(and is refused under 64.9) while memory_analysis reports 73.1 GiB of arguments and temporaries, and
its preallocated temporary buffer (``--xla-dump``'s buffer assignment) is 12.5 GiB where it reports
21.4. The difference is not in the dumps; the budget is the compiler's verdict.

FLOPs: ``compiled.cost_analysis()['flops']`` is per device and counts the body of every loop once
(a ``lax.scan`` over the K3 layer groups runs 22 times but is counted once). The step's FLOPs are
therefore ``devices * (F + (G - 1) * F_group)``, with ``F_group = F - F_no_groups`` measured by
compiling the same step for the model without its scanned group stack. The optimizer's
Newton-Schulz of a stacked weight runs in a loop over its layers, so this multiplies it correctly
only when a loop step orthogonalises one layer (``newton_schulz.layers_per_step``); with several
per step it over-counts it by that number (``--breakdown`` applies every loop's trip count instead).
The elementwise optimizer work of the stacked weights, under 0.1%, is over-counted.
Gradient accumulation is one more loop: with ``grad_accum = A > 1`` the FLOPs come from the step
compiled for one micro-batch (``A = 1``, the same per-device shapes) as ``A * micro - (A - 1) * NS``
(the optimizer runs once per step; NS, its Newton-Schulz, counted analytically); a program already
compiled in the process (e.g. that micro-batch step as a job of its own) is not compiled again. The
memory figures are always those of the real accumulating step. Loops inside a layer are still counted
once: the chunked KDA's scan over chunks (its inter-chunk state recurrence, under 1% of a KDA layer)
and blockwise attention over more than one key block.
``6 * N_active * tokens`` (training) and ``2 * N_active * tokens`` (one decode step) are the model
FLOPs; the ratio shows recompute (remat), attention, routing, the expert-parallel buffers' padding
and the optimizer; the Newton-Schulz part of it is counted analytically and shown separately.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import re
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from k3jax import analytic
from k3jax import breakdown as hlo_breakdown
from k3jax.analytic import newton_schulz_flops
from k3jax.config import Config, MeshConfig, VisionConfig, load_config
from k3jax.data.images import IMAGE_KEY_PREFIX
from k3jax.model import K3Model, abstract_model
from k3jax.sharding import (DEFAULT_RULES, MESH_AXES, TEXT_BATCH_KEYS, Rules, abstract_with_shardings,
                            batch_array_axes, cache_shardings, logical_to_spec, make_mesh, named_sharding, parse_mesh,
                            state_shardings)
from k3jax.training.step import abstract_train_state, make_train_step

GIB = 1024**3
# HBM per v5p device as libtpu's compiler budgets it (the limit its RESOURCE_EXHAUSTED message
# quotes); Cloud TPU documents 95 GiB usable of 96 GiB physical per chip.
V5P_HBM_BYTES = int(95.74 * GIB)
# v5p per chip (Cloud TPU's published figures): 459 TFLOP/s bf16, 4,800 Gbit/s of ICI over its links.
V5P_PEAK_FLOPS = 459e12
V5P_ICI_BYTES_PER_S = 4800e9 / 8
# v5p slices as Cloud TPU names them (v5p-N: N TensorCores = 2 per chip) -> chips per dimension.
# A v5p chip is one JAX device (megacore: its two TensorCores act as one).
V5P_SHAPES = {
    "v5p-8": (2, 2, 1), "v5p-16": (2, 2, 2), "v5p-64": (2, 4, 4), "v5p-128": (4, 4, 4),
    "v5p-256": (4, 4, 8), "v5p-512": (4, 8, 8), "v5p-1024": (8, 8, 8), "v5p-1536": (8, 8, 12),
    "v5p-2048": (8, 8, 16), "v5p-4096": (8, 16, 16),
}
_CUBE = 4  # a full v5p cube is 4x4x4 chips; slices of whole cubes are wrapped into a 3D torus
_CHIPS_PER_HOST = (2, 2, 1)
_BATCH_DTYPES = {"loss_mask": jnp.float32}  # the data pipeline's dtypes; the rest are int32


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU pod slice to compile for (no TPU needed)."""

    name: str  # e.g. "v5p-1024"
    chips: tuple[int, ...]  # chips per torus dimension, e.g. (8, 8, 8)
    hbm_bytes: int  # per device

    @classmethod
    def v5p(cls, name: str) -> "TpuSlice":
        if name not in V5P_SHAPES:
            raise ValueError(f"unknown slice {name!r}; known: {', '.join(V5P_SHAPES)}")
        return cls(name, V5P_SHAPES[name], V5P_HBM_BYTES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.chips)

    @property
    def topology(self) -> str:
        return "v5:" + "x".join(map(str, self.chips))

    def devices(self) -> list:
        """libtpu's device descriptions of the slice (usable in a Mesh for lowering and compiling)."""
        from jax.experimental import topologies

        full_cube = all(c % _CUBE == 0 for c in self.chips)
        topo = topologies.get_topology_desc(platform="tpu", topology_name=self.topology, chip_config_name="megacore",
                                            chips_per_host_bounds=_CHIPS_PER_HOST, num_slices=1,
                                            wrap=(full_cube,) * len(self.chips))
        return list(topo.devices)


@dataclasses.dataclass(frozen=True)
class Job:
    """One program to compile. ``batch`` is the global number of rows; ``seq_len`` is tokens per row
    (train) or the cache length, i.e. the context (decode)."""

    config: str
    mode: Literal["train", "decode", "prefill"]
    slice: str
    mesh: MeshConfig
    batch: int
    seq_len: int
    overrides: tuple[str, ...] = ()
    note: str = ""
    hbm_gib: float | None = None  # the budget the compiler is held to per device (None: the device's HBM)
    prefill_chunk: int = 0  # prefill: prompt tokens per row and call (0: the whole context in one call)

    def load(self) -> Config:
        return load_config(self.config, list(self.overrides))


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
_K2_TRAIN = ("model.remat=selective", "model.moe.ep_capacity_factor=1.25", "train.optim.muon_dtype=bfloat16")
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
    # optimizer and unhoisted weight casts (docs/scale.md)
    Job("k3", "train", "v5p-1024", MeshConfig(data=1, fsdp=2, expert=64, sequence=4), batch=256, seq_len=4096,
        overrides=("train.batch_size=256", "model.remat=full", "model.moe.ep_capacity_factor=1.25",
                   "train.optim.muon_dtype=bfloat16"), note="capacity 1.25", hbm_gib=90),
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


@dataclasses.dataclass(frozen=True)
class Result:
    """Per-device memory (bytes) and FLOPs of one compiled job; ``error`` set when it did not fit."""

    job: Job
    mesh_shape: dict
    num_devices: int
    hbm_bytes: int  # the device's HBM
    hbm_limit_bytes: int = 0  # the budget the compiler was held to (0: none, e.g. not a TPU target)
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    code_bytes: int = 0
    compiled_flops: float = 0.0  # per device, loop bodies counted once (XLA's cost analysis)
    step_flops: float = 0.0  # all devices, loop trip counts applied (module docstring); 0 = not measured
    model_flops: float = 0.0  # 6 (train; 4 + adapters for LoRA) or 2 (decode) * N_active * tokens (analytic.model_flops)
    ns_flops: float = 0.0  # of step_flops: the optimizer's Newton-Schulz iterations (analytic count)
    compile_seconds: float = 0.0
    error: str = ""
    breakdown: hlo_breakdown.Breakdown | None = None  # per device, from the optimized HLO (--breakdown)
    # the same with the data-dependent loops not run (the dropless exchange's overflow rounds); None: none
    breakdown_no_overflow: hlo_breakdown.Breakdown | None = None
    analytic: dict | None = None  # all devices' analytic FLOPs per part (k3jax.analytic.step_flops)

    @property
    def total_bytes(self) -> int:
        """What one device holds at the peak: arguments + outputs - donated (aliased) + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """Compiled under a budget no larger than the device's HBM (module docstring); without a budget,
        memory_analysis's total against the HBM."""
        if self.error:
            return False
        return 0 < self.hbm_limit_bytes <= self.hbm_bytes or self.total_bytes <= self.hbm_bytes

    @property
    def flops_ratio(self) -> float:
        return self.step_flops / self.model_flops if self.model_flops else float("nan")

    @property
    def tokens(self) -> int:
        per_row = {"train": self.job.seq_len, "decode": 1, "prefill": self.job.prefill_chunk or self.job.seq_len}
        return self.job.batch * per_row[self.job.mode]


# ---------------------------------------------------------------------------------------------
# Abstract state, batches and caches


def abstract_batch(mesh, batch: int, seq_len: int, rules: Rules = DEFAULT_RULES,
                   vision: VisionConfig | None = None) -> dict:
    """The training batch as sharded ShapeDtypeStructs: the text arrays ``[batch, seq_len]`` and, for
    an enabled vision tower, the packed-image arrays of ``k3jax.data.images`` (``vision.max_patches``
    patch slots per row), split along the batch only."""
    shape = (batch, seq_len)
    out = {k: jax.ShapeDtypeStruct(shape, _BATCH_DTYPES.get(k, jnp.int32),
                                   sharding=named_sharding(mesh, batch_array_axes(k, len(shape)), shape, rules))
           for k in TEXT_BATCH_KEYS}
    if vision is not None and vision.enabled:
        p, m, side = vision.max_patches, vision.merge_size, vision.patch_size
        merged = p // (m * m)
        fields = {"patches": ((batch, p, 3, side, side), jnp.float32), "merge_index": ((batch, merged, m * m), jnp.int32),
                  "merged_valid": ((batch, merged), jnp.bool_),
                  **{f: ((batch, p), jnp.int32) for f in ("segment_ids", "rows", "cols", "grid_h", "grid_w")}}
        for name, (shp, dtype) in fields.items():
            key = IMAGE_KEY_PREFIX + name
            out[key] = jax.ShapeDtypeStruct(shp, dtype, sharding=named_sharding(mesh, batch_array_axes(key, len(shp)), shp,
                                                                                rules))
    return out


def without_groups(model: K3Model) -> K3Model:
    """The abstract model with its scanned layer stack removed (prefix and suffix layers, embedding and
    head unchanged): the baseline that isolates one group's FLOPs."""
    model.groups = None
    model.plan = dataclasses.replace(model.plan, num_groups=0)
    return model


# ---------------------------------------------------------------------------------------------
# Compiling


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                code_bytes=m.generated_code_size_in_bytes)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


# Per-device FLOPs of each program compiled in this process, by (target, program text): the FLOP
# count's extra compiles (one micro-batch, no layer stack) are often a program compiled before (a job
# without accumulation, the same model's baseline), and topology executables cannot be kept in the
# persistent cache (``_no_persistent_cache``).
_FLOPS_BY_PROGRAM: dict[tuple, float] = {}


def _program_key(lowered, mesh) -> tuple:
    device = mesh.devices.flat[0]
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return getattr(device, "device_kind", device.platform), mesh.size, text


def _compiled_flops(lowered, mesh) -> float:
    key = _program_key(lowered, mesh)
    if key not in _FLOPS_BY_PROGRAM:
        with _no_persistent_cache():
            _FLOPS_BY_PROGRAM[key] = _flops(lowered.compile())
    return _FLOPS_BY_PROGRAM[key]


OOM_DETAIL_LINES = 80  # of libtpu's out-of-memory report, which lists the largest allocations
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|exceeds available HBM", re.I)


def _oom_summary(err: Exception) -> str:
    """The compiler's own words on how much it needed (first line of the error)."""
    text = str(err)
    m = re.search(r"(Ran out of memory in memory space hbm[^.]*\.|[^\n]*exceeds available HBM[^\n]*)", text)
    return (m.group(1) if m else text.splitlines()[0])[:400]


def job_model(cfg: Config, mode: str) -> K3Model:
    """The abstract model a job compiles: a training job of a LoRA config (``train.lora``) carries its
    adapters (the state then trains only them, over the frozen weights); inference jobs never do
    (adapters are merged into the weights before serving)."""
    return abstract_model(cfg.model, lora=cfg.train.lora if mode == "train" else None)


def _lower_train(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int):
    graphdef, state = abstract_train_state(cfg, model)
    state_sh = state_shardings(state, mesh, rules)
    args = (abstract_with_shardings(state, state_sh), abstract_batch(mesh, batch, seq_len, rules, cfg.model.vision))
    step = make_train_step(graphdef, cfg)
    step = getattr(step, "__wrapped__", step)  # re-jit the same function with explicit shardings
    batch_sh = {k: v.sharding for k, v in args[1].items()}
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                     donate_argnums=0)
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


def _lower_decode(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int, new_tokens: int = 1):
    """``new_tokens`` per row (1: a decode step; more: a prefill chunk) against a cache of ``seq_len`` slots."""
    graphdef, state = nnx.split(model)
    state_sh = state_shardings(state, mesh, rules)
    cache = jax.eval_shape(lambda: model.init_cache(batch, seq_len))
    cache_sh = cache_shardings(cache, mesh, rules)
    tok_sh = NamedSharding(mesh, logical_to_spec(("batch", None), rules, mesh, (batch, new_tokens)))
    logits_sh = NamedSharding(mesh, logical_to_spec(("batch", "vocab"), rules, mesh, (batch, cfg.model.vocab_size)))

    def decode_step(state, cache, tokens):
        """tokens ``[B, new_tokens]`` -> (last logits ``[B, V]`` float32, updated cache)."""
        logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
        return logits[:, -1], cache

    jitted = jax.jit(decode_step, in_shardings=(state_sh, cache_sh, tok_sh), out_shardings=(logits_sh, cache_sh),
                     donate_argnums=1)
    args = (abstract_with_shardings(state, state_sh), abstract_with_shardings(cache, cache_sh),
            jax.ShapeDtypeStruct((batch, new_tokens), jnp.int32, sharding=tok_sh))
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


def _step_flops(cfg: Config, job: Job, mesh, rules: Rules, lower, per_device: float, ns_flops: float,
                log) -> float:
    """All devices' FLOPs of one step with the loop trip counts applied (module docstring).

    With gradient accumulation the micro-batch loop is one more loop XLA counts once, so the FLOPs
    come from the step compiled for one micro-batch (``grad_accum=1``; same per-device shapes):
    ``A * micro - (A - 1) * NS``, the optimizer (Newton-Schulz, analytic) running once per step."""
    accum = cfg.train.grad_accum if job.mode == "train" else 1
    batch = job.batch // accum
    if accum > 1:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=1, batch_size=batch))
        log(f"  grad_accum={accum}: compiling one micro-batch's step for the FLOPs")
        per_device = _compiled_flops(lower(cfg, mesh, job_model(cfg, job.mode), rules, batch, job.seq_len), mesh)
    groups = job_model(cfg, job.mode).plan.num_groups
    if groups > 1:
        log(f"  {groups} scanned groups: compiling the step without them for the per-group FLOPs")
        baseline = lower(cfg, mesh, without_groups(job_model(cfg, job.mode)), rules, batch, job.seq_len)
        per_device += (groups - 1) * (per_device - _compiled_flops(baseline, mesh))
    return accum * per_device * mesh.size - (accum - 1) * ns_flops


@contextlib.contextmanager
def _no_persistent_cache():
    """Topology executables cannot be loaded back without a TPU client, and full-K3 ones are large:
    keep them out of the persistent compilation cache (``k3jax.runtime.compile_cache``)."""
    saved = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", saved)


def compile_job(job: Job, *, rules: Rules = DEFAULT_RULES, flops: bool = True, breakdown: bool = False,
                devices=None, hbm_limit_bytes: int | None = None, log=print) -> Result:
    """Lower and compile ``job`` for its slice, with the compiler held to ``hbm_limit_bytes`` per
    device (default: the device's HBM; module docstring); with ``flops``, one more compile without the
    layer stack gives the step's FLOPs with the loop trip counts applied. With ``breakdown`` the
    optimized HLO is attributed to the model's parts instead (``k3jax.breakdown``: matmul FLOPs with
    trip counts, kernels included, HBM and collective bytes), which needs no second compile."""
    cfg = job.load()
    tpu = TpuSlice.v5p(job.slice)
    mesh = make_mesh(job.mesh, tpu.devices() if devices is None else devices)
    if mesh.devices.flat[0].platform != "tpu":
        limit = 0  # the budget is a libtpu option
    elif hbm_limit_bytes is not None:
        limit = hbm_limit_bytes
    else:
        limit = tpu.hbm_bytes if job.hbm_gib is None else int(job.hbm_gib * GIB)
    base = dict(job=job, mesh_shape={a: mesh.shape[a] for a in MESH_AXES if mesh.shape[a] > 1},
                num_devices=mesh.size, hbm_bytes=tpu.hbm_bytes, hbm_limit_bytes=limit)
    options = {"xla_tpu_max_hbm_size_mib": limit // 2**20} if limit else {}
    lower = {"train": _lower_train, "decode": _lower_decode,
             "prefill": functools.partial(_lower_decode, new_tokens=job.prefill_chunk or job.seq_len)}[job.mode]
    t0 = time.perf_counter()
    try:
        lowered = lower(cfg, mesh, job_model(cfg, job.mode), rules, job.batch, job.seq_len)
        log(f"  lowered in {time.perf_counter() - t0:.0f} s; compiling")
        with _no_persistent_cache():
            compiled = lowered.compile(options)
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory verdict is a result
        if not _OOM.search(str(e)):
            raise
        log("  " + "\n  ".join(str(e).splitlines()[:OOM_DETAIL_LINES]))  # the largest allocations
        return Result(**base, compile_seconds=time.perf_counter() - t0, error=_oom_summary(e))
    seconds = time.perf_counter() - t0
    per_device = _flops(compiled)
    if flops and not breakdown:
        _FLOPS_BY_PROGRAM[_program_key(lowered, mesh)] = per_device
    result = Result(**base, **_memory(compiled), compiled_flops=per_device, compile_seconds=seconds)
    text = compiled.as_text() if breakdown else ""
    parts = hlo_breakdown.breakdown(text) if breakdown else None
    no_overflow = hlo_breakdown.breakdown(text, 0) if parts is not None and parts.data_dependent_loops else None
    del compiled, lowered, text
    model_flops = analytic.model_flops(cfg, result.tokens, job.mode)
    ns_flops = newton_schulz_flops(cfg) if job.mode == "train" else 0.0
    step_flops = 0.0
    if parts is not None:
        step_flops = parts.total_flops * mesh.size
        expected = analytic.step_flops(cfg, result.tokens, job.seq_len, job.mode)  # Newton-Schulz included
        result = dataclasses.replace(result, breakdown=parts, analytic=expected, breakdown_no_overflow=no_overflow)
    elif flops:
        step_flops = _step_flops(cfg, job, mesh, rules, lower, per_device, ns_flops, log)
    return dataclasses.replace(result, step_flops=step_flops, model_flops=model_flops, ns_flops=ns_flops)


def breakdown_report(r: Result) -> tuple[str, dict]:
    """The per-part table (per device) and its JSON, with the step's ratios and the time of its
    collectives at v5p ICI bandwidth next to its compute at peak."""
    b, n = r.breakdown, r.num_devices
    ns = b.part_flops("newton_schulz")
    model = r.model_flops / n
    attention = sum(analytic.mixing_flops_per_token(r.job.load().model, r.job.seq_len, r.job.mode).values())
    attention *= analytic.STEP_FACTOR[r.job.mode] * r.tokens / n
    compute_s = b.total_flops / V5P_PEAK_FLOPS
    comm_s = sum(b.collective_bytes.values()) / V5P_ICI_BYTES_PER_S
    summary = {
        "flops_per_device": b.total_flops, "model_flops_per_device": model,
        "ratio_without_ns": (b.total_flops - ns) / model if model else float("nan"),
        "ratio_without_ns_with_attention": (b.total_flops - ns) / (model + attention) if model else float("nan"),
        "ns_flops_per_device": ns, "ns_analytic_per_device": r.ns_flops / n,
        "ns_ratio": ns / (r.ns_flops / n) if r.ns_flops else float("nan"),
        "attributed_share": b.attributed_share,
        "compute_s_at_peak": compute_s, "collective_s_at_ici": comm_s,
        "collective_bytes": dict(b.collective_bytes), "memory_gib": r.total_bytes / GIB,
        "data_dependent_loops": b.data_dependent_loops,
    }
    z = r.breakdown_no_overflow
    if z is not None:  # the loops whose trip count depends on the data, counted once above, not run here
        summary["without_data_dependent_loops"] = {
            "flops_per_device": z.total_flops, "collective_bytes": dict(z.collective_bytes),
            "compute_s_at_peak": z.total_flops / V5P_PEAK_FLOPS,
            "collective_s_at_ici": sum(z.collective_bytes.values()) / V5P_ICI_BYTES_PER_S}
    lines = [hlo_breakdown.table(b, r.analytic, devices=n), "",
             "| collective | GB per device | s at ICI |", "|---|---|---|"]
    lines += [f"| {k} | {v / 1e9:.2f} | {v / V5P_ICI_BYTES_PER_S:.3f} |" for k, v in sorted(b.collective_bytes.items())]
    lines += ["", f"FLOPs / (6 or 2) N_active tokens, Newton-Schulz apart: {summary['ratio_without_ns']:.2f} "
              f"({summary['ratio_without_ns_with_attention']:.2f} with attention in the denominator); "
              + (f"Newton-Schulz {summary['ns_ratio']:.2f}x its analytic count per device; " if r.ns_flops else "")
              + f"{b.attributed_share:.1%} attributed; "
              f"compute at peak {compute_s:.2f} s, collectives at ICI {comm_s:.2f} s"]
    if z is not None:
        w = summary["without_data_dependent_loops"]
        lines += [f"{b.data_dependent_loops:.0f} data-dependent loop runs (the dropless exchange's overflow rounds) "
                  f"counted once each above; not run (every device's pairs within a round): {w['flops_per_device']:.3e} "
                  f"FLOPs, collectives " + " / ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(w["collective_bytes"].items()))
                  + f" GB, compute at peak {w['compute_s_at_peak']:.2f} s, collectives at ICI "
                  f"{w['collective_s_at_ici']:.2f} s"]
    return "\n".join(lines), {**b.to_json(), "summary": summary, "analytic_per_device":
                              {k: v / n for k, v in (r.analytic or {}).items()}}


# ---------------------------------------------------------------------------------------------
# Reporting


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _mesh_str(shape: dict) -> str:
    return " x ".join(f"{a} {n}" for a, n in shape.items() if n > 1) or "1 device"


TABLE_HEADER = ("| config | program | slice (devices) | mesh | global batch | argument GiB | output GiB | "
                "temp GiB | total GiB / HBM | fits | FLOPs/step | model FLOPs | ratio | of which NS | compile s |")


def _verdict(r: Result) -> str:
    """The fits column: the compiler's verdict, and the budget when it was below the HBM."""
    if not r.fits:
        return "no"
    return f"yes, under {_gib(r.hbm_limit_bytes)}" if 0 < r.hbm_limit_bytes < r.hbm_bytes else "yes"


def table(results: list[Result]) -> str:
    """A Markdown table of per-device memory and step FLOPs (output GiB: not aliased to arguments)."""
    rows = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    for r in results:
        j = r.job
        what = {"train": f"train {j.batch} x {j.seq_len}", "decode": f"decode {j.batch} x 1 @ {j.seq_len:,} ctx",
                "prefill": f"prefill {j.batch} x {j.prefill_chunk or j.seq_len:,} @ {j.seq_len:,} ctx"}[j.mode]
        if j.note:
            what += f" ({j.note})"
        if r.error:
            mem = f"| – | – | – | {r.error} | no |"
        else:
            mem = (f"| {_gib(r.argument_bytes)} | {_gib(r.output_bytes - r.alias_bytes)} | {_gib(r.temp_bytes)} | "
                   f"{_gib(r.total_bytes)} / {_gib(r.hbm_bytes)} | {_verdict(r)} |")
        if r.step_flops:
            ns = f"{r.ns_flops / r.model_flops:.2f}" if r.ns_flops else "–"
            fl = f"{r.step_flops:.3e} | {r.model_flops:.3e} | {r.flops_ratio:.2f} | {ns}"
        else:
            fl = "– | – | – | –"
        rows.append(f"| {j.config} | {what} | {j.slice} ({r.num_devices}) | {_mesh_str(r.mesh_shape)} | "
                    f"{j.batch} {mem} {fl} | {r.compile_seconds:.0f} |")
    return "\n".join(rows)


def _compile_on_cpu() -> None:
    """The command line's process setup (importing this module sets nothing): compiling for a TPU
    topology needs no TPU, so JAX's backends stay on the CPU (libtpu would otherwise try to claim a
    local TPU) unless ``JAX_PLATFORMS`` says otherwise, and several processes may load libtpu at once.
    A library caller of :meth:`TpuSlice.devices` sets the same (tests/conftest.py does)."""
    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")  # the variable itself is read when jax is imported
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def main(argv: list[str] | None = None) -> None:
    _compile_on_cpu()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="config name or path (default: run the PLAN)")
    ap.add_argument("--mode", choices=("train", "decode", "prefill"), default="train")
    ap.add_argument("--slice", default="v5p-1024", help=f"one of {', '.join(V5P_SHAPES)}")
    ap.add_argument("--mesh", default="", help="axis sizes, e.g. fsdp=8,expert=64 (unlisted axes: 1)")
    ap.add_argument("--batch", type=int, help="global rows (default: one per device for train, 1 for decode)")
    ap.add_argument("--seq-len", type=int, help="train: tokens per row (default train.seq_len); decode, prefill: "
                    "context (cache slots; default model.max_seq_len)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill: prompt tokens per row and call, written "
                    "into the cache at a traced position (default: the whole context in one call)")
    ap.add_argument("--no-flops", action="store_true", help="skip the extra compile for the per-group FLOPs")
    ap.add_argument("--breakdown", nargs="?", const="", metavar="JSON", help="attribute the compiled step's FLOPs, "
                    "HBM and collective bytes to the model's parts (k3jax/breakdown.py); print the table, and write "
                    "the JSON to this path if given")
    ap.add_argument("--hbm-gib", type=float, help="hold the compiler to this much HBM per device (default: the "
                    "device's); it refuses a program that does not fit")
    ap.add_argument("--write", metavar="PATH", help="also write the table to this Markdown file")
    ap.add_argument("--xla-dump", metavar="DIR", help="write XLA's dumps there (per program: the optimized HLO and "
                    "*memory-usage-report.txt, the largest buffers; written even when the program does not fit)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.remat=dots")
    args = ap.parse_args(argv)
    if args.breakdown and "=" in args.breakdown:  # `--breakdown a.b=c`: an override taken for the JSON path
        ap.error(f"--breakdown's value {args.breakdown!r} looks like a config override: give a JSON path "
                 "(--breakdown out.json) or put --breakdown after the overrides")
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        ap.error(f"--hbm-gib must be positive, got {args.hbm_gib}")
    if args.xla_dump:  # read when the first backend starts, which has not happened yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.xla_dump}".strip()
    if args.config:
        cfg = load_config(args.config, args.overrides)
        mesh = parse_mesh(args.mesh)
        devices = TpuSlice.v5p(args.slice).num_devices
        batch = args.batch or (devices if args.mode == "train" else 1)
        seq = args.seq_len or (cfg.train.seq_len if args.mode == "train" else cfg.model.max_seq_len)
        if args.mode == "train" and mesh.sequence > 1 and seq % mesh.sequence:
            ap.error(f"--seq-len {seq}: the rows do not split over the mesh's sequence={mesh.sequence} shards")
        if args.mode == "prefill" and not 0 <= args.prefill_chunk <= seq:
            ap.error(f"--prefill-chunk {args.prefill_chunk} must be in [1, --seq-len {seq}] (0: the whole context)")
        jobs = [Job(args.config, args.mode, args.slice, mesh, batch, seq, tuple(args.overrides), hbm_gib=args.hbm_gib,
                    prefill_chunk=args.prefill_chunk if args.mode == "prefill" else 0)]
    else:  # the PLAN, each job under its own budget unless --hbm-gib overrides them all
        jobs = [job if args.hbm_gib is None else dataclasses.replace(job, hbm_gib=args.hbm_gib) for job in PLAN]
    results = []
    for job in jobs:
        print(f"{job.config} {job.mode} on {job.slice} ({_mesh_str(dataclasses.asdict(job.mesh))}):", flush=True)
        r = compile_job(job, flops=not args.no_flops, breakdown=args.breakdown is not None,
                        log=lambda s: print(s, flush=True))
        print(f"  {'fits' if r.fits else 'DOES NOT FIT'} ({_verdict(r)}): memory_analysis {_gib(r.total_bytes)} GiB, "
              f"HBM {_gib(r.hbm_bytes)}"
              f"{' (' + r.error + ')' if r.error else ''}; {r.compile_seconds:.0f} s", flush=True)
        if r.breakdown is not None:
            text, data = breakdown_report(r)
            print(text, flush=True)
            if args.breakdown:
                pathlib.Path(args.breakdown).write_text(json.dumps(data, indent=1, default=float) + "\n")
        results.append(r)
    text = table(results)
    print(text)
    if args.write:
        pathlib.Path(args.write).write_text(text + "\n")
    sys.exit(0 if all(r.fits for r in results) else 1)


if __name__ == "__main__":
    main()

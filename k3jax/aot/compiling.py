"""Lowering and compiling a job for its slice from abstract (``ShapeDtypeStruct``) arguments that carry
the rule-derived shardings, under an HBM budget, and the step's FLOPs.

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

Reinforcement learning (``rl`` jobs, :func:`compile_rl`): rollouts and updates run on one mesh with one set
of weight arrays (``k3jax.rl.trainer``), so two programs are compiled from one abstract train state and its
shardings: the **rollout**, the serving engine's own decode step (``k3jax.serving.programs.decode_program``,
recording routes and sampled log-probabilities) of every row (``train.rl.prompts_per_step x group_size``)
against the engine's pool of ``seq_len + 1`` slots, on the train state's model arrays (LoRA: the adapters with
the frozen base) in the rollout's layout (``train.rl.rollout_layout``: ``serving``, a copy made before each
rollout by one reshard, :func:`lower_weight_transfer`, whose collectives are reported; ``training``, the
arrays as they are); and the **update**, ``k3jax.rl.step.make_rl_step`` on the rows ``[rows, seq_len]`` with
the rollout's routes replayed (``train.rl.routing_replay``), in the training layout. Each phase's arrays that
the other keeps on the device stay resident through it: through the rollout the optimizer state (the whole
train state beside a serving copy), through the update the engine's pool (cache, last logits, keys). Each phase is therefore compiled held to
the HBM budget less those resident bytes (the fits column's "under"), and its report adds them to its
memory_analysis total (``Result.resident_bytes``); the larger of the two sums is the job's peak. Their
FLOPs and collectives come from the breakdown (``k3jax.aot.breakdown``) even without ``--breakdown``: the
cost-analysis count's second program, without the layer stack, cannot record the dropped layers' routes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.aot import analytic
from k3jax.aot import breakdown as hlo_breakdown
from k3jax.aot.analytic import newton_schulz_flops
from k3jax.aot.plan import Job
from k3jax.aot.slices import GIB, TpuSlice
from k3jax.cache import init_cache
from k3jax.config import Config, ModelConfig, VisionConfig
from k3jax.data.images import IMAGE_KEY_PREFIX
from k3jax.model import K3Model, abstract_model, moe_layers
from k3jax.rl.step import make_rl_step, replays
from k3jax.serving.programs import decode_program
from k3jax.sharding import (DEFAULT_RULES, LAYOUTS, MESH_AXES, TEXT_BATCH_KEYS, TRAINING, Layout, Rules,
                            abstract_with_shardings, batch_array_axes, cache_shardings, logical_to_spec, make_mesh,
                            named_sharding, state_shardings)
from k3jax.training.step import abstract_train_state, make_train_step

_BATCH_DTYPES = {"loss_mask": jnp.float32}  # the data pipeline's dtypes; the rest are int32


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
    # host memory (pinned_host) the program holds per device at its peak: residuals a remat policy offloads
    # (model.remat=outputs_offload), moved to the host in the forward pass and back in the backward
    host_temp_bytes: int = 0
    compiled_flops: float = 0.0  # per device, loop bodies counted once (XLA's cost analysis)
    step_flops: float = 0.0  # all devices, loop trip counts applied (module docstring); 0 = not measured
    model_flops: float = 0.0  # 6 (train; 4 + adapters for LoRA) or 2 (decode) * N_active * tokens (analytic.model_flops)
    ns_flops: float = 0.0  # of step_flops: the optimizer's Newton-Schulz iterations (analytic count)
    compile_seconds: float = 0.0
    error: str = ""
    breakdown: hlo_breakdown.Breakdown | None = None  # per device, from the optimized HLO (--breakdown)
    # the same with the data-dependent loops not run (the dropless exchange's overflow rounds); None: none
    breakdown_no_overflow: hlo_breakdown.Breakdown | None = None
    analytic: dict | None = None  # all devices' analytic FLOPs per part (k3jax.aot.analytic.step_flops)
    # decode, prefill: all devices' bytes the step must read from HBM, per kind (analytic.step_read_bytes)
    read_bytes: dict | None = None
    # an rl phase: what the other phase keeps on each device through this one, outside this program (the
    # optimizer state through the rollout, the engine's pool through the update; module docstring)
    resident_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """What one device holds at the peak: arguments + outputs - donated (aliased) + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def resident_total_bytes(self) -> int:
        """:attr:`total_bytes` and the arrays resident beside the program (an rl phase; else the same)."""
        return self.total_bytes + self.resident_bytes

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
        return self.job.batch * per_row[self.job.program]


@dataclasses.dataclass(frozen=True)
class RLResult:
    """The two phases of an ``rl`` job (module docstring) and what each device keeps resident (bytes)."""

    rollout: Result
    train: Result
    state_bytes: int  # the train state: weights (adapters and frozen base included), optimizer state, counters
    weight_bytes: int  # of which the model's arrays: what the rollout reads
    cache_bytes: int  # the rollout engine's pool: the cache of every row, their last logits and sampling keys
    # the rollout engine's layout (train.rl.rollout_layout): `serving` decodes from a copy of the weights made
    # before each rollout by one reshard, whose collective bytes per device are transfer_bytes
    rollout_layout: str = "training"
    transfer_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """What lives on each device through both phases: the train state and the rollout engine's pool."""
        return self.state_bytes + self.cache_bytes

    @property
    def optimizer_bytes(self) -> int:
        """The train state less the weights."""
        return self.state_bytes - self.weight_bytes

    @property
    def peak_bytes(self) -> int:
        """Per device at the larger of the two phases' peaks, the other phase's resident arrays included."""
        return max(self.rollout.resident_total_bytes, self.train.resident_total_bytes)

    @property
    def fits(self) -> bool:
        return self.rollout.fits and self.train.fits

    @property
    def phases(self) -> tuple[Result, Result]:
        return self.rollout, self.train


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


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard where they differ)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # a PRNG key: its key data
               for x in jax.tree.leaves(tree))


def rl_slots(cfg: ModelConfig, seq_len: int) -> int:
    """The rollout engine's cache slots for rows of ``seq_len`` tokens (``k3jax.rl.trainer``: the prompt and
    the completion of a row, one more than the training row's inputs, up to ``model.max_seq_len``)."""
    return min(seq_len + 1, cfg.max_seq_len)


def abstract_rl_batch(cfg: Config, mesh, batch: int, seq_len: int, rules: Rules = DEFAULT_RULES) -> dict:
    """An RL training batch (``k3jax.rl.step``'s fields) as sharded ShapeDtypeStructs, split as
    ``k3jax.sharding.shard_batch`` splits the trainer's: ``[batch, seq_len]`` rows, ``advantages [batch]`` and,
    when the step replays them (``k3jax.rl.step.replays``), the routes ``[batch, seq_len, M, k]``."""
    shapes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "targets": jnp.int32, "mask": jnp.float32,
              "weights": jnp.float32, "rollout_logp": jnp.float32, "old_logp": jnp.float32, "ref_logp": jnp.float32}
    fields = {k: ((batch, seq_len), dtype) for k, dtype in shapes.items()}
    fields["advantages"] = ((batch,), jnp.float32)
    if replays(cfg):
        fields["routes"] = ((batch, seq_len, len(moe_layers(cfg.model)), cfg.model.moe.top_k), jnp.int32)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=named_sharding(mesh, batch_array_axes(k, len(shape)),
                                                                          shape, rules))
            for k, (shape, dtype) in fields.items()}


def rl_arguments(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int) -> dict:
    """The abstract, sharded arguments of an rl job's two programs, built as ``k3jax.rl.trainer`` builds
    them: the train state (``train_graphdef``, ``state``) with the rule-derived shardings, the model's part of
    it (``model_graphdef``, ``weights``: the arrays the engine decodes with, no copy, in the same shardings),
    and the engine's pool of ``batch`` rows (``pool``: the cache, ``logits``, ``keys``, replicated as the
    engine keeps them)."""
    train_graphdef, state = abstract_train_state(cfg, model)
    state = abstract_with_shardings(state, state_shardings(state, mesh, rules))
    model_graphdef, weights = nnx.split(nnx.merge(train_graphdef, state).model)
    rep = NamedSharding(mesh, PartitionSpec())
    slots = rl_slots(model.cfg, seq_len)
    cache = jax.eval_shape(lambda: init_cache(model.cfg, model.plan, batch, slots))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    pool = {"cache": abstract_with_shardings(cache, cache_shardings(cache, mesh, rules)),
            "logits": jax.ShapeDtypeStruct((batch, model.cfg.vocab_size), jnp.float32, sharding=rep),
            "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=rep)}
    return dict(train_graphdef=train_graphdef, state=state, model_graphdef=model_graphdef, weights=weights, pool=pool)


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
                code_bytes=m.generated_code_size_in_bytes, host_temp_bytes=m.host_temp_size_in_bytes)


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
    """The abstract model a job compiles: a training or rl job of a LoRA config (``train.lora``) carries its
    adapters (the state then trains only them, over the frozen weights; an rl rollout decodes with them);
    inference jobs never do (adapters are merged into the weights before serving)."""
    return abstract_model(cfg.model, lora=cfg.train.lora if mode in ("train", "rl") else None)


def lower_train(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int):
    """The train step of ``cfg`` for ``model`` lowered on ``mesh`` from abstract, rule-sharded state and batch
    (``batch`` rows of ``seq_len`` tokens), the state donated: what :func:`compile_job` compiles."""
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


def lower_rl_rollout(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int):
    """An rl job's rollout program: the engine's decode step (``decode_program``, ``record_routes``: every
    row's experts and sampled log-probability) of all ``batch`` rows of the pool, jitted as the engine jits it
    (pool, logits and keys donated; outputs replicated but the pool's), on the train state's weight arrays."""
    a = rl_arguments(cfg, mesh, model, rules, batch, seq_len)
    pool, rep = a["pool"], NamedSharding(mesh, PartitionSpec())
    decode = functools.partial(decode_program(a["model_graphdef"], record_routes=True), batch)
    pool_sh = jax.tree.map(lambda x: x.sharding, pool["cache"])
    jitted = jax.jit(decode, out_shardings=(rep, rep, rep, rep, rep, pool_sh), donate_argnums=(1, 2, 3))
    per_row = [jax.ShapeDtypeStruct((batch,), dtype, sharding=rep)
               for dtype in (jnp.float32, jnp.float32, jnp.bool_, jnp.bool_)]  # temperature, top_p, active, wants
    with jax.set_mesh(mesh):
        return jitted.lower(a["weights"], pool["cache"], pool["logits"], pool["keys"], *per_row)


def lower_rl_train(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int):
    """An rl job's update: ``k3jax.rl.step.make_rl_step`` (state donated, its shardings kept) on an RL batch of
    ``batch`` rows of ``seq_len`` tokens (:func:`abstract_rl_batch`)."""
    a = rl_arguments(cfg, mesh, model, rules, batch, seq_len)
    step = make_rl_step(a["train_graphdef"], cfg, state_shardings=jax.tree.map(lambda x: x.sharding, a["state"]))
    with jax.set_mesh(mesh):
        return step.lower(a["state"], abstract_rl_batch(cfg, mesh, batch, seq_len, rules))


def lower_decode(cfg: Config, mesh, model: K3Model, rules: Rules, batch: int, seq_len: int, new_tokens: int = 1):
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
    accum = cfg.train.grad_accum if job.program == "train" else 1
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
    keep them out of the persistent compilation cache (``k3jax.runtime.compile_cache``) by a minimum
    compile time no compile reaches. Turning the cache off here does not work: JAX decides once per
    process, at its first compile, whether the cache is used, so it either went on writing these
    executables (then failed to read them back and compiled again) or, decided here, stayed off for
    every later compile of the process (a test worker's CPU programs)."""
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)


def job_layout(job: Job) -> Layout:
    """The tables a job's program is placed and traced under (``k3jax.sharding``): training's for train jobs and
    rl updates, else the decode tables (an rl rollout's too: ``train.rl.rollout_layout``) or prefill tables of
    ``job.layout``."""
    if job.mode == "train" or (job.mode == "rl" and job.phase != "rollout"):
        return TRAINING
    decode, prefill = LAYOUTS[job.layout]
    return prefill if job.mode == "prefill" else decode


def lower_weight_transfer(mesh, weights, target):
    """The move of the weights into the rollout's layout before each rollout (``Engine.set_weights``): one
    jitted reshard of ``weights`` (sharded ShapeDtypeStructs) to ``target``'s shardings."""
    jitted = jax.jit(lambda w: w, out_shardings=jax.tree.map(lambda x: x.sharding, target))
    with jax.set_mesh(mesh):
        return jitted.lower(weights)


def compile_job(job: Job, *, flops: bool = True, breakdown: bool = False, devices=None,
                hbm_limit_bytes: int | None = None, log=print) -> Result:
    """:func:`compile_one` under the job's layout (:func:`job_layout`)."""
    with job_layout(job).active():
        return compile_one(job, job_layout(job).rules, flops=flops, breakdown=breakdown, devices=devices,
                           hbm_limit_bytes=hbm_limit_bytes, log=log)


def compile_one(job: Job, rules: Rules, *, flops: bool, breakdown: bool, devices, hbm_limit_bytes: int | None,
                log) -> Result:
    """Lower and compile ``job`` for its slice, with the compiler held to ``hbm_limit_bytes`` per
    device (default: the device's HBM; module docstring); with ``flops``, one more compile without the
    layer stack gives the step's FLOPs with the loop trip counts applied. With ``breakdown`` the
    optimized HLO is attributed to the model's parts instead (``k3jax.aot.breakdown``: matmul FLOPs with
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
    lower = {"train": lower_train, "decode": lower_decode,
             "prefill": functools.partial(lower_decode, new_tokens=job.prefill_chunk or job.seq_len),
             "rl": {"rollout": lower_rl_rollout, "train": lower_rl_train}.get(job.phase)}[job.mode]
    if lower is None:
        raise ValueError("an rl job compiles one phase at a time (phase 'rollout' or 'train'): use compile_rl")
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
    model_flops = analytic.model_flops(cfg, result.tokens, job.program)
    ns_flops = newton_schulz_flops(cfg) if job.program == "train" else 0.0
    step_flops = 0.0
    if parts is not None:
        step_flops = parts.total_flops * mesh.size
        expected = analytic.step_flops(cfg, result.tokens, job.seq_len, job.program)  # Newton-Schulz included
        result = dataclasses.replace(result, breakdown=parts, analytic=expected, breakdown_no_overflow=no_overflow)
        if job.program in ("decode", "prefill"):
            result = dataclasses.replace(result, read_bytes=analytic.step_read_bytes(
                cfg, job.batch, job.seq_len, result.tokens // job.batch))
    elif flops:
        step_flops = _step_flops(cfg, job, mesh, rules, lower, per_device, ns_flops, log)
    return dataclasses.replace(result, step_flops=step_flops, model_flops=model_flops, ns_flops=ns_flops)


def compile_rl(job: Job, *, flops: bool = True, breakdown: bool = False,
               devices=None, hbm_limit_bytes: int | None = None, log=print) -> RLResult:
    """Compile both phases of the ``rl`` job ``job`` (module docstring) with :func:`compile_job`, each held
    to the HBM budget (``hbm_limit_bytes``, else the job's or the device's) less what the other phase keeps
    resident on the device. With ``flops`` the FLOPs (and the collectives) come from the breakdown of each
    phase's optimized HLO, as with ``breakdown``: the cost-analysis count's second program, the step without
    its layer stack, cannot record the routes of the MoE layers it drops."""
    if job.mode != "rl":
        raise ValueError(f"compile_rl compiles rl jobs, got mode {job.mode!r}")
    cfg = job.load()
    tpu = TpuSlice.v5p(job.slice)
    devices = tpu.devices() if devices is None else devices
    mesh = make_mesh(job.mesh, devices)
    rollout_layout = job_layout(dataclasses.replace(job, phase="rollout"))
    a = rl_arguments(cfg, mesh, job_model(cfg, job.mode), TRAINING.rules, job.batch, job.seq_len)
    with rollout_layout.active():
        r = rl_arguments(cfg, mesh, job_model(cfg, job.mode), rollout_layout.rules, job.batch, job.seq_len)
    state, weights, cache = device_bytes(a["state"]), device_bytes(a["weights"]), device_bytes(r["pool"])
    copied = job.layout != "training"  # the rollout decodes from a copy in its layout, beside the train state
    transfer = 0
    if copied:
        with _no_persistent_cache():
            compiled = lower_weight_transfer(mesh, a["weights"], r["weights"]).compile()
        transfer = sum(hlo_breakdown.breakdown(compiled.as_text()).collective_bytes.values())
        del compiled
    del a, r
    if hbm_limit_bytes is None:
        hbm_limit_bytes = tpu.hbm_bytes if job.hbm_gib is None else int(job.hbm_gib * GIB)
    out = {}
    for phase, resident in (("rollout", state if copied else state - weights), ("train", cache)):
        log(f"  {phase}: {resident / GIB:.2f} GiB resident beside it")
        r = compile_job(dataclasses.replace(job, phase=phase), flops=flops,
                        breakdown=breakdown or flops, devices=devices,
                        hbm_limit_bytes=max(hbm_limit_bytes - resident, 2**20), log=log)
        out[phase] = dataclasses.replace(r, resident_bytes=resident)
    return RLResult(out["rollout"], out["train"], state_bytes=state, weight_bytes=weights, cache_bytes=cache,
                    rollout_layout=job.layout, transfer_bytes=transfer)


__all__ = ["RLResult", "Result", "abstract_batch", "abstract_rl_batch", "compile_job", "compile_rl", "device_bytes",
           "job_layout", "job_model", "lower_decode", "lower_weight_transfer", "lower_rl_rollout", "lower_rl_train", "lower_train", "rl_arguments",
           "rl_slots", "without_groups"]

"""The AOT scale proof at test size: compile the real train and decode steps of the ``small`` config
for a v5p slice with libtpu (no TPU needed) and check what ``python -m k3jax.aot`` reports for full K3.

The train step is compiled with ``model.layout=mla`` (MLA, LatentMoE with expert parallelism, Block
AttnRes, per-head Muon; no KDA): XLA's TPU compiler needs about 30 s on two cores per KDA layer
instance of the pure-JAX chunked form (its float32 HIGHEST-precision matmuls), which would make this
test take 7 minutes; the decode step keeps the hybrid layout (recurrent KDA compiles quickly) and
``docs/scale.md`` has the full hybrid train step.

Needs ``jax[tpu]==0.10.2`` (libtpu); skipped otherwise. Run with ``pytest -m tpu_aot tests/test_aot.py``
(about 2 minutes on two cores).
"""

import dataclasses
import math
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load libtpu at once
pytest.importorskip("libtpu")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from k3jax import aot  # noqa: E402
from k3jax.aot import compiling  # noqa: E402
from k3jax.config import MeshConfig  # noqa: E402
from k3jax.model import abstract_model  # noqa: E402
from k3jax.params import count_params  # noqa: E402
from k3jax.sharding import MESH_AXES, make_mesh  # noqa: E402
from k3jax.training.step import abstract_train_state  # noqa: E402

pytestmark = pytest.mark.tpu_aot

SLICE = "v5p-8"  # 2x2x1 chips: 4 devices
MESH = MeshConfig(data=1, fsdp=2, expert=2)
TRAIN = aot.Job("small", "train", SLICE, MESH, batch=8, seq_len=256, overrides=("model.layout=mla",))
DECODE = aot.Job("small", "decode", SLICE, MESH, batch=1, seq_len=4096)


def _devices():
    try:
        return aot.TpuSlice.v5p(SLICE).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")


@pytest.fixture(scope="module")
def train_result():
    return aot.compile_job(TRAIN, devices=_devices())


@pytest.fixture(scope="module")
def decode_result():
    return aot.compile_job(DECODE, breakdown=True, devices=_devices())


def _state_bytes(job: aot.Job) -> int:
    cfg = job.load()
    _, state = abstract_train_state(cfg)
    leaves = jax.tree.leaves(state)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)


def test_train_step_fits_and_state_is_sharded(train_result):
    r = train_result
    assert not r.error and r.fits, r.error
    assert r.num_devices == 4 and r.mesh_shape == {"fsdp": 2, "expert": 2}
    # The donated train state comes back in place: the outputs alias the arguments.
    assert r.alias_bytes > 0.9 * r.output_bytes
    # Parameters and optimizer state are sharded, not replicated: each device holds about 1/4 of them
    # (small vectors and the batch are replicated or split unevenly, hence the slack).
    per_device = _state_bytes(TRAIN) / r.num_devices
    assert 0.8 * per_device < r.argument_bytes < 1.6 * per_device, (r.argument_bytes, per_device)


def test_train_step_flops(train_result):
    r = train_result
    n_active = count_params(TRAIN.load().model)["active"]
    assert r.model_flops == 6 * n_active * TRAIN.batch * TRAIN.seq_len
    # The compiled step does at least the model's FLOPs. At this toy size what it adds is large but
    # bounded: Newton-Schulz (counted analytically, ~0.9 of the model FLOPs for 2048 tokens), attention,
    # and XLA's ragged_dot weight gradient, which is a masked dense product over the 16 local experts.
    assert 0 < r.ns_flops < r.step_flops
    assert 1.0 < r.flops_ratio < 16.0, r.flops_ratio
    # The loop-count correction matters: XLA counts the scanned groups once.
    assert r.step_flops > r.compiled_flops * r.num_devices


def test_grad_accum_step_flops_count_every_micro_batch(train_result):
    """XLA counts the micro-batch loop once; the reported step FLOPs count it ``grad_accum`` times
    (and the optimizer once): two micro-batches of TRAIN's size = twice TRAIN's step less one NS."""
    job = dataclasses.replace(TRAIN, batch=2 * TRAIN.batch,
                              overrides=TRAIN.overrides + ("train.grad_accum=2", f"train.batch_size={2 * TRAIN.batch}"))
    r = aot.compile_job(job, devices=_devices())
    assert not r.error and r.fits, r.error
    assert r.model_flops == 2 * train_result.model_flops
    assert r.step_flops == pytest.approx(2 * train_result.step_flops - train_result.ns_flops, rel=1e-9)
    assert r.step_flops > 1.9 * r.compiled_flops * r.num_devices  # the accumulating program counts one


def test_decode_step_fits_with_sharded_cache(decode_result):
    r = decode_result
    assert not r.error and r.fits, r.error
    assert r.alias_bytes > 0  # the cache is donated and updated in place
    cfg = DECODE.load()
    cache = jax.eval_shape(lambda: abstract_model(cfg.model).init_cache(DECODE.batch, DECODE.seq_len))
    cache_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    params = nnx.state(abstract_model(cfg.model))
    param_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
    # One sequence: its cache slots are split over the devices rather than replicated.
    assert r.argument_bytes < (param_bytes + cache_bytes) / r.num_devices * 1.6
    # FLOPs (the breakdown: trip counts of the key-block loop applied, the Pallas grouped matmul by
    # its cost estimate): the batch of 1 is not split, its cache slots are, so each device does the
    # absorbed MLA attention over its own share of the 4096 slots (split keys,
    # k3jax/parallel/cache_attention.py; before, every device attended over all of them); and nothing is
    # blown up (no dense-over-local-experts products). TPU writes the other one-row products as
    # vector multiply-reduce, not matmuls, so the breakdown counts attention and the experts only.
    mla = cfg.model.mla
    mla_layers = sum(cfg.model.mixer(i) == "mla" for i in range(cfg.model.num_layers))
    attn = 2 * mla_layers * mla.num_heads * DECODE.seq_len * (2 * mla.kv_lora_rank + mla.qk_rope_head_dim)
    per_device = r.step_flops / r.num_devices
    mla_per_device = r.breakdown.part_flops("mla")
    assert 0.99 * attn / r.num_devices <= mla_per_device < 1.5 * attn / r.num_devices, (mla_per_device, attn)
    assert per_device < 4 * (r.model_flops + attn), (per_device, r.model_flops, attn)


def test_table_and_rules():
    rows = aot.table([aot.Result(TRAIN, {"fsdp": 2, "expert": 2}, 4, aot.V5P_HBM_BYTES, argument_bytes=1 << 30,
                                 temp_bytes=1 << 30, step_flops=2e12, model_flops=1e12)])
    assert "| small | train 8 x 256 | v5p-8 (4) | fsdp 2 x expert 2 | 8 |" in rows and "| 2.00 |" in rows
    assert aot.TpuSlice.v5p("v5p-1024").num_devices == 512
    with pytest.raises(ValueError, match="unknown slice"):
        aot.TpuSlice.v5p("v5p-3")


def test_vision_train_step_compiles_with_the_tower():
    """The multimodal train step (MoonViT tower + projector + splice, image arrays in the batch) compiles
    for the slice, and the tower's weights and optimizer state are part of the sharded state."""
    job = aot.Job("tiny_vl", "train", SLICE, MESH, batch=8, seq_len=96, overrides=("model.layout=mla",))
    text_only = dataclasses.replace(job, overrides=job.overrides + ("model.vision.enabled=false",))
    r = aot.compile_job(job, devices=_devices(), flops=False)
    assert not r.error and r.fits, r.error
    batch = aot.abstract_batch(make_mesh(MESH, _devices()), 8, 96, vision=job.load().model.vision)
    assert batch["image_patches"].shape == (8, 64, 3, 8, 8)
    assert _state_bytes(job) > _state_bytes(text_only)
    assert r.argument_bytes > 0.8 * _state_bytes(job) / r.num_devices


def test_plan_jobs_are_consistent():
    """Every job of the scale proof loads, uses its whole slice, and splits its batch evenly."""
    for job in aot.PLAN:
        cfg = job.load()
        sizes = [getattr(job.mesh, a) for a in MESH_AXES]
        assert math.prod(sizes) == aot.TpuSlice.v5p(job.slice).num_devices, job
        if job.mode == "train":
            data = job.mesh.data * job.mesh.fsdp * job.mesh.expert
            assert cfg.train.batch_size == job.batch and job.batch % (cfg.train.grad_accum * data) == 0, job
            assert job.seq_len % (job.mesh.sequence * cfg.model.kda.chunk_size) == 0, job


def test_the_compiler_is_held_to_the_hbm_budget(decode_result):
    """Every compile is held to the device's HBM (``xla_tpu_max_hbm_size_mib``), and a program that does
    not fit a smaller budget is refused: reported as not fitting, with the compiler's words."""
    assert decode_result.hbm_limit_bytes == aot.V5P_HBM_BYTES
    r = aot.compile_job(DECODE, devices=_devices(), flops=False, hbm_limit_bytes=decode_result.argument_bytes // 2)
    assert not r.fits and "exceeds available HBM" in r.error, r.error
    assert "| no |" in aot.table([r])


def test_an_override_after_breakdown_is_refused(capsys):
    """``--breakdown`` takes an optional JSON path: an override right after it would silently become that
    path (and be dropped from the config), so it is refused before anything compiles."""
    with pytest.raises(SystemExit) as e:
        aot.main(["--config", "tiny", "--breakdown", "train.batch_size=8"])
    assert e.value.code == 2 and "looks like a config override" in capsys.readouterr().err


def test_hbm_budget_flag_reaches_every_plan_job_and_must_be_positive(monkeypatch, capsys):
    """``--hbm-gib`` without ``--config`` holds every job of the PLAN to it (it used to reach only a
    ``--config`` job, silently); a budget <= 0 is refused."""
    with pytest.raises(SystemExit) as e:
        aot.main(["--hbm-gib", "0"])
    assert e.value.code == 2 and "--hbm-gib must be positive" in capsys.readouterr().err

    budgets = []

    class Stop(Exception):
        pass

    def record(job, **kwargs):  # stands in for the compile: note the job's budget, compile nothing
        budgets.append(job.hbm_gib)
        raise Stop

    monkeypatch.setattr(compiling, "compile_job", record)  # what the CLI calls
    for argv, want in ((["--hbm-gib", "42"], 42.0), ([], aot.PLAN[0].hbm_gib)):
        with pytest.raises(Stop):
            aot.main(argv)
        assert budgets[-1] == want


@pytest.mark.slow
def test_dropless_step_reports_its_overflow_rounds_and_bf16_weights_halve_the_state(train_result):
    """bf16 master weights (``model.param_dtype=bfloat16``) with bf16 Muon momentum hold TRAIN's state in
    about half the bytes. The same compile (TRAIN's step with those weights; compiling TRAIN itself again
    for its breakdown took as long as the rest of this test) shows the dropless exchange's overflow rounds:
    while loops of data-dependent trip count that the breakdown counts once, and the report gives the step
    with them not run (every device's pairs within one round), with fewer FLOPs and ragged all-to-all bytes."""
    bf16 = dataclasses.replace(TRAIN, overrides=TRAIN.overrides + ("model.param_dtype=bfloat16",
                                                                   "train.optim.muon_dtype=bfloat16"))
    r = aot.compile_job(bf16, breakdown=True, devices=_devices())
    assert not r.error and r.fits, r.error
    assert r.argument_bytes < 0.6 * train_result.argument_bytes, (r.argument_bytes, train_result.argument_bytes)
    _, data = aot.breakdown_report(r)
    s = data["summary"]
    assert s["data_dependent_loops"] > 0
    without = s["without_data_dependent_loops"]
    assert without["flops_per_device"] < s["flops_per_device"]
    ragged = "ragged-all-to-all"
    assert 0 < without["collective_bytes"][ragged] < s["collective_bytes"][ragged]

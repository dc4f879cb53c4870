"""``python -m k3jax.aot --mode rl`` at test size: both programs of reinforcement learning, compiled for a v5p
slice with libtpu (no TPU needed) on one mesh and one set of weights: the rollout (the serving engine's decode
step of every row, recording routes and sampled log-probabilities) and the RL update (``make_rl_step`` with
the routes replayed), for the LoRA setting of the full-K3 row (frozen MXFP4 experts and bf16 base, adapters
trained), and what the report gives per phase and for both resident at once.

``tiny`` with two layers (a KDA layer with the dense FFN, the final MLA layer with the MoE), rows of 64 tokens;
the compiles take about 50 s on two busy cores. Needs ``jax[tpu]==0.10.2`` (libtpu); skipped otherwise. TPU
executables stay out of the persistent compilation cache (``compiling.compile_job``).
"""

import dataclasses
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load libtpu at once
pytest.importorskip("libtpu")

import jax  # noqa: E402

from k3jax import aot  # noqa: E402
from k3jax.aot import compiling  # noqa: E402
from k3jax.config import MeshConfig  # noqa: E402
from k3jax.model import moe_layers  # noqa: E402
from k3jax.sharding import make_mesh  # noqa: E402

pytestmark = pytest.mark.tpu_aot

SLICE = "v5p-8"  # 2x2x1 chips: 4 devices
MESH = MeshConfig(data=1, fsdp=2, expert=2)
SEQ = 64
OVERRIDES = ("model.num_layers=2", "train.rl.group_size=4", "train.rl.prompts_per_step=2",
             "train.rl.max_new_tokens=32", "train.lora.rank=4", "quant.experts=mxfp4", "model.param_dtype=bfloat16",
             "train.rl.rollout_layout=serving")


def _devices():
    try:
        return aot.TpuSlice.v5p(SLICE).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")


@pytest.fixture(scope="module")
def job():
    return aot.rl_job("tiny", SLICE, MESH, SEQ, OVERRIDES)


@pytest.fixture(scope="module")
def result(job):
    return aot.compile_rl(job, breakdown=True, devices=_devices())


def test_rl_job_takes_its_rows_from_the_config(job):
    """The rows are train.rl's prompts x group; the job's overrides make the config an RL one of that batch."""
    assert job.mode == "rl" and job.batch == 8 and job.seq_len == SEQ
    assert job.overrides[-3:] == ("train.batch_size=8", f"train.seq_len={SEQ}", f"train.rl.loss={aot.plan.RL_LOSS}")
    cfg = job.load()
    assert cfg.train.rl.enabled and cfg.train.lora.enabled and cfg.model.quant.experts == "mxfp4"
    # the rollout's layout is the run's
    assert job.layout == cfg.train.rl.rollout_layout == "serving"
    assert aot.rl_job("tiny", SLICE, MESH, SEQ, OVERRIDES[:-1]).layout == "training"  # the default


def test_both_phases_compile_and_report(result, job):
    r = result
    assert r.fits, (r.rollout.error, r.train.error)
    assert [p.job.phase for p in r.phases] == ["rollout", "train"]
    assert r.rollout.tokens == job.batch and r.train.tokens == job.batch * job.seq_len
    for p in r.phases:
        assert not p.error and p.num_devices == 4
        assert p.argument_bytes > 0 and p.temp_bytes > 0 and p.total_bytes > 0, p.job.phase
        assert p.step_flops > 0 and p.model_flops > 0, p.job.phase
        assert sum(p.breakdown.collective_bytes.values()) > 0, p.job.phase  # sharded weights and experts
        # each phase is held to the HBM less what the other keeps resident through it
        assert p.resident_bytes > 0 and p.hbm_limit_bytes == p.hbm_bytes - p.resident_bytes
        assert p.resident_total_bytes == p.total_bytes + p.resident_bytes
    # the rollout decodes from a serving copy of the weights: the whole train state stays resident beside it
    assert r.rollout_layout == "serving" and r.rollout.resident_bytes == r.state_bytes
    assert r.train.resident_bytes == r.cache_bytes and r.transfer_bytes > 0
    assert 0 < r.weight_bytes < r.state_bytes and r.cache_bytes > 0
    # LoRA: the optimizer state is the adapters' AdamW moments, a small part of the frozen base
    assert r.optimizer_bytes < r.weight_bytes
    # both resident at once: at least either program's own arguments
    assert r.peak_bytes >= max(r.rollout.argument_bytes, r.train.argument_bytes)
    assert r.peak_bytes == max(r.rollout.resident_total_bytes, r.train.resident_total_bytes)
    # the update's cost is a training step's (4 N_active tokens for the frozen base + adapters), the
    # rollout's a decode step's
    assert r.train.flops_ratio > 1.0 and r.rollout.flops_ratio > 0.9

    text, data = aot.rl_report(r)
    assert "| rollout | rl rollout 8 x 1 @ 65 slots |" in text and "| train | rl train 8 x 64 |" in text
    for phase in ("rollout", "train"):
        for key in ("argument_bytes", "temp_bytes", "total_bytes", "resident_bytes", "resident_total_bytes",
                    "step_flops", "model_flops"):
            assert data[phase][key] > 0, (phase, key)
        assert sum(data[phase]["collective_bytes"].values()) > 0
    assert data["memory"]["peak_bytes"] == r.peak_bytes and data["memory"]["cache_bytes"] > 0
    assert data["memory"]["resident_bytes"] == r.state_bytes + r.cache_bytes
    print(text)  # the figures (pytest -s)
    rows = aot.table(list(r.phases))
    assert "rl rollout 8 x 1 @ 65 slots (+ " in rows and "GiB train state resident)" in rows
    assert "rollout in the serving layout: the weights are copied into it before each rollout by one reshard" in text
    assert "rl train 8 x 64 (+ " in rows and "GiB rollout cache resident)" in rows


def test_rollout_records_routes_and_reads_the_train_state_weights(job):
    """The rollout is the engine's decode step with routes recorded: its outputs hold every row's sampled
    log-probability and its experts in every MoE layer; it reads the train state's model arrays (adapters
    included) in their training shardings. Lowering only."""
    cfg = job.load()
    mesh = make_mesh(MESH, _devices())
    model = compiling.job_model(cfg, job.mode)
    lowered = compiling.lower_rl_rollout(cfg, mesh, model, aot.compiling.DEFAULT_RULES, job.batch, job.seq_len)
    tokens, _, (sampled, routes), logits, _, _ = lowered.out_info
    assert tokens.shape == sampled.shape == (job.batch,)
    assert routes.shape == (job.batch, len(moe_layers(cfg.model)), cfg.model.moe.top_k)
    assert logits.shape == (job.batch, cfg.model.vocab_size)
    a = compiling.rl_arguments(cfg, mesh, model, aot.compiling.DEFAULT_RULES, job.batch, job.seq_len)
    model_part = jax.tree.leaves(a["state"]["model"])
    assert [(x.shape, x.sharding) for x in jax.tree.leaves(a["weights"])] == [(x.shape, x.sharding) for x in model_part]
    assert any("lora" in str(path).lower() for path, _ in jax.tree_util.tree_leaves_with_path(a["weights"]))


def test_rl_batch_must_be_the_rollout_rows(capsys):
    """--batch may only repeat the rows train.rl gives; anything else is refused before compiling."""
    with pytest.raises(SystemExit) as e:
        aot.main(["--config", "tiny", "--mode", "rl", "--slice", SLICE, "--batch", "3", *OVERRIDES])
    assert e.value.code == 2 and "train.rl.prompts_per_step x train.rl.group_size = 8" in capsys.readouterr().err


def test_a_serving_rollout_moves_less_than_one_on_the_trainers_arrays(result, job):
    """The rollout's decode step in the serving layout moves less per step than the same step on the train
    state's FSDP-split arrays, which gathers weights every step; the serving copy is made once per rollout."""
    training = compiling.compile_job(dataclasses.replace(job, layout="training", phase="rollout"), breakdown=True,
                                     devices=_devices(), log=lambda s: None)
    serving, on_trainers = (sum(p.breakdown.collective_bytes.values()) for p in (result.rollout, training))
    print(f"rollout collectives per device and step: serving {serving} B, training {on_trainers} B; "
          f"the serving copy {result.transfer_bytes} B once per rollout")
    assert serving < on_trainers

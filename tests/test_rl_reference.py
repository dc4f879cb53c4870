"""The KL reference of a full fine-tune's RL run (``train.rl.beta > 0``, k3jax/rl/reference.py), on the two-layer
tiny K3 of tests/test_rl_loop.py started from another run's checkpoint (``train.init_from``): the scoring
forward's ``ref_logp`` is that checkpoint's forward, before and after updates move the policy; a run stopped
after step 1 and resumed logs the uninterrupted run's losses and KL bit for bit (its reference is the step-0
weights again, not the resumed ones); a resumed run whose recorded reference is gone or holds another model
stops with an error naming it."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import moe_layers
from k3jax.rl.reference import reference_weights
from k3jax.rl.step import make_rl_step, make_score_fn, policy_logprobs
from k3jax.rl.trainer import train_rl
from k3jax.sharding import make_mesh, shard_batch, use_mesh
from k3jax.training import checkpoint
from k3jax.training.run_log import read_metrics
from k3jax.training.step import init_train_state
from k3jax.training.trainer import init_weights_from, ready_state
from test_rl_loop import RL_SMALL, WORDS

pytestmark = pytest.mark.usefixtures("fast_xla")
BETA = 0.5


def rl_config(run_dir, init_from, steps=2, *extra):
    """The RL run of tests/test_rl_loop.py with the KL term, ``steps`` long, in ``run_dir`` (a directory of the
    module's root, which holds the prompts)."""
    start = [f"train.init_from={init_from}"] if init_from is not None else []
    return load_config("tiny", [*RL_SMALL, f"train.rl.beta={BETA}", *start, f"train.steps={steps}",
                                f"train.rl.prompts={run_dir.parent / 'prompts.jsonl'}",
                                "train.rl.rewards=[rl_rewards:lowercase_fraction]", f"train.out_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """The checkpoint the runs start from: the tiny model initialised from another seed than the runs' own
    (so the reference differs from a seed initialisation), and the prompts file."""
    root = tmp_path_factory.mktemp("reference")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    cfg = rl_config(root / "unused", None, 2, "train.seed=7")
    checkpoint.save_model(root / "start", init_train_state(cfg).model, cfg)
    return root / "start"


def synthetic_batch(cfg, seed=0):
    """A rollout-shaped batch of random byte rows (``k3jax.rl.step``'s fields): the second half of each row
    trains, advantages with group variance, each token's experts k distinct ones."""
    rl, m = cfg.train.rl, cfg.model
    b, t, k, layers = rl.rows, cfg.train.seq_len, m.moe.top_k, len(moe_layers(m))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (b, t + 1)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 2:] = 1
    first = rng.integers(0, m.moe.num_experts, (b, t, layers, 1))
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
            "mask": mask, "weights": mask / mask.sum(), "advantages": rng.standard_normal(b).astype(np.float32),
            "routes": ((first + np.arange(k)) % m.moe.num_experts).astype(np.int32),
            "rollout_logp": np.zeros((b, t), np.float32), "old_logp": np.zeros((b, t), np.float32),
            "ref_logp": np.zeros((b, t), np.float32)}


def test_ref_logp_is_the_starting_weights_forward_and_stays(start):
    """``ref_logp`` equals the forward (experts replayed) of the checkpoint the run started from, before and
    after two updates moved the policy; the second update's KL is positive."""
    cfg = rl_config(start.parent / "unit", start)
    mesh = make_mesh(cfg.mesh)
    with use_mesh(mesh):
        ts = init_train_state(cfg, mesh)
        base = init_weights_from(ts.model, str(start), mesh)
        graphdef, state = nnx.split(ts)
        state = ready_state(state, mesh)
        reference = reference_weights(cfg, base, nnx.state(nnx.merge(graphdef, state).model), mesh)
        with pytest.raises(ValueError, match="reference weights"):
            make_score_fn(graphdef, cfg)
        score, step = make_score_fn(graphdef, cfg, reference=reference), make_rl_step(graphdef, cfg)
        batch = synthetic_batch(cfg)
        saved, _ = checkpoint.restore_model(start)
        logits, _, _ = saved.forward(batch["tokens"], segment_ids=batch["segment_ids"], replay_routes=batch["routes"])
        expected = np.asarray(policy_logprobs(logits, batch["targets"], cfg.train.rl.temperature)[0])
        scored = {k: np.asarray(v) for k, v in score(state, shard_batch(batch, mesh)).items()}
        np.testing.assert_allclose(scored["ref_logp"], expected, atol=2e-5, rtol=0)
        np.testing.assert_allclose(scored["logp"], expected, atol=2e-5, rtol=0)  # the policy starts there
        kl = []
        for _ in range(2):
            batch["ref_logp"] = scored["ref_logp"]
            state, metrics = step(state, shard_batch(batch, mesh))
            kl.append(float(metrics["kl"]) / float(metrics["tokens"]))
            moved = {k: np.asarray(v) for k, v in score(state, shard_batch(batch, mesh)).items()}
            np.testing.assert_array_equal(moved["ref_logp"], scored["ref_logp"])  # frozen: the same bits
            assert np.max(np.abs(moved["logp"] - scored["logp"])) > 1e-3  # the policy moved
    print(f"KL per token at the two updates: {kl}")
    assert kl[0] < 1e-9 < 1e-5 < kl[1]


def metrics_of(run_dir):
    return [r for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def runs(start):
    """A 2-step run from ``start`` and one stopped after step 1 and resumed (each ``train_rl``)."""
    straight, resumed = start.parent / "straight", start.parent / "resumed"
    train_rl(rl_config(straight, start, 2))
    train_rl(rl_config(resumed, start, 1))
    train_rl(rl_config(resumed, start, 2))
    return metrics_of(straight), resumed


def test_resume_keeps_the_step0_reference(runs):
    straight, resumed_dir = runs
    resumed = metrics_of(resumed_dir)
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == [1, 2]
    for a, b in zip(resumed, straight):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "entropy"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert straight[1]["kl"] > 1e-6  # step 2 scores a moved policy against the step-0 weights


def test_a_resumed_reference_that_is_gone_or_differs_stops_the_run(start, runs):
    """Resuming (step 3 of a run saved at step 2) with its recorded reference, ``start``, gone, or replaced by
    a model of another architecture: a CheckpointError naming the reference and where it was; with another
    ``train.init_from``: the config check refuses it."""
    run = start.parent / "copy"
    shutil.copytree(runs[1], run)
    with checkpoint.manager(run / "checkpoints", item_names=checkpoint.LORA_TRAIN_ITEMS) as mngr:
        assert checkpoint.restore_base(mngr, 2) == {"kind": "orbax", "path": str(start.absolute()), "step": 0}
    with pytest.raises(checkpoint.CheckpointError, match=r"init_from"):
        train_rl(rl_config(run, start.parent / "elsewhere", 3))
    moved = start.with_name("start_moved")
    start.rename(moved)
    try:
        with pytest.raises(checkpoint.CheckpointError, match=rf"KL reference .*{start}"):
            train_rl(rl_config(run, start, 3))
        other = rl_config(run, None, 2, "model.num_layers=3")
        checkpoint.save_model(start, init_train_state(other).model, other)
        with pytest.raises(checkpoint.CheckpointError, match=r"KL reference .*another architecture"):
            train_rl(rl_config(run, start, 3))
    finally:
        shutil.rmtree(start, ignore_errors=True)
        moved.rename(start)
    assert [r["step"] for r in metrics_of(run)] == [1, 2]  # nothing trained, nothing logged

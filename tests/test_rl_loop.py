"""The RL loop end to end through ``train.py`` (k3jax/rl/trainer.py), on a two-layer tiny K3 with a latent MoE
and byte prompts: a reward the model can reach (the share of lower-case letters in its replies) goes from
where a random model starts to nearly all of it in a bounded number of steps, and a run stopped by Ctrl-C
and resumed logs the uninterrupted run's rewards and losses bit for bit."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from cpu_devices import subprocess_env
from k3jax.training.run_log import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 24
RL_SMALL = ["model.num_layers=2", "model.attn_res.block_size=1", "train.seq_len=32", "train.batch_size=16",
            "train.log_every=1", "train.checkpoint_every=100", "train.optim.schedule=constant",
            "train.optim.warmup_steps=0", "train.optim.learning_rate=0.02", "train.data.tokenizer=byte",
            "train.rl.loss=grpo", "train.rl.eval_fraction=0", "train.rl.group_size=8", "train.rl.prompts_per_step=2",
            "train.rl.max_new_tokens=8"]
WORDS = ["In", "And", "The", "For", "But", "Then", "So", "He"]


def rl_cmd(run_dir, prompts, steps, reward):
    return [sys.executable, str(ROOT / "train.py"), "--config", "tiny", *RL_SMALL, f"train.steps={steps}",
            f"train.rl.prompts={prompts}", f"train.rl.rewards=[rl_rewards:{reward}]", f"run_dir={run_dir}"]


def run(cmd, **env):
    return subprocess.run(cmd, env=subprocess_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env),
                          capture_output=True, text=True, timeout=1200)


def rl_records(run_dir):
    return [r for r in read_metrics(run_dir) if "reward_mean" in r]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in WORDS))
    return path


@pytest.fixture(scope="module")
def straight(prompts, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    done = run(rl_cmd(run_dir, prompts, STEPS, "lowercase_fraction"))
    assert done.returncode == 0, done.stderr[-3000:]
    return rl_records(run_dir)


@pytest.mark.slow
def test_reward_rises_through_the_loop(straight):
    rewards = [r["reward_mean"] for r in straight]
    print("reward per step:", [round(r, 3) for r in rewards])
    assert len(rewards) == STEPS
    assert np.mean(rewards[:3]) < 0.25  # a random byte model: about 26 / 256 of its bytes
    assert np.mean(rewards[-3:]) > 0.8
    first = straight[0]
    for key in ("reward_std", "response_length", "truncation_rate", "clip_fraction", "entropy", "mismatch/kl_k1",
                "mismatch/kl_k3", "mismatch/max_abs_logp", "mismatch/prob_pearson", "mismatch_without_replay/routing",
                "rollout_tokens_per_s", "train_tokens_per_s", "time/rollout_s", "time/train_s",
                "time/weights_transfer_s", "reward/rl_rewards:lowercase_fraction"):
        assert np.isfinite(first[key]), key
    assert max(r["mismatch/max_abs_logp"] for r in straight) < 1e-4  # the rollout's and trainer's log-probs agree


@pytest.mark.slow
def test_ctrl_c_and_resume_log_the_same_run(prompts, straight, tmp_path):
    """SIGINT during step 3's rewards: the run finishes the step, saves, exits 130; the same command resumes
    and steps 1-6 log the uninterrupted run's rewards and losses bit for bit (same seeds, same prompts)."""
    cmd = rl_cmd(tmp_path, prompts, 6, "lowercase_fraction_then_sigint")
    stopped = run(cmd, RL_TEST_SIGINT_AT="3")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert [r["step"] for r in rl_records(tmp_path)] == [1, 2, 3]
    resumed = run(cmd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    again = rl_records(tmp_path)
    assert [r["step"] for r in again] == list(range(1, 7))
    for a, b in zip(again, straight[:6]):
        for key in ("reward_mean", "loss", "grad_norm", "entropy", "response_length"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_multi_turn_episodes_resume_from_the_cache(tmp_path, monkeypatch):
    """Multi-turn episodes through the loop (in process): every reply stops at once (each byte is a stop token), the
    environment answers the first with a tool turn; the second turn resumes from the prefix cache (the prompt's
    whole block is not prefilled again), the step trains on the replies alone and the run completes."""
    import k3jax.rl.trainer as rl_trainer
    from k3jax.config import load_config

    prompts = tmp_path / "chat.jsonl"
    question = "Which book is this verse from: In the beginning God created the heaven and the earth?"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{question} {i}"}]}) + "\n"
                               for i in range(2)))
    monkeypatch.setattr(rl_trainer, "reply_stop_ids", lambda tokenizer: tuple(range(256)))
    cfg = load_config("tiny", [*RL_SMALL, "train.seq_len=160", "train.steps=1", f"train.rl.prompts={prompts}",
                               "train.rl.rewards=[rl_rewards:lowercase_fraction]",
                               "train.rl.environment=rl_rewards:tool_round_trip", "train.rl.max_turns=3",
                               f"train.out_dir={tmp_path / 'run'}"])
    result = rl_trainer.train_rl(cfg)
    record = result["record"]
    assert record["step"] == 1 and np.isfinite(record["loss"])
    assert record["response_length"] == 2  # two one-token replies per episode; the tool turn does not count
    # the second turn of each of the 16 episodes resumed after the prompt's first 64-token block
    assert record["rollout/cached_tokens"] == 16 * 64

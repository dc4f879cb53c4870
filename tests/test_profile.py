"""``train.profile``: a tiny run traces the steps it is told to with ``jax.profiler`` into
``<run_dir>/profile/`` (TensorBoard's profile plugin layout), and the trace names the train step's
program; the config refuses a window that cannot be."""

from __future__ import annotations

import pytest

from k3jax.config import ConfigError, load_config

RUN = ["model.num_layers=1", "train.seq_len=16", "train.batch_size=2", "train.log_every=1",
       "train.data.eval_fraction=0"]


@pytest.mark.usefixtures("fast_xla_test")
def test_profile_traces_the_train_step(tmp_path, capsys):
    from k3jax.training.trainer import train

    cfg = load_config("tiny", RUN + ["train.steps=3", "train.profile.first_step=2", "train.profile.steps=1",
                                     f"train.out_dir={tmp_path}"])
    assert not train(cfg, sample_tokens=0)["interrupted"]
    (trace,) = (tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb")
    # the jitted train step (k3jax/training/step.py make_step's `step`) ran inside the trace
    assert b"jit_step" in trace.read_bytes()
    assert f"profile of steps 2-2 written to {tmp_path / 'profile'}" in capsys.readouterr().out


def test_profile_off_by_default_and_checked(tmp_path):
    assert not load_config("tiny").train.profile.enabled
    with pytest.raises(ConfigError, match="train.profile.steps: must be positive"):
        load_config("tiny", ["train.profile.first_step=1", "train.profile.steps=0"])
    with pytest.raises(ConfigError, match="train.profile.first_step: must be >= 0"):
        load_config("tiny", ["train.profile.first_step=-1"])

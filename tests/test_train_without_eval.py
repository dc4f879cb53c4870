"""A run without a held-out split (``train.data.eval_fraction=0``): it trains to the end and reports
no eval loss (it used to crash after the last step, reading the empty eval split), and an
``eval_every`` that needs the split is refused up front, by the config check and by ``train``."""

import math

import pytest

from k3jax.config import load_config
from k3jax.training.run_log import read_metrics

ONE_LAYER = ["model.num_layers=1", "train.seq_len=16", "train.batch_size=2", "train.steps=2", "train.log_every=1",
             "train.data.eval_fraction=0"]


@pytest.mark.usefixtures("fast_xla_test")
def test_a_run_without_a_held_out_split_trains_to_the_end(tmp_path, capsys):
    from k3jax.training.trainer import train

    result = train(load_config("tiny", ONE_LAYER + [f"train.out_dir={tmp_path}"]), sample_tokens=0)
    assert not result["interrupted"] and math.isfinite(result["loss"])
    assert math.isnan(result["eval_loss"])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and not any("eval_loss" in r for r in records)
    assert "no eval (train.data.eval_fraction=0)" in capsys.readouterr().out


def test_eval_every_needs_a_held_out_split(tmp_path):
    import dataclasses

    from k3jax.training.trainer import train

    with pytest.raises(ValueError, match="eval_every.*eval_fraction is 0"):
        load_config("tiny", ONE_LAYER + ["train.eval_every=1"])
    with pytest.raises(ValueError, match="eval_every"):
        load_config("tiny", ["train.eval_every=-1"])
    # a config changed in code skips load_config's check; train() validates it before anything runs
    cfg = load_config("tiny", ONE_LAYER + [f"train.out_dir={tmp_path}"])
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=1))
    with pytest.raises(ValueError, match="eval_every.*eval_fraction is 0"):
        train(cfg, sample_tokens=0)

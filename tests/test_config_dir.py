"""``python train.py --config DIR``: a Hugging Face model directory (a tiny random DeepSeek-V3 saved by
transformers' ``save_pretrained``) or a k3jax run directory gives the run's model section and its
starting weights without a config written for it (``k3jax/interop/model_dir.py``). That the run trains
from DIR's weights is checked on its first logged loss (the loss of the first batch before the first
update), recomputed by a forward of DIR's model loaded the way ``infer.py`` loads it. A directory that
is neither kind is refused, naming both."""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cpu_devices import TESTS  # noqa: E402
from test_hf_interop import byte_deepseek_config, kimi_linear_config, randomize_torch  # noqa: E402
from k3jax.config import ConfigError, load_config  # noqa: E402
from k3jax.interop import load_hf_config  # noqa: E402
from k3jax.training.run_log import read_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_xla")

# byte tokens on short rows, one step, no held-out split (no eval to compile)
RUN = ["--sample-tokens", "0", "train.steps=1", "train.seq_len=16", "train.batch_size=2", "train.log_every=1",
       "train.data.eval_fraction=0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 (the byte tokenizer's ids fit its vocabulary), every weight away from its init."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(byte_deepseek_config()).eval()
    randomize_torch(model, 3)
    path = tmp_path_factory.mktemp("moonlet")
    model.save_pretrained(path)
    return path


def _train(args) -> int:
    sys.path.insert(0, str(TESTS.parent))
    import train

    return train.main([*args])


def _first_batch_loss(model, cfg) -> float:
    """Mean next-token loss of ``model`` on the run's first training batch (what step 1 logs)."""
    from k3jax.data.images import make_dataset
    from k3jax.tokenizer import load_tokenizer
    from k3jax.training.step import next_token_loss

    @nnx.jit
    def loss(model, batch):
        logits, _, _ = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])
        total, count, _ = next_token_loss(logits, batch["targets"], batch["loss_mask"])
        return total / count

    batch = next(iter(make_dataset(cfg, load_tokenizer(cfg.train.data.tokenizer), split="train")))
    return float(loss(model, {k: jnp.asarray(v) for k, v in batch.items()}))


def test_fine_tune_a_hf_directory_then_its_run(hf_dir, tmp_path):
    from k3jax.serving.loading import load_model

    # the HF directory: its model section, its weights, a run directory of its own
    cfg = load_config(str(hf_dir), RUN[2:])
    assert cfg.model == load_hf_config(hf_dir)[0]
    assert (cfg.name, cfg.train.init_from, cfg.train.out_dir) == (hf_dir.name, str(hf_dir),
                                                                 f"runs/{hf_dir.name}-finetune")
    run = tmp_path / "run"
    assert _train(["--config", str(hf_dir), *RUN, f"run_dir={run}"]) == 0
    (logged,) = read_metrics(run)
    hf_model, _ = load_model(hf_dir, dtype="float32")
    expected = _first_batch_loss(hf_model, cfg)
    assert abs(expected - np.log(260)) > 0.1  # the HF weights are not a fresh init's near-uniform guess
    np.testing.assert_allclose(logged["loss"], expected, rtol=2e-5)

    # the k3jax run it wrote (its checkpoints/ directory): its model, its weights after that step
    cfg2 = load_config(str(run / "checkpoints"), ["train.steps=1"])
    assert cfg2.model == cfg.model and (cfg2.name, cfg2.train.out_dir) == ("run", "runs/run-finetune")
    assert cfg2.train.init_from == str(run / "checkpoints")
    run2 = tmp_path / "run2"
    assert _train(["--config", str(run), *RUN, f"run_dir={run2}"]) == 0
    tuned, _ = load_model(run, dtype="float32")
    np.testing.assert_allclose(read_metrics(run2)[0]["loss"], _first_batch_loss(tuned, cfg), rtol=2e-5)
    assert read_metrics(run2)[0]["loss"] != logged["loss"]  # the run's step moved the weights


def test_overrides_apply_on_top_of_the_directory(hf_dir):
    cfg = load_config(str(hf_dir), ["model.remat=full", "train.init_from=null", "train.out_dir=runs/x",
                                    "train.lora.rank=4"])
    assert cfg.model.remat == "full" and cfg.train.init_from is None and cfg.train.out_dir == "runs/x"
    assert cfg.train.lora.rank == 4 and cfg.model.num_layers == 2


def test_kimi_linear_directory_gives_its_model(tmp_path):
    from transformers import KimiLinearForCausalLM

    KimiLinearForCausalLM(kimi_linear_config()).save_pretrained(tmp_path)
    cfg = load_config(str(tmp_path))
    assert cfg.model == load_hf_config(tmp_path)[0] and cfg.model.uses("kda")


def test_a_directory_of_neither_kind_is_refused(tmp_path, hf_dir, capsys):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError, match="Hugging Face model directory.*k3jax run or checkpoint directory"):
        load_config(str(tmp_path))
    assert _train(["--config", str(tmp_path), *RUN]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    with pytest.raises(ConfigError, match="config.json but no \\*.safetensors"):
        load_config(str(no_weights))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing" / "model"))

"""infer.py and the server's loader keep a HF checkpoint in the dtype it stores: tiny DeepSeek-V3 models
saved by transformers' ``save_pretrained`` in bfloat16 and in float32 load as bfloat16 / float32
parameters (config.json's ``dtype``, or without it the safetensors' dtype), ``--dtype`` overrides, and
the weights' bytes per device printed at start are the parameters' bytes; a train.py checkpoint is cast
by ``--dtype`` the same way."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import infer  # noqa: E402
from k3jax import create_model, load_config  # noqa: E402
from k3jax.training import checkpoint  # noqa: E402
from k3jax.interop.hf_load import checkpoint_dtype  # noqa: E402
from k3jax.serving.loading import load_model, weight_bytes  # noqa: E402
from test_hf_interop import byte_deepseek_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_xla")

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"float32": dir, "bfloat16": dir, "bf16_no_dtype": dir}: one random model saved three ways."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(byte_deepseek_config()).eval()
    out = {}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        out[name] = tmp_path_factory.mktemp(name)
        model.to(dt).save_pretrained(out[name])
    out["bf16_no_dtype"] = tmp_path_factory.mktemp("bf16_no_dtype")
    for f in out["bfloat16"].iterdir():
        shutil.copy(f, out["bf16_no_dtype"])
    cfg_path = out["bf16_no_dtype"] / "config.json"
    hf = json.loads(cfg_path.read_text())
    assert "dtype" in hf or "torch_dtype" in hf  # what save_pretrained writes
    cfg_path.write_text(json.dumps({k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")}))
    return out


def _param_dtypes(model) -> set:
    return {str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(model)) if jnp.issubdtype(leaf.dtype, jnp.floating)}


def test_checkpoint_dtype_reads_config_then_safetensors(saved):
    assert checkpoint_dtype(saved["float32"]) == "float32"
    assert checkpoint_dtype(saved["bfloat16"]) == "bfloat16"
    assert checkpoint_dtype(saved["bf16_no_dtype"]) == "bfloat16"  # from the tensors' headers
    bad = saved["bf16_no_dtype"].parent / "int8_dtype"
    shutil.copytree(saved["bfloat16"], bad)
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "dtype": "int8"}))
    with pytest.raises(ValueError, match=r"config.json: dtype 'int8' is not a floating dtype"):
        checkpoint_dtype(bad)


@pytest.mark.parametrize("stored,asked,want", [
    ("bfloat16", "auto", "bfloat16"), ("bf16_no_dtype", "auto", "bfloat16"), ("float32", "auto", "float32"),
    ("bfloat16", "float32", "float32"), ("float32", "bfloat16", "bfloat16")])
def test_loaded_parameters_follow_the_checkpoint_unless_dtype_says(saved, stored, asked, want):
    model, cfg = load_model(saved[stored], dtype=asked)
    assert cfg.model.param_dtype == want and cfg.model.dtype == want
    dtypes = _param_dtypes(model)
    # the routers (and their bias) are float32 whatever the parameters are (k3jax's rule)
    assert dtypes == ({want, "float32"} if want == "bfloat16" else {"float32"}), dtypes
    assert model.embed[...].dtype == want
    if stored == "bfloat16" and asked == "auto":  # bf16 -> bf16 is exact: the stored bits
        from k3jax.interop.safetensors_io import SafetensorsFile

        with SafetensorsFile(saved[stored] / "model.safetensors") as f:
            np.testing.assert_array_equal(np.asarray(model.embed[...]), f.get("model.embed_tokens.weight"))


def test_infer_prints_the_weights_bytes_per_device(saved, capsys):
    for stored, asked in (("bfloat16", "auto"), ("bfloat16", "float32")):
        infer.main(["--checkpoint", str(saved[stored]), "--tokenizer", "byte", "--prompt", "Hi",
                    "--max-new-tokens", "2", "--dtype", asked])
        err = capsys.readouterr().err
        line = [ln for ln in err.splitlines() if ln.startswith("weights: ")]
        assert len(line) == 1, err
        model, _ = load_model(saved[stored], dtype=asked)
        (held,) = weight_bytes(model).values()  # one device
        want = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))
        assert held == want
        shown = float(re.match(r"weights: ([0-9.]+) MiB per device on 1 device\(s\) of process 0; parameters "
                               r"(\w+)", line[0]).group(1))
        assert abs(shown - want / 2**20) <= 0.0005 and f"parameters {model.cfg.param_dtype}" in line[0], line[0]
    # bfloat16 halves the bytes of everything but the float32-only leaves
    bf16 = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(load_model(saved["bfloat16"])[0])))
    assert bf16 < 0.55 * want


def test_a_train_checkpoint_is_cast_by_dtype(tmp_path):
    cfg = load_config("tiny", ["model.num_layers=2", f"train.out_dir={tmp_path}"])
    model = create_model(cfg.model)
    checkpoint.save_model(tmp_path / "checkpoints", model, cfg)
    same, _ = load_model(tmp_path)
    cast, cast_cfg = load_model(tmp_path, dtype="bfloat16")
    assert cast_cfg.model.param_dtype == "bfloat16" and _param_dtypes(same) == {"float32"}
    for a, b in zip(jax.tree.leaves(nnx.state(same)), jax.tree.leaves(nnx.state(cast))):
        np.testing.assert_array_equal(np.asarray(a.astype(b.dtype)), np.asarray(b))

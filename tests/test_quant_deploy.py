"""MXFP4 deployment: packed experts as model state, the QAT model -> packed model -> Orbax / the
release's HF layout -> back, the memory of packed experts, and infer.py on an exported checkpoint."""

import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.training import checkpoint
from k3jax.config import Config, load_config
from k3jax.interop import from_hf, hf_names, mxfp4, to_hf
from k3jax.interop.safetensors_io import SafetensorsFile
from k3jax.model import abstract_model, create_model
from k3jax.params import count_params
from k3jax.interop.packed_experts import expert_memory, packed_config, to_packed
from k3jax.quant.packed import MXFP4Bytes, MXFP4Weight

from cpu_devices import run_child, subprocess_env

pytestmark = pytest.mark.usefixtures("fast_xla")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["model.num_layers=3", "train.seq_len=32", "train.batch_size=4"]  # two MoE layers (KDA, MLA)
PACKED_FRACTION = (4 + 8 / 32) / 16  # 4-bit codes + one 8-bit scale per 32, against bfloat16


def qat_config(*extra) -> Config:
    return load_config("tiny", SMALL + ["quant.experts=mxfp4_qat", *extra])


def expert_weights(model) -> dict:
    return {tuple(p): m for p, m in nnx.iter_graph(model) if isinstance(m, MXFP4Weight)}


@nnx.jit
def forward(model, tokens):
    """The logits, jitted (op by op, a forward pass compiles hundreds of small programs; models of one
    structure share the compile)."""
    return model(tokens)[0]


@nnx.jit
def prefill(model, tokens, cache):
    return model(tokens, cache=cache)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)


@pytest.fixture(scope="module")
def qat_model():
    return create_model(qat_config().model, seed=1)


@pytest.fixture(scope="module")
def qat_logits(qat_model, tokens):
    return np.asarray(forward(qat_model, tokens))


def test_packed_model_holds_bytes_not_parameters():
    cfg = load_config("tiny", SMALL + ["quant.experts=mxfp4"]).model
    model = create_model(cfg, seed=0)
    experts = expert_weights(model)
    assert len(experts) == 3 * (cfg.num_layers - cfg.first_dense_layers)
    w = next(m for p, m in experts.items() if p[-1] == "w_gate")  # (E, L, F) -> packed (E, F, L/2)
    e, latent, width = cfg.moe.num_experts, cfg.moe.latent_dim, cfg.moe.expert_dim
    packed = w.packed.get_raw_value()
    assert packed.dtype == jnp.uint8 and packed.shape[-3:] == (e, width, latent // 2)
    assert w.scale.get_raw_value().shape[-3:] == (e, width, latent // 32)
    assert w.packed.get_metadata()["out_sharding"][-3:] == ("expert", "expert_mlp", "expert_in")
    # not parameters: no optimizer state, no gradient; the parameter count still counts the weights
    assert not any(isinstance(v, MXFP4Bytes) for _, v in nnx.iter_graph(nnx.state(model, nnx.Param)))
    assert count_params(cfg) == count_params(load_config("tiny", SMALL).model)
    # the same random draw as the dense model, quantized
    ref = create_model(load_config("tiny", SMALL).model, seed=0)
    for path, m in experts.items():
        dense_w = np.asarray(_leaf(ref, path))
        want = mxfp4.encode(np.swapaxes(dense_w, -1, -2))
        np.testing.assert_array_equal(np.asarray(m.packed.get_raw_value()), want[0])
        np.testing.assert_array_equal(np.asarray(m.scale.get_raw_value()), want[1])


def _leaf(model, path):
    for p, v in nnx.iter_graph(model):
        if tuple(p) == tuple(path):
            return v.get_raw_value()
    raise KeyError(path)


def test_expert_memory_is_17_64_of_bfloat16():
    tiny = expert_memory(load_config("tiny", SMALL).model)
    assert tiny["ratio"] == PACKED_FRACTION == 17 / 64
    k3 = expert_memory(load_config("k3").model)
    routed = count_params(load_config("k3").model)["routed_experts"]
    assert k3["routed_params"] == routed == 92 * 896 * 3 * 3584 * 3072
    assert k3["routed_bf16_bytes"] == 2 * routed and k3["routed_mxfp4_bytes"] == routed * 17 // 32
    # about the release's 1.56 TB (which adds a 0.4B-parameter vision tower)
    assert 1.55e12 < k3["model_mxfp4_bytes"] < 1.57e12 and k3["model_bf16_bytes"] > 5.5e12


def test_abstract_packed_k3():
    """What k3jax.aot compiles for MXFP4 decode: the config override quant.experts=mxfp4."""
    model = abstract_model(load_config("k3", ["model.param_dtype=bfloat16", "quant.experts=mxfp4"]).model)
    w1 = model.groups.layers[0].ffn.w_gate
    assert w1.packed.get_raw_value().shape == (22, 896, 3072, 1792)  # 22 scanned groups, 896 experts, [out, in/2]
    assert w1.scale.get_raw_value().shape == (22, 896, 3072, 112)
    assert w1.packed.get_metadata()["out_sharding"] == ("layers", "expert", "expert_mlp", "expert_in")
    w2 = model.groups.layers[0].ffn.w_down
    assert w2.packed.get_raw_value().shape == (22, 896, 3584, 1536) and w2.shape == (22, 896, 3072, 3584)
    assert packed_config(load_config("k3").model).quant.experts == "mxfp4"


def test_to_packed_computes_what_qat_computed(qat_model, qat_logits, tokens):
    packed = to_packed(qat_model)
    assert packed.cfg.quant.experts == "mxfp4"
    assert len(expert_weights(packed)) == 3 * (packed.cfg.num_layers - packed.cfg.first_dense_layers)
    np.testing.assert_array_equal(np.asarray(forward(packed, tokens)), qat_logits)
    # decoding with a cache runs through the same on-the-fly dequantization
    cache = packed.init_cache(batch_size=2, max_len=32)
    step_logits, cache = prefill(packed, tokens[:, :20], cache)
    np.testing.assert_allclose(np.asarray(step_logits), qat_logits[:, :20], rtol=2e-4, atol=2e-4)


def test_packed_orbax_checkpoint_round_trip(qat_model, qat_logits, tokens, tmp_path):
    packed = to_packed(qat_model)
    config = Config(name="packed", model=packed.cfg)
    checkpoint.save_model(tmp_path / "ckpt", packed, config)
    again, cfg = checkpoint.restore_model(tmp_path / "ckpt")
    assert cfg.model.quant.experts == "mxfp4"
    for path, m in expert_weights(packed).items():
        a = expert_weights(again)[path]
        np.testing.assert_array_equal(np.asarray(a.packed.get_raw_value()), np.asarray(m.packed.get_raw_value()))
    np.testing.assert_array_equal(np.asarray(forward(again, tokens)), qat_logits)


@pytest.fixture(scope="module")
def exported(qat_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("qat_hf")
    hf_cfg = to_hf(qat_model, path, model_type="kimi_k3", mxfp4_experts=True, max_shard_size="200KB")
    return path, hf_cfg


def test_export_holds_the_qat_values(exported, qat_model):
    path, hf_cfg = exported
    assert hf_cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    wm = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w1"  # the MLA layer
    with SafetensorsFile(path / wm[name + ".weight_packed"]) as f:
        packed = f.get(name + ".weight_packed")
    with SafetensorsFile(path / wm[name + ".weight_scale"]) as f:
        scale = f.get(name + ".weight_scale")
    (bnd,) = [b for b in hf_names.bindings(qat_model.cfg, qat_model.plan, "kimi_k3", "language_model.")
              if b.hf == name]
    master = np.asarray(_leaf(qat_model, bnd.leaf))[bnd.index]  # (in, out) float32
    want_packed, want_scale = mxfp4.encode(master.T, rule=qat_model.cfg.quant.scale_rule)
    np.testing.assert_array_equal(packed, want_packed)
    np.testing.assert_array_equal(scale, want_scale)


def test_hf_round_trip_keeps_the_bytes_and_the_outputs(exported, qat_model, qat_logits, tokens, tmp_path):
    path, _ = exported
    packed = from_hf(path, keep_mxfp4=True)
    assert packed.cfg.quant.experts == "mxfp4"
    np.testing.assert_allclose(np.asarray(forward(packed, tokens)), qat_logits, rtol=1e-5, atol=1e-5)
    mine = to_packed(qat_model)
    for p, m in expert_weights(mine).items():
        np.testing.assert_array_equal(np.asarray(expert_weights(packed)[p].packed.get_raw_value()),
                                      np.asarray(m.packed.get_raw_value()))
    dense = from_hf(path)  # decoded to float32 on load: the same function
    assert dense.cfg.quant.experts == "none"
    np.testing.assert_allclose(np.asarray(forward(dense, tokens)), qat_logits, rtol=1e-5, atol=1e-5)
    again = tmp_path / "again"
    to_hf(packed, again, model_type="kimi_k3", max_shard_size="200KB")
    for f in sorted(path.glob("*.safetensors")):
        with SafetensorsFile(f) as a, SafetensorsFile(again / f.name) as b:
            assert a.keys() == b.keys()
            for k in a.keys():
                np.testing.assert_array_equal(a.get(k), b.get(k), err_msg=k)


def test_infer_cli_runs_on_the_exported_checkpoint(exported, tmp_path):
    path, _ = exported
    env = subprocess_env()  # XLA's optimisation passes off: compiled faster, the same text is checked
    out = subprocess.run([sys.executable, str(ROOT / "infer.py"), "--checkpoint", str(path), "--tokenizer", "byte",
                          "--prompt", "And God said", "--max-new-tokens", "8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("And God said") and len(out.stdout.rstrip("\n")) > len("And God said")


def test_packed_bytes_are_a_quarter_of_bfloat16(qat_model):
    packed = to_packed(qat_model)
    nbytes = sum(math.prod(v.get_raw_value().shape) for _, v in nnx.iter_graph(packed) if isinstance(v, MXFP4Bytes))
    logical = sum(math.prod(m.shape) for m in expert_weights(packed).values())
    assert nbytes == logical * 2 * PACKED_FRACTION
    jax.block_until_ready(nnx.state(packed))


def test_packed_experts_under_expert_parallelism():
    """8 fake CPU devices: a packed MXFP4 + MXFP8 model sharded (data, fsdp, expert) computes what it
    computes on one device."""
    run_child("packed_experts_sharded")

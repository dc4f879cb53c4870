"""Quantized Kimi K2 releases through from_hf: compressed-tensors ``pack-quantized`` INT4 experts (the K2
Thinking layout, written here by the compressed-tensors package itself) against transformers' logits on
the same checkpoint, decoded on load and kept compressed; block-scaled FP8 (K2) kept compressed against
decoded; bad scales named; the ignore list; the ``kimi_k25`` model type.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp  # noqa: E402

from test_hf_interop import deepseek_config, hf_logits, randomize_torch, rel_err, run  # noqa: E402
from k3jax.interop import compressed_tensors, from_hf  # noqa: E402
from k3jax.interop.hf_config import HFConfigError, config_from_hf  # noqa: E402
from k3jax.interop.safetensors_io import SafetensorsFile, TensorSpec, write_file  # noqa: E402
from k3jax.quant.fp8_block import FP8BlockWeight, quantize_fp8_block  # noqa: E402
from k3jax.quant.int4 import Int4Weight  # noqa: E402
from k3jax.quant.storage import QuantizedStorage  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_xla")

REL_TOL = 1e-4
GROUP = 8  # the tiny model's widths (48, 24) are multiples of 8; K2 Thinking uses 32
# K2 Thinking's ignore list: routed experts INT4, attention / shared experts / dense MLPs / head bfloat16
K2_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
ROUTED = ".mlp.experts."


def _int4_args(group: int = GROUP) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)


def ct_compress(w: torch.Tensor, scale_dtype, group: int = GROUP) -> dict[str, torch.Tensor]:
    """compressed-tensors' own pack-quantized form of one weight: its min-max group scales (stored in
    ``scale_dtype``), then its compressor (weight_packed, weight_scale, weight_shape)."""
    args = _int4_args(group)
    scale, zero = compute_dynamic_scales_and_zp(w, args, module=None)
    state = {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero}
    return PackedQuantizationCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))


def write_int4(src: pathlib.Path, dst: pathlib.Path, scale_dtype, *, ignore=K2_THINKING_IGNORE) -> None:
    """The dense checkpoint ``src`` with its routed experts in compressed-tensors INT4 (the K2 Thinking layout)."""
    from safetensors.torch import load_file, save_file

    out = {}
    for name, w in load_file(src / "model.safetensors").items():
        if ROUTED in name:
            for part, v in ct_compress(w, scale_dtype).items():
                out[name.removesuffix("weight") + part] = v
        else:
            out[name] = w
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    scheme = QuantizationScheme(targets=["Linear"], weights=_int4_args())
    cfg["quantization_config"] = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                                    quantization_status="compressed", ignore=ignore).to_dict()
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 96, (2, 20)).astype(np.int32)


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_config()).eval()
    randomize_torch(model, 3)
    path = tmp_path_factory.mktemp("k2_dense")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def int4_ckpt(dense_ckpt, tmp_path_factory, tokens):
    """float32 scales (what compressed-tensors writes for a float32 model): both sides decode exactly."""
    from transformers import CompressedTensorsConfig, DeepseekV3ForCausalLM

    path = tmp_path_factory.mktemp("k2_int4") / "ckpt"
    write_int4(dense_ckpt, path, torch.float32)
    # transformers' compressed-tensors integration, decompressing on CPU at load time
    hf = DeepseekV3ForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(dequantize=True),
                                               dtype=torch.float32).eval()
    return path, hf_logits(hf, tokens), hf_logits(DeepseekV3ForCausalLM.from_pretrained(dense_ckpt).eval(), tokens)


def test_int4_checkpoint_matches_transformers(int4_ckpt, tokens):
    path, ref, dense_ref = int4_ckpt
    names = SafetensorsFile(path / "model.safetensors").keys()
    assert any(n.endswith("experts.0.gate_proj.weight_packed") for n in names)
    assert "model.layers.0.self_attn.q_a_proj.weight" in names  # ignored: stored bfloat16 / dense
    model = from_hf(path)
    assert model.cfg.quant.experts == "none" and model.cfg.quant.int4_group_size == GROUP
    abs_err, rel = rel_err(run(model, tokens), ref)
    print(f"\nINT4 (compressed-tensors) vs transformers: max abs {abs_err:.3e}, rel {rel:.3e}")
    assert rel < REL_TOL
    assert rel_err(ref, dense_ref)[1] > 100 * REL_TOL  # the quantization is visible: not the dense model's logits


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_kept_compressed_equals_decoded(dense_ckpt, tmp_path, tokens, scale_dtype):
    """K2 Thinking ships bfloat16 scales; kept compressed they are the model's storage, unchanged."""
    path = tmp_path / "int4"
    write_int4(dense_ckpt, path, scale_dtype)
    decoded = from_hf(path)
    kept = from_hf(path, keep_quantized=True)
    w = kept.groups.layers[0].ffn.w_up  # layers 1 and 2 (the MoE layers), stacked
    assert isinstance(w, Int4Weight) and kept.cfg.quant.experts == "int4"
    assert isinstance(w.packed, QuantizedStorage) and not isinstance(w.packed, nnx.Param)
    assert w.packed.get_raw_value().dtype == jnp.int32
    params = nnx.state(kept, nnx.Param)
    assert not any(isinstance(v, QuantizedStorage) for _, v in nnx.iter_graph(params))
    # the bytes are the checkpoint's
    with SafetensorsFile(path / "model.safetensors") as f:
        np.testing.assert_array_equal(np.asarray(w.packed[...])[1, 4],
                                      f.get("model.layers.2.mlp.experts.4.up_proj.weight_packed"))
    np.testing.assert_array_equal(run(kept, tokens), run(decoded, tokens))


def write_fp8(src: pathlib.Path, dst: pathlib.Path, block: tuple[int, int]) -> None:
    """The dense checkpoint ``src`` in K2's fp8 layout: every projection (not the router, embedding, head,
    norms) float8_e4m3fn with a float32 ``weight_scale_inv`` per block."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    specs = []
    with SafetensorsFile(src / "model.safetensors") as f:
        for k in f.keys():
            w = f.get(k)
            if k.endswith("proj.weight") or (ROUTED in k):
                q, s = (np.asarray(a) for a in quantize_fp8_block(jnp.asarray(w, jnp.float32), block))
                specs.append(TensorSpec(k, q.shape, ml_dtypes.float8_e4m3fn, lambda q=q: q))
                specs.append(TensorSpec(k + "_scale_inv", s.shape, np.float32, lambda s=s: s))
            else:
                specs.append(TensorSpec(k, w.shape, w.dtype, lambda w=w: w))
    write_file(dst / "model.safetensors", specs)


def test_fp8_block_kept_compressed_equals_decoded(dense_ckpt, tmp_path, tokens):
    path = tmp_path / "fp8"
    write_fp8(dense_ckpt, path, (16, 16))  # 48 and 24 wide: partial edge tiles
    decoded = from_hf(path)
    kept = from_hf(path, keep_quantized=True)
    assert kept.cfg.quant.experts == "fp8_block" and kept.cfg.quant.fp8_block == (16, 16)
    w = kept.groups.layers[0].ffn.w_gate
    assert isinstance(w, FP8BlockWeight) and w.weight.get_raw_value().dtype == jnp.float8_e4m3fn
    assert w.scale_inv.get_raw_value().shape[-2:] == (2, 3)  # [24, 48] in 16 x 16 tiles
    np.testing.assert_array_equal(run(kept, tokens), run(decoded, tokens))
    # decoded = the fp8 values times their tile's scale
    with SafetensorsFile(path / "model.safetensors") as f:
        q = f.get("model.layers.1.mlp.experts.5.down_proj.weight").astype(np.float32)
        s = f.get("model.layers.1.mlp.experts.5.down_proj.weight_scale_inv")
    expected = q * np.repeat(np.repeat(s, 16, 0), 16, 1)[: q.shape[0], : q.shape[1]]
    got = decoded.groups.layers[0].ffn.w_down
    np.testing.assert_array_equal(np.asarray(got[...])[0, 5], expected.T)


def _rewrite(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
    shutil.copytree(src, dst)
    with SafetensorsFile(src / "model.safetensors") as f:
        specs = []
        for k in f.keys():
            v = edit(k, f.get(k))
            specs.append(TensorSpec(k, v.shape, v.dtype, lambda v=v: v))
    write_file(dst / "model.safetensors", specs)


def test_mismatched_scales_name_the_tensor(int4_ckpt, dense_ckpt, tmp_path):
    path, _, _ = int4_ckpt
    bad = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    _rewrite(path, tmp_path / "int4", lambda k, v: v[:, :-1] if k == bad else v)
    for keep in (False, True):
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight_scale: shape"):
            from_hf(tmp_path / "int4", keep_quantized=keep)
    write_fp8(dense_ckpt, tmp_path / "fp8_src", (16, 16))
    bad = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"
    _rewrite(tmp_path / "fp8_src", tmp_path / "fp8", lambda k, v: v[:1] if k == bad else v)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv: shape"):
        from_hf(tmp_path / "fp8")


def test_ignore_list_is_honoured(int4_ckpt, tmp_path):
    path, _, _ = int4_ckpt
    dst = tmp_path / "ignored"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = [*K2_THINKING_IGNORE, "re:.*experts\\.2\\..*"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.experts\.2\.\w+_proj: stored as INT4.*ignore list names it"):
        from_hf(dst)


def test_int4_config_refusals(int4_ckpt):
    path, _, _ = int4_ckpt
    base = json.loads((path / "config.json").read_text())
    q = base["quantization_config"]
    info = config_from_hf(base)[1].int4
    assert info.group_size == GROUP and info.quantizes("model.layers.1.mlp.experts.0.up_proj")
    for module in ("lm_head", "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.shared_experts.up_proj",
                   "model.layers.0.mlp.down_proj"):
        assert not info.quantizes(module), module
    for field, value, match in [("symmetric", False, "weights.symmetric"), ("num_bits", 8, "weights.num_bits"),
                                ("strategy", "channel", "weights.strategy"), ("group_size", None, "weights.group_size")]:
        cfg = json.loads(json.dumps(base))
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"][field] = value
        with pytest.raises(HFConfigError, match=f"config_groups.group_0.{match}"):
            config_from_hf(cfg)
    cfg = json.loads(json.dumps(base))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = q["config_groups"]["group_0"]["weights"]
    with pytest.raises(HFConfigError, match="input_activations"):
        config_from_hf(cfg)


def test_int4_codec_matches_compressed_tensors():
    """k3jax's NumPy decoder and the JAX dequantizer against compressed-tensors' own decompression, a
    width that is not a multiple of 8 included (a padded last word)."""
    from k3jax.quant.int4 import dequantize_int4

    g = torch.Generator().manual_seed(0)
    for out_dim, in_dim, group in [(5, 12, 4), (3, 48, 16), (7, 64, 32)]:
        w = torch.randn(out_dim, in_dim, generator=g)
        state = ct_compress(w, torch.bfloat16, group)
        args = _int4_args(group)
        ref = PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))
        packed, scale = state["weight_packed"].numpy(), state["weight_scale"].float().numpy()
        ours = compressed_tensors.decode("w", packed, scale, state["weight_shape"].numpy(), group)
        # compressed-tensors multiplies in the scale's dtype (bfloat16): ours is the exact product, rounded the same
        np.testing.assert_array_equal(ours.astype(ml_dtypes.bfloat16).astype(np.float32), ref["weight"].float().numpy())
        q = compressed_tensors.unpack(packed)[:, :in_dim]
        assert q.min() >= -8 and q.max() <= 7
        if in_dim % 8 == 0:
            np.testing.assert_array_equal(np.asarray(dequantize_int4(jnp.asarray(packed), jnp.asarray(scale), group)),
                                          ours)


def test_kimi_k25_maps_onto_k2_and_moonvit(dense_ckpt, tmp_path, tokens):
    """transformers' kimi_k25 config (K2 text model + K2.5 MoonViT) maps onto the deepseek_v3 one and K2.5's
    vision switches; a checkpoint in the release layout (text weights under ``language_model.``) loads to
    the same model as the bare K2 checkpoint."""
    from transformers import Kimi_K25Config

    from k3jax.interop.hf_config import runtime_fields_equal
    from k3jax.interop.hf_config_export import config_to_hf

    text = json.loads((dense_ckpt / "config.json").read_text())
    vision = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 40,
              "pos_emb_height": 8, "pos_emb_width": 8}
    k25 = Kimi_K25Config(text_config={**text, "model_type": "kimi_k2"}, vision_config=vision,
                         projection_hidden_size=32, tie_word_embeddings=False).to_dict()
    with pytest.warns(UserWarning, match="kimi_k25 vision_config"):
        cfg, info = config_from_hf(k25)
    assert info.model_type == "kimi_k25" and info.has_vision
    assert runtime_fields_equal(cfg, config_from_hf(text)[0])
    v = cfg.vision
    assert (v.hidden_size, v.num_heads, v.head_dim, v.num_layers, v.mlp_dim, v.pos_emb_size) == (32, 2, 16, 2, 40, 8)
    assert (v.norm, v.norm_eps, v.bias, v.pos_interpolation, v.projector) == ("layernorm", 1e-5, True, "bicubic",
                                                                              "patchmerger")
    ids = [f"vision.media_{x}_id={i}" for i, x in enumerate(("begin", "content", "end", "pad"), 90)]  # tiny vocab
    assert config_from_hf(k25, overrides=["vision.enabled=true", *ids])[0].vision.enabled
    with pytest.raises(HFConfigError, match="kimi_k25 is read, not written"):
        config_to_hf(cfg, "kimi_k25")
    bad = json.loads(json.dumps(k25))
    bad["text_config"]["model_type"] = "kimi_linear"
    with pytest.raises(HFConfigError, match="text_config.model_type"):
        config_from_hf(bad)

    dst = tmp_path / "k25"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(k25))
    with SafetensorsFile(dense_ckpt / "model.safetensors") as f:
        write_file(dst / "model.safetensors", [TensorSpec("language_model." + k, f.shape(k), f.get(k).dtype,
                                                          lambda k=k: f.get(k)) for k in f.keys()])
    with pytest.warns(UserWarning, match="vision"):
        model = from_hf(dst)
    np.testing.assert_array_equal(run(model, tokens), run(from_hf(dense_ckpt), tokens))

"""Compressed weights held in the model (k3jax/quant/int4.py, fp8_block.py, storage.py): the JAX codecs
against the HF interop's NumPy codec and the format's definition, the routed experts read through
``expert_weight``, the storage left out of training, the config checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError, load_config
from k3jax.interop import compressed_tensors
from k3jax.layers.quantized_experts import expert_weight
from k3jax.model import abstract_model, create_model
from k3jax.quant.fp8_block import FP8BlockWeight, dequantize_fp8_block, quantize_fp8_block
from k3jax.quant.int4 import Int4Weight, dequantize_int4, pack_int4, quantize_int4, unpack_int4
from k3jax.quant.storage import QuantizedStorage

pytestmark = pytest.mark.usefixtures("fast_xla")


def test_int4_packing_order():
    """Value 8 j + k of a row is word j's nibble k, offset-binary (q + 8): written out by hand."""
    q = np.array([[-8, -1, 0, 1, 7, 3, -5, 2, 6, 5, 4, -2, -3, -4, -6, -7]], np.int8)
    nibbles = (q.astype(np.int64) + 8).reshape(1, 2, 8)
    words = (nibbles << (4 * np.arange(8))).sum(-1).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(np.asarray(pack_int4(jnp.asarray(q))), words)
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(words))), q)
    np.testing.assert_array_equal(compressed_tensors.unpack(words), q)


def test_int4_jax_matches_numpy_codec():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 64)).astype(np.float32)
    w[0, 0, :16] = 0.0  # a zero group: scale 0, values 0
    packed, scale = quantize_int4(jnp.asarray(w), 16, jnp.bfloat16)
    assert packed.shape == (3, 5, 8) and packed.dtype == jnp.int32 and scale.shape == (3, 5, 4)
    ours = np.asarray(dequantize_int4(packed, scale, 16))
    for e in range(3):
        ref = compressed_tensors.decode("w", np.asarray(packed[e]), np.asarray(scale[e], np.float32), (5, 64), 16)
        np.testing.assert_array_equal(ours[e], ref)
    assert not ours[0, 0, :16].any()
    # symmetric min-max (amax / 7.5): half a step of rounding, plus the clamp of +amax to 7 steps once the
    # scale is rounded to bfloat16 (relative error up to 2^-8 of 7.5 steps)
    step = np.repeat(np.asarray(scale, np.float32), 16, axis=-1)
    assert np.all(np.abs(ours - w) <= 0.5 * step + 7.5 * 2**-8 * step + 1e-7)
    with pytest.raises(ValueError, match="INT4 shapes disagree"):
        dequantize_int4(packed, scale[..., :3], 16)


def test_fp8_block_roundtrip_and_edges():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((2, 40, 24)) * np.linspace(0.01, 10, 24)).astype(np.float32)
    elements, scale = quantize_fp8_block(jnp.asarray(w), (16, 16))
    assert elements.dtype == jnp.float8_e4m3fn and scale.shape == (2, 3, 2)  # partial edge tiles
    back = np.asarray(dequantize_fp8_block(elements, scale, (16, 16)))
    tile_max = np.repeat(np.repeat(np.asarray(scale), 16, 1), 16, 2)[:, :40, :24] * 448
    assert np.all(np.abs(back - w) <= np.maximum(np.abs(w) * 2**-4, tile_max * 2**-9 * 2**-6))
    ref = np.asarray(elements, np.float32) * np.repeat(np.repeat(np.asarray(scale), 16, 1), 16, 2)[:, :40, :24]
    np.testing.assert_array_equal(back, ref)
    with pytest.raises(ValueError, match="FP8 block scales"):
        dequantize_fp8_block(elements, scale[:, :2], (16, 16))


@pytest.mark.parametrize("mode", ["int4", "fp8_block"])
def test_compressed_experts_in_the_model(mode):
    """A model built with compressed experts: its expert weights are QuantizedStorage (not Params), the
    experts read through expert_weight are the dequantized storage, and a gradient step over the Params
    (the frozen-base setting) runs and leaves the storage alone."""
    cfg = load_config("tiny", [f"quant.experts={mode}", "quant.int4_group_size=16", "quant.fp8_block=[16,16]",
                               "model.num_layers=2", "model.first_dense_layers=0"]).model
    model = create_model(cfg)
    kind = Int4Weight if mode == "int4" else FP8BlockWeight
    ws = [m for _, m in nnx.iter_graph(model) if isinstance(m, kind)]
    assert ws and not any(isinstance(v, nnx.Param) and v.get_raw_value().ndim == 4 and "expert" in
                          (v.get_metadata().get("out_sharding") or ()) for _, v in nnx.iter_graph(model))
    w = ws[0]
    stored = [v for _, v in nnx.iter_graph(w) if isinstance(v, nnx.Variable)]
    assert stored and all(isinstance(v, QuantizedStorage) and not isinstance(v, nnx.Param) for v in stored)
    dense = np.asarray(expert_weight(w, jnp.float32, cfg.quant))
    assert dense.shape == w.shape
    if mode == "int4":
        flat_p = np.asarray(w.packed[...]).reshape(-1, *w.packed[...].shape[-2:])
        flat_s = np.asarray(w.scale[...], np.float32).reshape(-1, *w.scale[...].shape[-2:])
        ref = np.stack([compressed_tensors.decode("w", p, s, (p.shape[0], p.shape[1] * 8), 16)
                        for p, s in zip(flat_p, flat_s)])
        np.testing.assert_array_equal(dense.reshape(-1, *dense.shape[-2:]), np.swapaxes(ref, -1, -2))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)), jnp.int32)
    before = [np.asarray(v.get_raw_value()) for v in stored]

    def loss(m):
        return jnp.mean(m(tokens)[0].astype(jnp.float32) ** 2)

    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param)))(model)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert not any(isinstance(v, QuantizedStorage) for _, v in nnx.iter_graph(grads))
    for v, b in zip(stored, before):
        np.testing.assert_array_equal(np.asarray(v.get_raw_value()), b)


def test_compressed_expert_config_checks():
    with pytest.raises(ConfigError, match=r"model.quant.int4_group_size"):
        load_config("tiny", ["quant.experts=int4", "quant.int4_group_size=12"])
    with pytest.raises(ConfigError, match=r"model\.moe\.\w+_dim.*quant.int4_group_size=128"):
        load_config("tiny", ["quant.experts=int4", "quant.int4_group_size=128"])
    with pytest.raises(ConfigError, match=r"model.quant.fp8_block"):
        load_config("tiny", ["quant.experts=fp8_block", "quant.fp8_block=[0,16]"])


def test_k2_expert_memory_int4_and_fp8():
    """Full K2's routed experts at rest (abstract model, nothing allocated): INT4 in groups of 32 with
    bfloat16 scales (K2 Thinking) is 4.5 bits a weight, block FP8 with float32 scales (K2) about 8."""
    base = load_config("k2", ["model.param_dtype=bfloat16"]).model
    n = sum(int(np.prod(m.shape)) for _, m in nnx.iter_graph(abstract_model(
        load_config("k2", ["model.param_dtype=bfloat16", "quant.experts=int4"]).model)) if isinstance(m, Int4Weight))
    for mode, bits in (("int4", 4.5), ("fp8_block", 8 + 32 / 128**2)):
        model = abstract_model(load_config("k2", ["model.param_dtype=bfloat16", f"quant.experts={mode}"]).model)
        nbytes = sum(int(np.prod(v.get_raw_value().shape)) * jnp.dtype(v.get_raw_value().dtype).itemsize
                     for _, v in nnx.iter_graph(model) if isinstance(v, QuantizedStorage))
        print(f"\nK2 routed experts ({n} weights) as {mode}: {nbytes / 1e9:.1f} GB ({8 * nbytes / n:.3f} bits a weight; "
              f"bfloat16 {2 * n / 1e9:.1f} GB)")
        assert abs(8 * nbytes / n - bits) < 1e-3
    assert base.quant.experts == "none"


@pytest.mark.parametrize("make", [
    lambda w, axes: Int4Weight.from_dense(w, 16, jnp.float32, axes),
    lambda w, axes: FP8BlockWeight.from_dense(w, (16, 8), axes),
])
def test_cast_reads_compressed_projections(make):
    """``initializers.cast``, the accessor of every projection, dequantizes a compressed weight: on a
    one-device mesh too (the FSDP gather of its dense logical axes)."""
    from k3jax.layers.initializers import cast

    w = jnp.asarray(np.random.default_rng(2).standard_normal((32, 3, 8)).astype(np.float32)).reshape(32, 24)
    with nnx.use_eager_sharding(False):  # logical axis names, resolved only by the sharding code
        q = make(w, ("embed", "mlp"))
    np.testing.assert_array_equal(np.asarray(cast(q, jnp.bfloat16)), np.asarray(q.dequantize(jnp.bfloat16)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda: cast(q, jnp.float32))()),
                                      np.asarray(q.dequantize(jnp.float32)))

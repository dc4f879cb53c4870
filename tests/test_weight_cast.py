"""k3jax.ops.weight_cast: the float32 -> bfloat16 weight cast equals astype, and XLA:TPU keeps it in
the layer loop (no bfloat16 copy of the whole stack)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.weight_cast import weight_cast


def _special_float32() -> np.ndarray:
    f32 = np.finfo(np.float32)
    bits = np.array([
        0x3F808000,  # 1 + 2^-8: a tie, the upper half even -> rounds down
        0x3F818000,  # 1 + 3 * 2^-8: a tie, the upper half odd -> rounds up
        0x3F808001,  # just above a tie -> up
        0x3F807FFF,  # just below a tie -> down
        0x7F7FFFFF,  # the largest float32: rounds to +inf, as astype
        0x7F7F7FFF,  # just below the bfloat16 overflow point: stays finite
        0x00000001, 0x00008000, 0x00018000, 0x007FFFFF,  # subnormals, ties among them
        0x80000001, 0x807FFFFF,
    ], np.uint32).view(np.float32)
    return np.concatenate([bits, np.array([0.0, -0.0, np.inf, -np.inf, f32.tiny, -f32.max, 1.0, -1.5],
                                          np.float32)])


def test_float32_to_bfloat16_equals_astype_bit_for_bit():
    rng = np.random.default_rng(0)
    x = np.concatenate([_special_float32(),
                        rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
                        rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    finite_or_inf = ~np.isnan(x)
    got = np.asarray(jax.jit(lambda v: weight_cast(v, jnp.bfloat16))(x))
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got[finite_or_inf].view(np.uint16), want[finite_or_inf].view(np.uint16))
    assert np.all(np.isnan(got[~finite_or_inf].astype(np.float32)))  # random bits include NaNs
    assert (~finite_or_inf).sum() > 0


def test_gradient_and_other_dtypes_are_astypes():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((5,)), jnp.bfloat16)

    def loss(cast):
        return lambda x: jnp.sum(jnp.sin(cast(x) * w).astype(jnp.float32))

    got = jax.grad(loss(lambda v: weight_cast(v, jnp.bfloat16)))(x)
    want = jax.grad(loss(lambda v: v.astype(jnp.bfloat16)))(x)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert weight_cast(x, jnp.float32) is x
    assert weight_cast(w, jnp.float32).dtype == jnp.float32


@pytest.mark.tpu_aot
def test_scanned_weight_cast_is_not_hoisted_out_of_the_layer_loop_on_tpu():
    """The gradient of a remat'd layer scan over a float32 weight stack, compiled for v5p-8: with astype
    XLA:TPU converts the whole stack to bfloat16 outside the loops (full K3 on v5p-1024: 10.2 GB of
    routed-expert copies at the step's peak); with weight_cast each layer is rounded inside them."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax import aot
    from k3jax.config import MeshConfig
    from k3jax.sharding import make_mesh

    pytest.importorskip("libtpu")
    try:
        mesh = make_mesh(MeshConfig(data=1, fsdp=4), aot.TpuSlice.v5p("v5p-8").devices())
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    layers, e, i, o = 8, 4, 512, 1024
    ws = jax.ShapeDtypeStruct((layers, e, i, o), jnp.float32, sharding=NamedSharding(mesh, P(None, None, None, "fsdp")))
    x = jax.ShapeDtypeStruct((64, i), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))

    def whole_stack_bf16_values(cast):
        def loss(ws, x):
            layer = jax.checkpoint(lambda h, w: jnp.tanh(jnp.einsum("bi,eio->bo", h, cast(w))[:, :i]))
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
            return jnp.sum(h.astype(jnp.float32))

        with jax.set_mesh(mesh):
            hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
        return len(re.findall(rf"= bf16\[{layers},{e},{i},\d+\]", hlo))

    assert whole_stack_bf16_values(lambda w: w.astype(jnp.bfloat16)) > 0  # what the test guards against
    assert whole_stack_bf16_values(lambda w: weight_cast(w, jnp.bfloat16)) == 0


def test_gather_stages_drop_one_mesh_axis_at_a_time():
    """A weight stored over (fsdp, expert, sequence) is gathered over sequence, then expert, then fsdp
    (what ``use`` keeps split, here ``tensor``, stays split at every stage); one storage axis: one step."""
    from jax.sharding import PartitionSpec as P

    from k3jax.sharding import gather_stages

    storage = P(None, ("fsdp", "expert", "sequence"), "tensor")
    use = P(None, None, "tensor")
    assert gather_stages(storage, use) == (storage, P(None, ("fsdp", "expert"), "tensor"),
                                           P(None, "fsdp", "tensor"), use)
    assert gather_stages(P("fsdp", None), P(None, None)) == (P("fsdp", None), P(None, None))
    two_dims = P("expert", "fsdp")  # the minor-most mesh axis first, whichever dimension holds it
    assert gather_stages(two_dims, P(None, None)) == (two_dims, P(None, "fsdp"), P(None, None))


@pytest.mark.tpu_aot
def test_fsdp_weights_travel_as_bfloat16_all_gathers_on_tpu():
    """A remat'd layer scan reading float32 weights stored over every device of a v5p-128 (fsdp 16 x
    expert 4, as full K3's dense weights over v5p-1024's 512) through ``initializers.cast``, its
    gradient compiled by libtpu. Each pass over the layers (forward, recompute) gathers each layer's
    weight once, as all-gathers of bfloat16 values. Before: the gather was moved back through
    ``weight_cast``'s ops and sent the bfloat16 values and the NaN mask (a pred array packed into
    u32), each as one all-gather over the whole slice, which XLA:TPU writes as an all-reduce of a
    zero-padded buffer (twice the bytes)."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax import aot
    from k3jax.aot import breakdown
    from k3jax.config import MeshConfig
    from k3jax.layers.initializers import cast
    from k3jax.sharding import logical_to_spec, make_mesh

    pytest.importorskip("libtpu")
    try:
        mesh = make_mesh(MeshConfig(data=1, fsdp=16, expert=4), aot.TpuSlice.v5p("v5p-128").devices())
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    layers, d, h, k, b, t = 4, 2048, 4, 128, 64, 64
    axes = ("layers", "embed", "heads", "head_dim")
    ws = jax.ShapeDtypeStruct((layers, d, h, k), jnp.float32,
                              sharding=NamedSharding(mesh, logical_to_spec(axes, None, mesh, (layers, d, h, k))))
    x = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(("fsdp", "expert"), None, None)))

    def loss(ws, x):
        def layer(x, w):
            with nnx.use_eager_sharding(False):  # the weight's names are logical, as the model's
                wb = cast(nnx.Param(w, out_sharding=axes[1:]), jnp.bfloat16)
            return x + jnp.einsum("bthk,dhk->btd", jnp.tanh(jnp.einsum("btd,dhk->bthk", x, wb)), wb)

        y, _ = jax.lax.scan(lambda x, w: (jax.checkpoint(layer)(x, w), None), x, ws)
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    moved = breakdown.breakdown(hlo).collective_by_dtype
    n = mesh.devices.size
    one_pass = layers * d * h * k * 2 * (n - 1) / n  # bf16: what one device receives of each layer's weight
    assert not [key for key in moved if {"u32", "pred", "f32"} & set(key[1].split(","))], moved
    assert moved[("all-gather", "bf16")] == pytest.approx(2 * one_pass), moved  # forward and recompute
    # what remains all-reduced: each layer's gradient, summed into its storage shards once (a
    # reduce-scatter over the whole slice, which XLA:TPU also writes as an all-reduce)
    assert moved.get(("all-reduce", "bf16"), 0.0) <= 2 * one_pass * 1.01, moved
    assert not re.search(rf"= bf16\[{layers},{d},{h},{k}\]", hlo)  # each layer cast in the loop, as before

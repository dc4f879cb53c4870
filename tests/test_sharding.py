"""Sharding rules and meshes; a sharded forward on 8 fake CPU devices (``tests/children/sharded_forward.py``)."""

import jax

import pytest
from jax.sharding import PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.sharding import DEFAULT_RULES, logical_to_spec

from cpu_devices import run_child

@pytest.mark.slow
def test_sharded_forward_matches_single_device():
    run_child("sharded_forward")


def test_logical_rules_first_free_axis():
    assert logical_to_spec(("layers", "expert", "expert_in", "expert_mlp")) == P(None, "expert", ("fsdp", "sequence"),
                                                                                  "tensor")
    # dense weights are FSDP-sharded over the sequence and expert axes too
    assert logical_to_spec(("embed", "heads", "head_dim")) == P(("fsdp", "expert", "sequence"), "tensor", None)
    # 'fsdp' is taken by 'embed', so expert_in stays unsharded in the same array
    assert logical_to_spec(("embed", "expert_in")) == P(("fsdp", "expert", "sequence"), None)
    assert dict(DEFAULT_RULES)["batch"] == (("data", "fsdp", "expert"),)


def test_mesh_config_validation():
    from k3jax.sharding import make_mesh
    import jax

    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(MeshConfig(data=4), jax.devices()[:1])
    assert make_mesh(MeshConfig(), jax.devices()[:1]).shape["data"] == 1


def test_rules_are_shape_aware_and_fill_free_axes():
    from jax.sharding import AbstractMesh, AxisType

    from k3jax.sharding import MESH_AXES

    mesh = AbstractMesh((1, 2, 4, 2, 1), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    # a batch of 1 cannot be split: replicated, and the cache slots take every free axis instead
    assert logical_to_spec(("batch", "cache_length", "kv_lora"), mesh=mesh, shape=(1, 64, 8)) == \
        P(None, ("sequence", "fsdp", "expert"), None)
    # a batch of 2 takes what divides it; the slots take the rest
    assert logical_to_spec(("batch", "cache_length", "kv_lora"), mesh=mesh, shape=(2, 64, 8)) == \
        P("fsdp", ("sequence", "expert"), None)
    # trailing axes are dropped until the product divides the dimension: 16 over fsdp 2 x expert 4 x
    # sequence 2, 8 over fsdp x expert, 12 over fsdp only
    assert logical_to_spec(("embed", "heads"), mesh=mesh, shape=(16, 4)) == P(("fsdp", "expert", "sequence"), None)
    assert logical_to_spec(("embed", "heads"), mesh=mesh, shape=(8, 4)) == P(("fsdp", "expert"), None)
    assert logical_to_spec(("embed", "heads"), mesh=mesh, shape=(12, 4)) == P("fsdp", None)


def test_cache_shardings_follow_the_cache_tree():
    import jax

    from k3jax import load_config
    from k3jax.model import abstract_model
    from k3jax.sharding import cache_shardings, make_mesh

    cfg = load_config("tiny")
    model = abstract_model(cfg.model)
    cache = jax.eval_shape(lambda: model.init_cache(1, 32))
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    shardings = cache_shardings(cache, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(cache)
    stacked = shardings.groups[0]
    assert all(s.spec == P() or s.spec[0] is None for s in jax.tree.leaves(stacked))  # the group axis is never split


def test_gather_weight_is_identity_without_a_mesh():
    import jax.numpy as jnp

    from k3jax.sharding import gather_weight

    w = jnp.ones((4, 8))
    assert gather_weight(w, ("embed", "mlp")) is w


@pytest.mark.tpu_aot
def test_gathered_weight_gradient_is_reduce_scattered_on_tpu():
    """Compiled for v5p-8 (libtpu, no TPU), fsdp 4: a weight stored split over the batch devices is
    gathered for its matmul (``gather_weight``); its gradient, partial sums of the whole matrix on
    every device, is summed straight into the storage shards (a reduce-scatter of the matrix), not
    all-reduced whole (what the plain transpose of the gather's sharding constraint gives)."""
    pytest.importorskip("libtpu")
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from k3jax import aot
    from k3jax.aot import breakdown
    from k3jax.sharding import gather_weight, make_mesh

    try:
        devices = aot.TpuSlice.v5p("v5p-8").devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    mesh = make_mesh(MeshConfig(fsdp=4), devices)
    d, v, rows = 1024, 2048, 4096
    w = jax.ShapeDtypeStruct((d, v), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None)))
    x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))

    def loss(w, x):
        y = x @ gather_weight(w.astype(jnp.bfloat16), ("embed", "vocab"))
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    moved = breakdown.breakdown(hlo).collective_bytes
    share = d * v * 2 * 3 / 4  # bf16; what one device sends of a 4-way gather or reduce-scatter
    assert moved["all-gather"] == pytest.approx(share), moved  # the forward gather
    assert moved["reduce-scatter"] == pytest.approx(share), moved
    assert moved.get("all-reduce", 0) < share / 10, moved


def test_activations_are_constrained_to_their_logical_layout():
    """constrain_activation pins an activation to the layout of its logical axes under a mesh (rows over the
    data-like axes, tokens over `sequence`; an axis that does not divide is left out) and is the identity
    without one; the model's residual stream between sublayers carries the constraint."""
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType

    from k3jax import load_config
    from k3jax.model import RESIDUAL_AXES, create_model
    from k3jax.sharding import constrain_activation

    mesh = AbstractMesh((2, 1, 2, 2, 1), ("data", "fsdp", "expert", "sequence", "tensor"),
                        axis_types=(AxisType.Auto,) * 5)

    def specs(fn, *args):
        with jax.sharding.use_abstract_mesh(mesh):
            jaxpr = jax.make_jaxpr(fn)(*args)
        return [e.params["sharding"].spec for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"]

    x = jax.ShapeDtypeStruct((4, 8, 6), jnp.float32)
    assert specs(lambda x: constrain_activation(x, RESIDUAL_AXES), x) == [P(("data", "expert"), "sequence", None)]
    odd = jax.ShapeDtypeStruct((4, 1, 6), jnp.float32)  # one decode token: not split over `sequence`
    assert specs(lambda x: constrain_activation(x, RESIDUAL_AXES), odd) == [P(("data", "expert"), None, None)]
    assert not jax.make_jaxpr(lambda x: constrain_activation(x, RESIDUAL_AXES))(x).eqns

    cfg = load_config("tiny", ["model.num_layers=2", "model.scan_layers=false"]).model
    model = create_model(cfg)
    tokens = jax.ShapeDtypeStruct((4, 8), jnp.int32)
    found = specs(lambda t: model.forward(t)[0], tokens)
    assert found.count(P(("data", "expert"), "sequence", None)) >= 4 * cfg.num_layers, found

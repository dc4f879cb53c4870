"""Sharding rules and meshes on 8 fake CPU devices (run in a subprocess: the device count must be
set before JAX starts, and the rest of the suite runs on one device)."""

import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.sharding import DEFAULT_RULES, logical_to_spec

from cpu_devices import run_on_cpu_devices

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from k3jax import load_config, create_model
    from k3jax.sharding import make_mesh, shard_model, batch_sharding
    cfg = load_config('tiny', ['model.num_layers=5', 'mesh.data=2', 'mesh.fsdp=2', 'mesh.tensor=2'])
    m = create_model(cfg.model)
    tok = jax.random.randint(jax.random.key(1), (4, 24), 0, 256)
    f = jax.jit(lambda m, t: m(t)[0])
    ref = np.asarray(f(m, tok))
    mesh = make_mesh(cfg.mesh)
    shard_model(m, mesh)
    w = m.prefix[0].ffn.w_gate[...]  # dense FFN (d, F)
    assert w.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor'), w.sharding.spec
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (32, 96)
    with jax.set_mesh(mesh):
        out = np.asarray(f(m, jax.device_put(tok, batch_sharding(mesh))))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err
    print('OK', err)
""")


@pytest.mark.slow
def test_sharded_forward_matches_single_device():
    run_on_cpu_devices(SCRIPT)


def test_logical_rules_first_free_axis():
    assert logical_to_spec(("layers", "expert", "expert_in", "expert_mlp")) == P(None, "expert", ("fsdp", "sequence"),
                                                                                  "tensor")
    # dense weights are FSDP-sharded over the sequence and expert axes too
    assert logical_to_spec(("embed", "heads", "head_dim")) == P(("fsdp", "sequence", "expert"), "tensor", None)
    # 'fsdp' is taken by 'embed', so expert_in stays unsharded in the same array
    assert logical_to_spec(("embed", "expert_in")) == P(("fsdp", "sequence", "expert"), None)
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
    # trailing axes are dropped until the product divides the dimension (12 over fsdp 2 x sequence 2)
    assert logical_to_spec(("embed", "heads"), mesh=mesh, shape=(12, 4)) == P(("fsdp", "sequence"), None)


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

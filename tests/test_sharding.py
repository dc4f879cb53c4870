"""Sharding rules and meshes on 8 fake CPU devices (run in a subprocess: the device count must be
set before JAX starts, and the rest of the suite runs on one device)."""

import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from k3jax.config import MeshConfig
from k3jax.sharding import DEFAULT_RULES, logical_to_spec

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
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_logical_rules_first_free_axis():
    assert logical_to_spec(("layers", "expert", "expert_in", "expert_mlp")) == P(None, "expert", "fsdp", "tensor")
    # dense weights are FSDP-sharded over the expert axis too
    assert logical_to_spec(("embed", "heads", "head_dim")) == P(("fsdp", "expert"), "tensor", None)
    # 'fsdp' is taken by 'embed', so expert_in stays unsharded in the same array
    assert logical_to_spec(("embed", "expert_in")) == P(("fsdp", "expert"), None)
    assert dict(DEFAULT_RULES)["batch"] == (("data", "fsdp", "expert"),)


def test_mesh_config_validation():
    from k3jax.sharding import make_mesh
    import jax

    with pytest.raises(ValueError, match="needs 4 devices"):
        make_mesh(MeshConfig(data=4), jax.devices()[:1])
    assert make_mesh(MeshConfig(), jax.devices()[:1]).shape["data"] == 1

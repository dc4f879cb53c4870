"""A packed MXFP4-expert, MXFP8-activation tiny model sharded over 8 devices (``data, fsdp, expert``: experts
dequantized per device) computes what it computes on one device. Run by ``tests/test_quant_deploy.py``."""

import jax
import numpy as np

from k3jax import create_model, load_config
from k3jax.sharding import batch_sharding, make_mesh, shard_model


def main() -> None:
    jax.config.update("jax_disable_most_optimizations", True)
    cfg = load_config("tiny", ["model.num_layers=3", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2",
                               "quant.experts=mxfp4", "quant.activations=mxfp8"])
    m = create_model(cfg.model)
    tok = jax.random.randint(jax.random.key(1), (8, 24), 0, 256)
    f = jax.jit(lambda m, t: m(t)[0])
    ref = np.asarray(f(m, tok))
    mesh = make_mesh(cfg.mesh)
    shard_model(m, mesh)
    packed = m.prefix[1].ffn.w_gate.packed[...]  # (E, F, L/2): experts over `expert`, L/2 over `fsdp`
    assert packed.sharding.spec == jax.sharding.PartitionSpec("expert", None, "fsdp"), packed.sharding.spec
    with jax.set_mesh(mesh):  # expert parallelism: packed experts dequantized per device, MXFP8 inputs
        out = np.asarray(f(m, jax.device_put(tok, batch_sharding(mesh))))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err
    print("OK", err)


if __name__ == "__main__":
    main()

"""The tiny model's forward on 8 devices (``data=2, fsdp=2, tensor=2``) equals one device's, with the dense
FFN's weight stored split over ``fsdp`` x ``tensor``. Run by ``tests/test_sharding.py``."""

import jax
import numpy as np

from k3jax import create_model, load_config
from k3jax.sharding import batch_sharding, make_mesh, shard_model


def main() -> None:
    cfg = load_config("tiny", ["model.num_layers=5", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    m = create_model(cfg.model)
    tok = jax.random.randint(jax.random.key(1), (4, 24), 0, 256)
    f = jax.jit(lambda m, t: m(t)[0])
    ref = np.asarray(f(m, tok))
    mesh = make_mesh(cfg.mesh)
    shard_model(m, mesh)
    w = m.prefix[0].ffn.w_gate[...]  # dense FFN (d, F)
    assert w.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor"), w.sharding.spec
    assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (32, 96)
    with jax.set_mesh(mesh):
        out = np.asarray(f(m, jax.device_put(tok, batch_sharding(mesh))))
    err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
    assert err < 1e-5, err
    print("OK", err)


if __name__ == "__main__":
    main()

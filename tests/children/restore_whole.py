"""One process reads back a checkpoint that several processes wrote (each its shards): every leaf finite;
prints ``OK steps <latest step> <mesh.data> <mesh.fsdp>``. Run by ``tests/test_multiprocess.py``; argv: the
checkpoints directory."""

import sys

import jax
import numpy as np
from flax import nnx

from k3jax.training import checkpoint


def main(checkpoints: str) -> None:
    model, cfg = checkpoint.restore_model(checkpoints)
    leaves = jax.tree.leaves(nnx.state(model))
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves)
    print("OK steps", checkpoint.latest_step(checkpoints), cfg.mesh.data, cfg.mesh.fsdp)


if __name__ == "__main__":
    main(sys.argv[1])

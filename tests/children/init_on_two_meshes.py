"""The same seed gives the same initial train state on one device and on 8 (``data=2, expert=2,
sequence=2``), the 8-device state really laid out over the mesh. Run by ``tests/test_train_mesh.py``; argv:
the config overrides of the run."""

import sys

import jax
import numpy as np
from flax import nnx

from k3jax.config import load_config
from k3jax.sharding import make_mesh
from k3jax.training.step import init_train_state


def main(overrides: list[str]) -> None:
    one = load_config("tiny", overrides)
    eight = load_config("tiny", overrides + ["mesh.data=2", "mesh.expert=2", "mesh.sequence=2"])
    a = init_train_state(one, make_mesh(one.mesh, jax.devices()[:1]))
    b = init_train_state(eight, make_mesh(eight.mesh))
    leaves_a, leaves_b = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    assert len(leaves_a) == len(leaves_b) > 100
    assert any(not x.sharding.is_fully_replicated for x in leaves_b)  # really laid out over the mesh
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(nnx.state(a)), leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    print("OK identical", len(leaves_a))


if __name__ == "__main__":
    main(sys.argv[1:])

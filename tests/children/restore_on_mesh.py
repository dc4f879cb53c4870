"""A run's last checkpoint restored onto a 4-device ``fsdp x expert`` mesh: every leaf in its rule-derived
sharding (some split over all 4 devices), with the values of the unsharded restore. Run by
``tests/test_train_mesh.py``; argv: the checkpoints directory."""

import sys

import jax
import numpy as np
from flax import nnx

from k3jax.config import MeshConfig
from k3jax.sharding import make_mesh, state_shardings
from k3jax.training import checkpoint


def main(checkpoints: str) -> None:
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2), jax.devices()[:4])
    model, cfg = checkpoint.restore_model(checkpoints, mesh=mesh)
    ref, _ = checkpoint.restore_model(checkpoints)
    state, want = nnx.state(model), state_shardings(nnx.state(model), mesh)
    for x, s, y in zip(jax.tree.leaves(state), jax.tree.leaves(want), jax.tree.leaves(nnx.state(ref))):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
    print("OK restored", len(jax.tree.leaves(state)))


if __name__ == "__main__":
    main(sys.argv[1])

"""On 4 devices holding FSDP shards of 6 stacked ``[64, 96]`` Muon blocks, each device orthogonalises its
share of the blocks (2 of the 6 padded to 8), not every block, and the values are one device's. Run by
``tests/test_optim.py``."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers as MDN

from k3jax.aot import breakdown
from k3jax.optim import newton_schulz


def main() -> None:
    # 6 stacked [64, 96] blocks stored as FSDP shards: the matrix rows split over the 4 devices
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 64, 96)), jnp.float32)
    dn = MDN(reduction_axis=1, output_axis=2)
    fn = jax.jit(lambda x: newton_schulz.orthogonalize_blocks([x], [dn], group_max_size=1)[0])
    want = fn(x)  # one device
    one_block = 5 * 2 * (64 * 64 * 96 + 64 * 64 * 64 + 64 * 64 * 96)  # 5 steps of X X^T, G G, G X
    for axis_type in (AxisType.Auto, AxisType.Explicit):  # the framework's meshes are Auto
        mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(axis_type,))
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, NamedSharding(mesh, P(None, "fsdp", None)))
            got = fn(xs)
            compiled = fn.lower(xs).compile()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        per_device = breakdown.breakdown(compiled.as_text()).part_flops("newton_schulz")
        # the 6 blocks padded to 8 and split over the 4 devices: 2 blocks each, not all 6 on every device
        assert per_device == 2 * one_block, (axis_type, per_device / one_block)
    print("OK")


if __name__ == "__main__":
    main()

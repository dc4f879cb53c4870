"""Under a swapped rule table (experts over ``fsdp x sequence``, the batch over ``expert``, time over
``fsdp x sequence``) the expert exchange (both dispatches), the sequence-parallel short conv and chunkwise
KDA give the single-device values and gradients on 8 devices: the ``shard_map`` specs follow the table.
Run by ``tests/test_parallel_rules.py``."""

import jax
import jax.numpy as jnp
import numpy as np

from cpu_devices import rel
from k3jax.config import MeshConfig
from k3jax.ops.conv import causal_conv1d
from k3jax.ops.kda import chunk_kda
from k3jax.ops.moe import grouped_glu_experts, sigmoid_topk_route
from k3jax.ops.norms import l2_norm
from k3jax.parallel import sequence
from k3jax.parallel.expert import expert_parallel_experts
from k3jax.sharding import DEFAULT_RULES, axis_rules, make_mesh


def main() -> None:
    # experts over two axes at once (the exchange's collectives run over the pair), the batch over
    # `expert` alone, the time axis over (fsdp, sequence): the experts' tokens split over all three
    rules = tuple(dict(DEFAULT_RULES, expert=(("fsdp", "sequence"),), batch=("expert",),
                       length=(("fsdp", "sequence"),), heads=()).items())
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, sequence=2))
    rng = np.random.default_rng(0)
    normal = lambda *shape, s=1.0: jnp.asarray(rng.normal(size=shape) * s, jnp.float32)

    def grad_of(f, n):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=tuple(range(n))))

    N, L, F, E, K = 64, 16, 24, 8, 3
    route = sigmoid_topk_route(normal(N, E), None, K)
    expert_args = (normal(N, L), route.weights, normal(E, L, F, s=0.3), normal(E, L, F, s=0.3), normal(E, F, L, s=0.3))
    single = lambda z, w, *ws: jnp.einsum("nk,nkl->nl", w, grouped_glu_experts(z, route.experts, *ws,
                                                                                 activation="situ_glu"))
    B, T, H, D = 2, 32, 2, 8
    seg = np.ones((B, T), np.int32)
    seg[0, 12:], seg[1, 16:] = 2, 3  # a document starting inside a shard, one at a shard boundary
    seg = jnp.asarray(seg)
    kda_args = (l2_norm(normal(B, T, H, D)), l2_norm(normal(B, T, H, D)), normal(B, T, H, D),
                -jax.nn.softplus(3.0 * normal(B, T, H, D)), jax.nn.sigmoid(normal(B, T, H)))
    cases = [(f"experts {mode}", single,
              lambda z, w, *ws, mode=mode: expert_parallel_experts(z, route.experts, w, *ws, activation="situ_glu",
                                                                   dispatch=mode), expert_args)
             for mode in ("all_to_all", "all_gather")]
    cases += [("conv", lambda x, w: causal_conv1d(x, w, segment_ids=seg)[0],
               lambda x, w: sequence.causal_conv1d(x, w, segment_ids=seg)[0], (normal(B, T, H * D), normal(4, H * D))),
              ("kda", lambda *a: chunk_kda(*a, chunk_size=8, segment_ids=seg)[0],
               lambda *a: sequence.chunk_kda(*a, chunk_size=8, segment_ids=seg)[0], kda_args)]
    worst = 0.0
    for name, ref_fn, fn, args in cases:
        ref = grad_of(ref_fn, len(args))(*args)
        with axis_rules(rules), jax.set_mesh(mesh):
            assert sequence.time_axes(B, T) == ("fsdp", "sequence")
            got = grad_of(fn, len(args))(*args)
        err = rel(got, ref)
        assert err < 2e-5, (name, err)
        worst = max(worst, err)
    print("OK", worst)


if __name__ == "__main__":
    main()

"""Every token exchange of expert parallelism (k3jax/parallel/expert.py) that runs on CPU equals the
single-device dropless experts, forward and backward, on 8 fake CPU devices. Run by
``tests/test_expert_parallel.py``."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from cpu_devices import rel
from k3jax.ops.moe import grouped_glu_experts, sigmoid_topk_route
from k3jax.parallel.expert import dense_ragged_all_to_all, expert_parallel_experts


def main() -> None:
    # dense_ragged_all_to_all reproduces the example of jax.lax.ragged_all_to_all's docstring
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,))
    P = jax.sharding.PartitionSpec
    args = [jnp.array([1, 2, 2, 3, 4, 0]), jnp.zeros(8, jnp.int32), jnp.array([0, 1, 0, 1]),
            jnp.array([1, 2, 1, 1]), jnp.array([0, 0, 1, 2]), jnp.array([1, 1, 2, 1])]
    f = jax.shard_map(lambda *a: dense_ragged_all_to_all(*a, axis_name="expert"), mesh=mesh,
                      in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(f)(*args))
    assert got.tolist() == [1, 3, 0, 0, 2, 2, 4, 0], got

    # ... and the docstring's semantics with several slices per peer (as the exchange sends one per
    # (peer, local expert)), random sizes and offsets, against a plain loop over the slices
    ep, S, M, R = 4, 3, 16, 24
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 3, size=(ep, ep, S))  # [src, dst, slice]
    operand = rng.normal(size=(ep, M, 2)).astype(np.float32)
    in_off = np.stack([rng.permutation(M - 2)[:ep * S] for _ in range(ep)])  # [src, dst * S + slice]
    # where on dst: every dst's slices in distinct 2-row slots, so no two writes overlap
    slots = np.stack([rng.permutation(R // 2)[:ep * S] for _ in range(ep)]).reshape(ep, ep, S)  # [dst, src, j]
    out_off = 2 * slots.transpose(1, 0, 2).reshape(ep, -1)  # [src, dst * S + slice]
    want = np.zeros((ep, R, 2), np.float32)
    for src in range(ep):
        for i in range(ep * S):
            dst = i // S
            size = sizes[src, dst, i % S]
            want[dst, out_off[src, i]:out_off[src, i] + size] = operand[src, in_off[src, i]:in_off[src, i] + size]
    recv = sizes.transpose(1, 0, 2).reshape(ep, -1)  # on dst: [src * S + slice]
    mesh4 = jax.make_mesh((ep,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
    f = jax.shard_map(lambda *a: dense_ragged_all_to_all(*a, axis_name="expert"), mesh=mesh4,
                      in_specs=(P("expert"),) * 6, out_specs=P("expert"))
    args = (operand.reshape(ep * M, 2), np.zeros((ep * R, 2), np.float32), in_off.reshape(-1),
            sizes.reshape(-1), out_off.reshape(-1), recv.reshape(-1))
    with jax.set_mesh(mesh4):
        got = np.asarray(jax.jit(f)(*(jnp.asarray(a) for a in args)))
    assert np.array_equal(got.reshape(ep, R, 2), want), np.abs(got.reshape(ep, R, 2) - want).max()

    rng = np.random.default_rng(0)
    N, L, F, E, K = 64, 16, 24, 8, 3
    z = jnp.asarray(rng.normal(size=(N, L)), jnp.float32)
    route = sigmoid_topk_route(jnp.asarray(rng.normal(size=(N, E)), jnp.float32), None, K)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(E, L, F)) * 0.3, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(E, F, L)) * 0.3, jnp.float32)
    params = (z, route.weights, w_gate, w_up, w_down)

    def loss(fn, n):
        def f(z, weights, w_gate, w_up, w_down):
            u = fn(z[:n], route.experts[:n], weights[:n], w_gate, w_up, w_down)
            return jnp.sum(jnp.sin(u)), u
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))

    def single(z, experts, weights, w_gate, w_up, w_down):
        pair_out = grouped_glu_experts(z, experts, w_gate, w_up, w_down, activation="situ_glu")
        return jnp.einsum("nk,nkl->nl", weights, pair_out)

    worst = 0.0
    # 3 tokens cannot be split over the devices: replicated over `expert`, partial sums psum-ed
    # (the last: the weights' L dimension split over fsdp x sequence as stored, gathered inside the exchange)
    cases = [(N, (8,), ("expert",)), (N, (2, 2, 2), ("data", "expert", "sequence")), (3, (2, 4), ("data", "expert")),
             (N, (2, 2, 2), ("fsdp", "expert", "sequence"))]
    for n, shape, names in cases:
        (_, ref), ref_grads = loss(single, n)(*params)
        mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
        for mode in ("all_to_all", "all_gather"):
            fn = lambda *a: expert_parallel_experts(*a, activation="situ_glu", dispatch=mode)
            with jax.set_mesh(mesh):
                (_, out), grads = loss(fn, n)(*params)
            err = max(rel(out, ref), rel(grads, ref_grads))
            assert err < 1e-5, (n, names, mode, err)
            worst = max(worst, err)

    # Dropless in rounds: every pair routed to one device's experts (4 times the whole group's fair
    # share of rows: 4 rounds of DROPLESS_ROUND_FACTOR x its own) still gives the single-device result,
    # forward and backward; each round's buffer is the round's size, not the worst case
    from k3jax.parallel import expert as ep_mod
    ep = 4
    skew = jnp.asarray(np.stack([rng.permutation(2)[:2] for _ in range(N)]), jnp.int32)  # experts 0 and 1
    n_dev = N // ep
    rows = int(np.ceil(ep_mod.DROPLESS_ROUND_FACTOR * n_dev * 2))
    loads = jnp.zeros((ep, E // ep), jnp.int32).at[0].set(jnp.asarray([N, N]))
    assert int(ep_mod.dropless_rounds_needed(loads, rows)) == int(np.ceil(2 * N / rows)) > 1
    skew_weights = route.weights[:, :2]

    def skewed(fn):
        def f(z, weights, w_gate, w_up, w_down):
            u = fn(z, skew, weights, w_gate, w_up, w_down)
            return jnp.sum(jnp.sin(u)), u
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))

    skew_params = (z, skew_weights, w_gate, w_up, w_down)
    (_, want), want_grads = skewed(single)(*skew_params)
    mesh = jax.make_mesh((ep,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
    fn = lambda *a: expert_parallel_experts(*a, activation="situ_glu", dispatch="all_to_all")
    with jax.set_mesh(mesh):
        (_, got), grads = skewed(fn)(*skew_params)
        text = jax.jit(fn).lower(z, skew, skew_weights, w_gate, w_up, w_down).as_text()
    err = max(rel(got, want), rel(grads, want_grads))
    assert err < 1e-5, ("rounds", err)
    worst = max(worst, err)
    assert "while" in text

    # With a capacity factor a device computes at most c * n * k pairs. A device over it cuts its
    # busiest experts (rows handed out one round at a time, one to each expert with pairs left), each
    # keeping its first pairs in token order; both exchanges drop exactly those pairs, forward and
    # backward.
    def round_robin(loads, capacity):
        kept = [0] * len(loads)
        while capacity and any(k < l for k, l in zip(kept, loads)):
            for e, load in enumerate(loads):
                if capacity and kept[e] < load:
                    kept[e], capacity = kept[e] + 1, capacity - 1
        return kept

    ep, factor = 4, 1.0
    n, num_local = N // ep, E // ep
    capacity = int(np.ceil(factor * n * K))
    flat = np.asarray(route.experts).reshape(-1)  # pairs in token order
    keep = np.zeros(N * K, bool)
    for dst in range(ep):
        mine = [e for e in range(dst * num_local, (dst + 1) * num_local)]
        quota = dict(zip(mine, round_robin([int(np.sum(flat == e)) for e in mine], capacity)))
        for e in mine:
            keep[np.flatnonzero(flat == e)[:quota[e]]] = True
    keep = keep.reshape(N, K)
    assert 0 < keep.sum() < N * K, keep.sum()  # some pairs dropped, not all

    def masked(z, experts, weights, w_gate, w_up, w_down):
        return single(z, experts, weights * keep, w_gate, w_up, w_down)

    (_, want), want_grads = loss(masked, N)(*params)
    mesh = jax.make_mesh((ep,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:ep])
    for mode in ("all_to_all", "all_gather"):
        fn = lambda *a: expert_parallel_experts(*a, activation="situ_glu", dispatch=mode, capacity_factor=factor)
        with jax.set_mesh(mesh):
            (_, got), grads = loss(fn, N)(*params)
        err = max(rel(got, want), rel(grads, want_grads))
        assert err < 1e-5, (mode, err)
        worst = max(worst, err)
    print("OK", worst)


if __name__ == "__main__":
    main()

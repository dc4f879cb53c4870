"""Expert parallelism (k3jax/parallel/expert.py) on 8 fake CPU devices: every token exchange that runs
on CPU equals the single-device dropless experts, forward and backward; the ragged_all_to_all path
(TPU / GPU only) is compiled for a TPU topology.

The 8-device checks run in a subprocess (tests/children/expert_exchanges.py): the device count must be
set before JAX starts, and the rest of the suite runs on one device.
"""

import os

import pytest

from cpu_devices import run_child


@pytest.mark.slow
def test_expert_exchanges_match_single_device():
    print(run_child("expert_exchanges"))


@pytest.fixture(scope="module")
def v5p_expert_mesh():
    """A 4-chip v5p topology's devices as one ``expert`` axis (compiles only; no TPU needed)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    pytest.importorskip("libtpu")
    import jax
    from jax.experimental import topologies
    from jax.sharding import AxisType

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5:2x2x1", chip_config_name="megacore",
                                            chips_per_host_bounds=(2, 2, 1), num_slices=1,
                                            wrap=(False, False, False))
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    return jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Auto,), devices=topo.devices)


@pytest.mark.tpu_aot
def test_ragged_all_to_all_dispatch_compiles_for_tpu(v5p_expert_mesh):
    """The TPU / GPU exchange cannot run on XLA:CPU; compile its forward + backward for a v5p slice."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import math
    import re

    from k3jax.ops.moe import sigmoid_topk_route
    from k3jax.parallel.expert import DROPLESS_ROUND_FACTOR, expert_parallel_experts

    mesh = v5p_expert_mesh
    n, latent, width, num_experts, top_k = 256, 128, 256, 16, 4

    from k3jax.aot import breakdown

    def arg(shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("expert")))

    args = [arg((n, latent)), arg((n, num_experts)), arg((num_experts, latent, width)),
            arg((num_experts, latent, width)), arg((num_experts, width, latent))]
    flops = {}
    for impl in ("auto", "ragged_dot"):
        def loss(z, logits, w_gate, w_up, w_down):
            route = sigmoid_topk_route(logits, None, top_k)
            with jax.named_scope("routed_experts"):
                u = expert_parallel_experts(z, route.experts, route.weights, w_gate, w_up, w_down,
                                            activation="situ_glu", impl=impl)
            return jnp.sum(u * u)

        with jax.set_mesh(mesh):  # the mesh's platform is TPU, so "auto" picks ragged_all_to_all
            compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4))).lower(*args).compile()
        text = compiled.as_text()
        assert "ragged-all-to-all" in text
        # the dropless exchange's overflow rounds (forward, and their backward) are while loops whose trip
        # count depends on the loads; counted here as not run (every device's pairs within one round)
        assert breakdown.breakdown(text).data_dependent_loops == 2
        b = breakdown.breakdown(text, data_dependent_trips=0)
        flops[impl] = (b.flops[("routed_experts", "forward")], b.flops[("routed_experts", "backward")])
        # every receive buffer is a round's, 1.25x a device's fair share of pairs, not the worst case
        # (every pair of the group on one device)
        devices = mesh.size
        fair = n // devices * top_k
        shapes = set(re.findall(r"= f32\[(\d+),(?:1,)?128\][^\n]* ragged-all-to-all\(", text))
        round_rows = math.ceil(DROPLESS_ROUND_FACTOR * fair)
        assert shapes == {str(round_rows), str(fair)}, shapes  # (the worst case: n * top_k = 1024 rows)
    # auto = the Pallas grouped matmul on TPU: the backward (input and weight gradients) is twice the
    # forward, counted from the kernels' cost estimates; XLA's ragged_dot transpose runs every local
    # expert over every received row for the weight gradient
    fwd, bwd = flops["auto"]
    assert fwd > 0 and bwd == pytest.approx(2 * fwd, rel=0.01)
    # ... and they count the pairs a device's experts get at a balanced load (plus a tile of rounding
    # per expert), not the dropless receive buffer sized for every pair landing on one device
    devices, gemm = mesh.size, 2 * latent * width  # FLOPs per row of one of the three matmuls
    balanced, buffer = n // devices * top_k, n * top_k
    assert 3 * gemm * balanced <= fwd < 3 * gemm * buffer, (fwd / (3 * gemm), balanced, buffer)
    assert flops["ragged_dot"][1] > 2 * bwd


@pytest.mark.tpu_aot
def test_expert_weight_gradients_leave_as_reduce_scatters_on_tpu():
    """On fsdp x expert, the routed experts' weights enter the exchange split over fsdp as stored and are
    gathered inside, so all three gradients are reduce-scattered back to their storage shards. Gathered
    before it (the weights entering whole), w_down's ``[E_l, F, L]`` gradient was all-reduced whole and
    then sliced: with L split in shards of 112 (K2 and K3's 7168 over 64 devices) XLA:TPU made no
    reduce-scatter of it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from k3jax.aot import breakdown
    from k3jax.ops.moe import sigmoid_topk_route
    from k3jax.parallel.expert import expert_parallel_experts

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    pytest.importorskip("libtpu")
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5:2x2x2", chip_config_name="megacore",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False))
    fsdp = 4
    mesh = jax.make_mesh((fsdp, 2), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2, devices=topo.devices)
    n, latent, width, num_experts, top_k = 1024, fsdp * 112, 512, 8, 2

    def loss(z, logits, w_gate, w_up, w_down):
        route = sigmoid_topk_route(logits, None, top_k)
        ws = [w.astype(jnp.bfloat16) for w in (w_gate, w_up, w_down)]  # float32 master weights, bf16 compute
        with jax.named_scope("routed_experts"):
            u = expert_parallel_experts(z.astype(jnp.bfloat16), route.experts, route.weights, *ws, activation="swiglu")
        return jnp.sum(u * u)

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    tokens = P(("fsdp", "expert"))
    args = [arg((n, latent), tokens), arg((n, num_experts), tokens),  # the storage rules: expert_in -> fsdp
            arg((num_experts, latent, width), P("expert", "fsdp", None)),
            arg((num_experts, latent, width), P("expert", "fsdp", None)),
            arg((num_experts, width, latent), P("expert", None, "fsdp"))]
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(2, 3, 4)), out_shardings=tuple(a.sharding for a in args[2:])) \
            .lower(*args).compile().as_text()
    b = breakdown.breakdown(text, data_dependent_trips=0)
    local = (num_experts // 2) * latent * width * 2  # one local-expert gradient in bf16
    sent = local * (fsdp - 1) / fsdp
    assert b.collective_bytes["reduce-scatter"] == pytest.approx(3 * sent, rel=0.01), dict(b.collective_bytes)
    assert b.collective_bytes.get("all-reduce", 0.0) < 0.01 * sent, dict(b.collective_bytes)  # was 2 * sent


@pytest.mark.tpu_aot
def test_each_layers_expert_weight_gradients_are_computed_in_its_backward(v5p_expert_mesh):
    """Nothing upstream needs an expert weight gradient, and XLA:TPU's scheduler had deferred every
    layer's to the end of the backward, keeping each layer's receive buffers alive until then (9.9
    receive buffers of temporaries for these 4 remat'd layers, against 4.7 when each layer's are
    computed in its backward)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from k3jax.ops.moe import sigmoid_topk_route
    from k3jax.parallel.expert import expert_parallel_experts

    mesh = v5p_expert_mesh
    layers, n, latent, width, num_experts, top_k = 4, 8192, 1024, 256, 16, 4

    def loss(z, logits, w_gate, w_up, w_down):
        def layer(z, logits, w):
            route = sigmoid_topk_route(logits, None, top_k)
            u = expert_parallel_experts(z, route.experts, route.weights, *w, activation="swiglu")
            return z + u.astype(z.dtype)

        for i in range(layers):
            z = jax.checkpoint(layer)(z, logits[i], (w_gate[i], w_up[i], w_down[i]))
        return jnp.sum(z.astype(jnp.float32) ** 2)

    def arg(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    stacked = P(None, "expert")
    args = [arg((n, latent), P("expert")), arg((layers, n, num_experts), stacked, jnp.float32),
            arg((layers, num_experts, latent, width), stacked), arg((layers, num_experts, latent, width), stacked),
            arg((layers, num_experts, width, latent), stacked)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(2, 3, 4))).lower(*args).compile()
    devices = mesh.size
    # one device's dropless receive buffer: every pair of every device, at most min(k, E_l) per token
    receive_buffer = n * min(top_k, num_experts // devices) * latent * 2
    buffers = compiled.memory_analysis().temp_size_in_bytes / receive_buffer
    assert buffers < 7, buffers


def test_fill_capacity_cuts_the_busiest_experts_first():
    """``fill_capacity`` (closed form) against handing out rows one round at a time: in each round one
    to every expert, in index order, that has pairs left."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3jax.parallel.expert import fill_capacity

    def round_robin(loads, capacity):
        kept = np.zeros_like(loads)
        while capacity and np.any(kept < loads):
            for e in range(len(loads)):
                if capacity and kept[e] < loads[e]:
                    kept[e] += 1
                    capacity -= 1
        return kept

    rng = np.random.default_rng(0)
    cases = [(np.array([5, 1, 9, 0, 9]), c) for c in range(0, 26)]  # ties, an empty expert, every capacity
    cases += [(rng.integers(0, 40, size=rng.integers(1, 12)), int(rng.integers(0, 200))) for _ in range(200)]
    fill = jax.jit(fill_capacity)  # one compile per number of experts, the capacity traced
    for loads, capacity in cases:
        got = np.asarray(fill(jnp.asarray(loads, jnp.int32), capacity))
        np.testing.assert_array_equal(got, round_robin(loads, capacity), err_msg=f"{loads} {capacity}")
    # batched over leading axes, as the exchange calls it ([dst, E_l])
    loads = rng.integers(0, 30, size=(6, 7))
    got = np.asarray(fill(jnp.asarray(loads, jnp.int32), 50))
    np.testing.assert_array_equal(got, np.stack([round_robin(row, 50) for row in loads]))

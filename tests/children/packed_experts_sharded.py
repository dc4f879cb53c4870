"""A packed MXFP4-expert, MXFP8-activation tiny model sharded over 8 devices (``data, fsdp, expert``) computes what it
computes on one device, with its experts dequantized per device (``moe_impl: ragged_dot``) and handed packed to the
expert matmuls (``moe_impl: pallas``: the bytes enter the expert-parallel ``shard_map``, split as stored and gathered
inside); the expert-parallel exchanges over MXFP4 weights, forward and backward (the dropless rounds' custom VJP
with integer weights), equal them dequantized. Run by ``tests/test_quant_deploy.py``.

The Pallas interpreter cannot run the grouped matmuls here: inside a ``shard_map`` their group metadata is
device-varying, the grid indices are not, and jax 0.10.2's interpreter evaluates the index maps without reconciling
the two ("dynamic_slice requires varying manual axes to match"; the dense kernel alike). The matmuls are therefore
their plain references (``ragged_dot``; ``gmm_mxfp4_reference`` on the packed bytes) behind ``moe_impl: pallas``'s
plumbing; tests/test_pallas_mxfp4.py checks the kernel against the same references, tests/test_pallas_tpu_aot.py
and tests/test_expert_parallel.py compile it for TPU."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from cpu_devices import rel
from k3jax import create_model, load_config
from k3jax.ops.moe import sigmoid_topk_route
from k3jax.parallel.expert import expert_parallel_experts
from k3jax.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3jax.sharding import batch_sharding, make_mesh, shard_model
from pallas_kernels import moe as pallas_moe
from pallas_kernels.moe.gmm_mxfp4 import gmm_mxfp4_reference
from pallas_kernels.mxfp4 import MXFP4


def plain_matmuls() -> None:
    """The Pallas expert GLU's two matmuls replaced by their references (see the module docstring)."""
    pallas_moe.grouped_matmul = lambda lhs, w, gs, **_: jax.lax.ragged_dot(lhs, w, gs)
    pallas_moe.mxfp4_grouped_matmul = lambda lhs, w, gs, **_: gmm_mxfp4_reference(lhs, w, gs)


def model_on_the_mesh() -> None:
    base = ["model.num_layers=3", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "quant.experts=mxfp4",
            "quant.activations=mxfp8"]
    tok = jax.random.randint(jax.random.key(1), (8, 24), 0, 256)
    f = jax.jit(lambda m, t: m(t)[0])
    ref = None
    for impl in ("ragged_dot", "pallas"):
        cfg = load_config("tiny", base + [f"model.moe_impl={impl}"])
        m = create_model(cfg.model)
        if ref is None:
            ref = np.asarray(f(m, tok))
        mesh = make_mesh(cfg.mesh)
        shard_model(m, mesh)
        packed = m.prefix[1].ffn.w_gate.packed[...]  # (E, F, L/2): experts over `expert`, L/2 over `fsdp`
        assert packed.sharding.spec == jax.sharding.PartitionSpec("expert", None, "fsdp"), packed.sharding.spec
        with jax.set_mesh(mesh):  # expert parallelism, MXFP8 inputs
            tokens = jax.device_put(tok, batch_sharding(mesh))
            out = np.asarray(f(m, tokens))
            if impl == "pallas":  # the bytes enter the shard_map as stored (E_l = 4; L/2 over fsdp), no dense weight
                jaxpr = str(jax.make_jaxpr(f)(m, tokens))
                assert "u8[4,32,8]" in jaxpr and "f32[8,32,32]" not in jaxpr
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert err < 1e-5, (impl, err)
        print(impl, err)


def exchanges_over_mxfp4() -> None:
    rng = np.random.default_rng(0)
    N, L, F, E, K = 32, 64, 32, 8, 2
    z = jnp.asarray(rng.normal(size=(N, L)), jnp.float32)
    route = sigmoid_topk_route(jnp.asarray(rng.normal(size=(N, E)), jnp.float32), None, K)

    def mxfp4(n_in, n_out):  # (E, in, out) -> packed in the release orientation
        return MXFP4(*quantize_mxfp4(jnp.asarray(rng.normal(size=(E, n_out, n_in)) * 0.3, jnp.float32)))

    packed = (mxfp4(L, F), mxfp4(L, F), mxfp4(F, L))
    dense = tuple(jnp.swapaxes(dequantize_mxfp4(w.packed, w.scale), 1, 2) for w in packed)

    def loss(weights, experts):
        def f(z, route_weights):
            u = expert_parallel_experts(z, experts, route_weights, *weights, activation="situ_glu", impl="pallas",
                                        dispatch=dispatch)
            return jnp.sum(jnp.sin(u)), u
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))

    # experts 0 and 1 only (one device's): the dropless exchange runs several rounds
    skew = jnp.asarray(np.stack([rng.permutation(2) for _ in range(N)]), jnp.int32)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    for dispatch in ("all_to_all", "all_gather"):
        for experts, weights in ((route.experts, route.weights), (skew, route.weights[:, :2])):
            with jax.set_mesh(mesh):
                (_, got), grads = loss(packed, experts)(z, weights)
                (_, want), want_grads = loss(dense, experts)(z, weights)
            err = max(rel(got, want), rel(grads, want_grads))
            assert err < 1e-5, (dispatch, err)
            print(dispatch, err)


def main() -> None:
    jax.config.update("jax_disable_most_optimizations", True)
    plain_matmuls()
    model_on_the_mesh()
    exchanges_over_mxfp4()
    print("OK")


if __name__ == "__main__":
    main()

"""Compile every Pallas TPU kernel for real TPU topologies with libtpu, on a CPU-only host (no TPU needed).

This catches Mosaic lowering errors (block shapes, layouts, unsupported ops) that interpret mode never
sees. Mosaic kernels cannot be auto-partitioned, so each program is wrapped in ``jax.shard_map`` over a
one-device mesh of the topology. Shapes are the full K3 ones: KDA with
H = 96, K = V = 128, chunk 64 (bf16 q/k/v, fp32 gate/beta/state); experts 3584 -> 3072 -> 3584 with
896 experts for the raw kernels (one weight at a time: 19.7 GB in bf16) and 112 experts (an 8-way
expert-parallel shard) for the full GLU forward + backward.

Needs ``jax[tpu]==0.10.2`` (libtpu); skipped otherwise. Run with ``pytest -m tpu_aot``.
"""

import os
import time

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may load libtpu at once
pytest.importorskip("libtpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

pytestmark = pytest.mark.tpu_aot

TOPOLOGIES = {
    "v5p": dict(topology_name="v5:2x2x1", chip_config_name="megacore"),
    "v6e": dict(topology_name="v6e:2x2", chip_config_name="default"),
}
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
TPU = dict(interpret=False, backend="tpu")


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def mesh(request):
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(platform="tpu", chips_per_host_bounds=(2, 2, 1), num_slices=1,
                                            wrap=(False, False, False), **TOPOLOGIES[request.param])
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    return jax.make_mesh((1,), ("x",), devices=topo.devices[:1])


def compile_on(mesh, fn, *shapes):
    """AOT-compile fn under shard_map for the topology; returns (compiled, seconds)."""
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
    f = jax.shard_map(fn, mesh=mesh, in_specs=tuple(P() for _ in args), out_specs=P(), check_vma=False)
    t = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = jax.jit(f).lower(*args).compile()
    return compiled, time.perf_counter() - t


B, T, H, K, V = 1, 1024, 96, 128, 128
KDA_SHAPES = [((B, T, H, K), BF16), ((B, T, H, K), BF16), ((B, T, H, V), BF16), ((B, T, H, K), F32),
              ((B, T, H), F32), ((B, H, K, V), F32), ((B, T), I32)]


@pytest.mark.parametrize("safe_gate,segments", [(True, True), (False, False)], ids=["dense-segments", "exact"])
def test_kda_forward_backward_compiles(mesh, safe_gate, segments):
    from pallas_kernels.kda import chunk_kda

    def fwd_bwd(q, k, v, g, beta, h0, seg):
        def loss(q, k, v, g, beta, h0):
            o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=64,
                             segment_ids=seg if segments else None, safe_gate=safe_gate, **TPU)
            return jnp.sum(o.astype(F32)) + jnp.sum(S)

        return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, h0)

    compiled, secs = compile_on(mesh, fwd_bwd, *KDA_SHAPES)
    text = compiled.as_text()
    assert "kda_chunk_fwd" in text and "kda_chunk_bwd" in text  # the Mosaic custom calls are in the program
    print(f"kda fwd+bwd safe_gate={safe_gate} segments={segments}: {secs:.1f} s")


M, D, F, E = 8192, 3584, 3072, 896


@pytest.mark.parametrize("kernel", ["gmm", "gmm_transposed", "tgmm"])
def test_grouped_matmul_kernels_compile(mesh, kernel):
    from pallas_kernels.moe import gmm, tgmm

    if kernel == "gmm":
        fn, shapes = (lambda x, w, gs: gmm(x, w, gs, **TPU)), [((M, D), BF16), ((E, D, F), BF16), ((E,), I32)]
    elif kernel == "gmm_transposed":  # dx = dy @ w^T
        fn = lambda dy, w, gs: gmm(dy, w, gs, transpose_rhs=True, **TPU)
        shapes = [((M, F), BF16), ((E, D, F), BF16), ((E,), I32)]
    else:  # dW = x^T dy per group
        fn, shapes = (lambda x, dy, gs: tgmm(x, dy, gs, **TPU)), [((M, D), BF16), ((M, F), BF16), ((E,), I32)]
    compiled, secs = compile_on(mesh, fn, *shapes)
    print(f"{kernel}: {secs:.1f} s")
    assert "tpu_custom_call" in compiled.as_text()  # lowered to the Mosaic kernel, not an XLA fallback


def test_default_backend_follows_the_mesh(mesh):
    """Without interpret/backend arguments the kernels pick Mosaic from the TPU mesh, even on a CPU host."""
    from pallas_kernels.moe import gmm

    compiled, _ = compile_on(mesh, lambda x, w, gs: gmm(x, w, gs), ((256, 256), BF16), ((4, 256, 256), BF16),
                             ((4,), I32))
    assert "tpu_custom_call" in compiled.as_text()


def test_grouped_glu_experts_forward_backward_compiles(mesh):
    from pallas_kernels.moe import grouped_glu_experts

    N, k, E_shard = 256, 16, 112

    def fwd_bwd(x, experts, wg, wu, wd):
        loss = lambda *a: jnp.sum(grouped_glu_experts(a[0], experts, *a[1:], activation="situ_glu", **TPU)
                                  .astype(F32))
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

    compiled, secs = compile_on(mesh, fwd_bwd, ((N, D), BF16), ((N, k), I32), ((E_shard, D, F), BF16),
                                ((E_shard, D, F), BF16), ((E_shard, F, D), BF16))
    print(f"grouped_glu_experts fwd+bwd: {secs:.1f} s")
    assert compiled.as_text().count("tpu_custom_call") >= 3  # forward gmm plus the two backward products


@pytest.mark.parametrize("weight", ["gate", "down"])
def test_mxfp4_grouped_matmul_compiles(mesh, weight):
    """The MXFP4 kernel, K3's widths in both orientations (gate / up: in 3584 -> out 3072; down: back), the
    weights as stored (uint8 codes [E, out, in/2], scales [E, out, in/32]); decode-sized rows too."""
    from pallas_kernels.moe import MXFP4, gmm_mxfp4

    n_in, n_out = (D, F) if weight == "gate" else (F, D)
    fn = lambda x, p, s, gs: gmm_mxfp4(x, MXFP4(p, s), gs, interpret=False)
    for rows in (M, 8):
        compiled, secs = compile_on(mesh, fn, ((rows, n_in), BF16), ((E, n_out, n_in // 2), jnp.uint8),
                                    ((E, n_out, n_in // 32), jnp.uint8), ((E,), I32))
        print(f"gmm_mxfp4 {weight} {rows} rows: {secs:.1f} s")
        assert "gmm_mxfp4" in compiled.as_text()


def test_grouped_glu_experts_mxfp4_forward_backward_compiles(mesh):
    """The expert GLU over MXFP4 weights (an 8-way expert-parallel shard of K3), forward and the input's
    gradient (LoRA over frozen experts): three MXFP4 kernels forward, ``gmm`` on the decoded weights back."""
    from pallas_kernels.moe import MXFP4, grouped_glu_experts

    N, k, E_shard = 256, 16, 112
    U8 = jnp.uint8

    def fwd_bwd(x, experts, pg, sg, pu, su, pd, sd):
        ws = (MXFP4(pg, sg), MXFP4(pu, su), MXFP4(pd, sd))
        loss = lambda x: jnp.sum(grouped_glu_experts(x, experts, *ws, activation="situ_glu", **TPU).astype(F32))
        return jax.value_and_grad(loss)(x)

    gate = [((E_shard, F, D // 2), U8), ((E_shard, F, D // 32), U8)]
    down = [((E_shard, D, F // 2), U8), ((E_shard, D, F // 32), U8)]
    compiled, secs = compile_on(mesh, fwd_bwd, ((N, D), BF16), ((N, k), I32), *gate, *gate, *down)
    print(f"grouped_glu_experts mxfp4 fwd+bwd: {secs:.1f} s")
    text = compiled.as_text()
    assert text.count("gmm_mxfp4") >= 3 and "tpu_custom_call" in text

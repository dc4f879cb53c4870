"""The GPU (Pallas Triton) kernels, on a CPU-only host, two ways:

1. **Values** (``backend="gpu", interpret=True``; the compiled kernels when run on a GPU host): the Triton
   kernels' own code (KDA: the chunk-parallel intra kernels' 16-token sub-tile algebra of ``_tiles.py``,
   the recurrence kernels' chunk loops, the output kernel, padding to power-of-two blocks; the
   metadata-driven grouped matmul with masked loads/stores) run by the Pallas interpreter, against the
   pure-JAX references ``k3jax.ops.chunk_kda`` and ``jax.lax.ragged_dot`` /
   ``k3jax.ops.moe.grouped_glu_experts``, and the KDA kernels also against fla's naive torch reference.
2. **Lowering** (marker ``gpu_lower``): ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs the
   Pallas -> Triton lowering at K3 shapes (KDA heads K = V = 128, chunk 64; experts 3584 -> 3072, 896 of
   them), which rejects what interpret mode accepts (non-power-of-two blocks, value slicing, unsupported
   primitives); every ``__gpu$xla.gpu.triton`` custom call's Triton module is then parsed and verified with
   jaxlib's Triton dialect, and its launch (grid, warps, pipelining stages) checked. What this cannot
   catch: Triton's own compilation to PTX (register pressure, shared memory) and run-time behaviour; those
   need a GPU (see docs/kernels.md).

Tolerances (fla's metric: RMSE(out - ref) / RMS(ref) for KDA) are those of the TPU kernels
(``test_pallas_kda.py`` / ``test_pallas_moe.py`` explain them): the GPU kernels do the same fp32 algebra
(anchored 16-token tiles, fp32 state, bf16 operands with fp32 accumulation for bf16 inputs) in a different
order. Measured here (interpret mode): fp32 KDA <= 1.3e-6 (dense tiles; dg 1.3e-6, the rest <= 4e-7) and
<= 2.8e-6 (exact tiles, softplus gate) against the 1e-5 bound; bf16 KDA o 3.9e-3 (bound 8e-3), gradients
<= 4.3e-3 (bound 2e-2); grouped matmul fp32 ~1.5e-7, bf16 1.7e-3 (bound 2^-8). docs/kernels.md has the table.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_kda import BF16_GRAD_TOL, BF16_TOL, FP32_TOL, NAMES, grads, make_inputs, make_segments, rel_err, up
from test_pallas_moe import GROUPS, HI, M, max_rel, rand, rms_rel

from k3jax.ops import chunk_kda as ref_chunk_kda
from k3jax.ops.moe import grouped_glu_experts as ref_grouped_glu_experts
from pallas_kernels.kda import chunk_kda
from pallas_kernels.moe import gmm, grouped_glu_experts, grouped_matmul, tgmm
from pallas_kernels.moe.gmm_gpu import tile_metadata

# The GPU kernels: interpreted on a CPU host; the real Triton kernels when the tests run on a GPU
# (``JAX_PLATFORMS=cuda pytest tests/test_pallas_gpu.py``; conftest defaults JAX_PLATFORMS to cpu).
GPU = dict(backend="gpu", interpret=jax.default_backend() != "gpu")
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter(request):
    """On a CPU host the interpreted kernels and their references compile without XLA's optimisation
    passes (conftest's ``fast_xla``: these tests compare values; tolerances unchanged); on a GPU host the
    compiled kernels keep the default settings."""
    if GPU["interpret"]:
        request.getfixturevalue("fast_xla")
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


# ============================================================================= KDA, interpret mode


def run_both(inputs, *, chunk_size, segment_ids=None, **kw):
    q, k, v, g, beta, h0 = inputs
    o, S = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=chunk_size,
                                        segment_ids=segment_ids, **GPU, **kw))(q, k, v, g, beta, h0)
    o_ref, S_ref = jax.jit(lambda *a: ref_chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                                                    chunk_size=chunk_size, segment_ids=segment_ids))(
        up(q), up(k), up(v), g, beta, h0)
    assert o.shape == o_ref.shape and o.dtype == v.dtype and S.dtype == F32 and S.shape == h0.shape
    return rel_err(o, o_ref), rel_err(S, S_ref)


def segments_with_boundary_reset(seed, B, T, at):
    seg = make_segments(seed, B, T)
    return seg.at[:, at].set(seg[:, at - 1] + 1)  # a reset exactly at a chunk boundary too


@pytest.mark.parametrize(
    "B,T,H,K,V,chunk,gate,safe,block_v,segments",
    [
        # K 20 -> 32 and V 24 -> 32 padded, 2 V blocks of 16, T % C != 0, resets incl. one at a chunk boundary
        (2, 70, 2, 20, 24, 32, "lower_bound", True, 16, True),
        # exact per-pair diagonal tiles (softplus gate, g down to ~-60) with K in 2 pieces of 32
        (1, 40, 1, 64, 16, 32, "softplus", False, 64, False),
        (1, 1, 2, 16, 16, 64, "lower_bound", True, 64, False),  # T = 1: one sub-tile, chunk 16
    ],
    ids=["padded-vblocks-segments", "exact-kpieces", "T1"],
)
def test_kda_forward_fp32(B, T, H, K, V, chunk, gate, safe, block_v, segments):
    inputs = make_inputs(0, B, T, H, K, V, gate=gate)
    seg = segments_with_boundary_reset(0, B, T, 32) if segments else None
    err_o, err_S = run_both(inputs, chunk_size=chunk, segment_ids=seg, safe_gate=safe,
                            gpu_options=dict(block_v=block_v))
    assert err_o < FP32_TOL and err_S < FP32_TOL, (err_o, err_S)


def test_kda_forward_bf16_k3_head():
    """K3 head dims (K = V = 128: 2 V blocks of 64), chunk 64 (4 sub-tiles), bf16 q/k/v, resets."""
    inputs = make_inputs(3, 1, 70, 1, 128, 128, dtype=BF16)
    err_o, err_S = run_both(inputs, chunk_size=64, segment_ids=make_segments(3, 1, 70), safe_gate=True)
    assert err_o < BF16_TOL and err_S < BF16_TOL, (err_o, err_S)


def test_kda_no_future_token_leakage():
    """Changing tokens after t0 leaves o[:t0+1] bit-identical (anchors come from the causal past only)."""
    B, T, H, K, V, t0 = 1, 64, 1, 16, 16, 20
    q, k, v, g, beta, h0 = make_inputs(4, B, T, H, K, V)
    q2, k2, v2, g2, beta2, _ = make_inputs(5, B, T, H, K, V)
    later = (jnp.arange(T) > t0)[None, :, None, None]
    mix = lambda a, b: jnp.where(later if a.ndim == 4 else later[..., 0], b, a)
    f = jax.jit(lambda *a: chunk_kda(*a, initial_state=h0, chunk_size=64, safe_gate=True, **GPU)[0])
    o1 = f(q, k, v, g, beta)
    o2 = f(mix(q, q2), mix(k, k2), mix(v, v2), mix(g, 1.5 * g2), mix(beta, beta2))
    np.testing.assert_array_equal(np.asarray(o1[:, :t0 + 1]), np.asarray(o2[:, :t0 + 1]))
    assert not np.array_equal(np.asarray(o1[:, t0 + 1:]), np.asarray(o2[:, t0 + 1:]))


@pytest.mark.slow
def test_kda_gate_choice_at_run_time():
    """safe_gate=None picks dense tiles for the K3 gate and exact tiles for a strong softplus gate."""
    kw = dict(output_final_state=True, chunk_size=32)
    f = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], safe_gate=None, **GPU, **kw))
    f_ref = jax.jit(lambda *a: ref_chunk_kda(*a[:5], initial_state=a[5], **kw))
    for gate in ("lower_bound", "softplus"):  # same shapes: one compile each
        inputs = make_inputs(2, 1, 40, 1, 16, 16, gate=gate)
        (o, S), (o_ref, S_ref) = f(*inputs), f_ref(*inputs)
        assert np.all(np.isfinite(np.asarray(o)))
        assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


def check_grads(inputs, segment_ids, chunk_size, tol, **kw):
    got = grads(chunk_kda, inputs, segment_ids, chunk_size, **GPU, **kw)
    q, k, v, g, beta, h0 = inputs
    want = grads(ref_chunk_kda, (up(q), up(k), up(v), g, beta, h0), segment_ids, chunk_size)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, want)}
    for n, x, a in zip(NAMES, inputs, got):
        assert a.shape == x.shape and a.dtype == x.dtype, n
    assert all(e < tol for e in errs.values()), errs


def test_kda_grads_fp32_padded_vblocks_segments():
    """All six gradients through the Triton backward kernel: padded K / V, V-block shares summed,
    T % chunk != 0, resets (one at a chunk boundary), initial state."""
    B, T, H, K, V = 1, 70, 2, 20, 24
    check_grads(make_inputs(8, B, T, H, K, V), segments_with_boundary_reset(8, B, T, 32), 32, FP32_TOL,
                safe_gate=True, gpu_options=dict(block_v=16))


@pytest.mark.slow
def test_kda_grads_fp32_exact_kpieces():
    check_grads(make_inputs(9, 1, 40, 1, 64, 16, gate="softplus"), None, 32, FP32_TOL, safe_gate=False)


@pytest.mark.slow
def test_kda_grads_bf16_k3_head():
    check_grads(make_inputs(10, 1, 70, 1, 128, 128, dtype=BF16), make_segments(10, 1, 70), 64, BF16_GRAD_TOL,
                safe_gate=True)


@pytest.mark.slow
def test_kda_grads_t1_and_xla_backward_option():
    check_grads(make_inputs(12, 1, 1, 2, 16, 16), None, 64, FP32_TOL, safe_gate=True)
    check_grads(make_inputs(13, 1, 40, 2, 16, 16), make_segments(13, 1, 40), 32, FP32_TOL, safe_gate=True,
                backward="xla")


def test_kda_gpu_option_validation():
    q, k, v, g, beta, _ = make_inputs(7, 1, 20, 1, 16, 16)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        chunk_kda(q, k, v, g, beta, gpu_options=dict(block_v=24), **GPU)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):  # whole-chunk [C, *] blocks
        chunk_kda(q, k, v, g, beta, chunk_size=48, **GPU)


# ----------------------------------------------------------------------------- KDA against fla's naive reference


def fla_naive_by_document(torch, naive, inputs, segment_ids):
    """fla's ``naive_recurrent_kda`` (torch, fp32, differentiable) over packed rows: each document of a row
    runs alone, the first from the initial state, the others from zeros (fla's naive op has no resets);
    returns torch ``(o [B, T, H, V], final state [B, H, K, V])`` of the leaf tensors ``inputs``."""
    q, k, v, g, beta, h0 = inputs
    B, T = q.shape[:2]
    seg = np.zeros((B, T), np.int32) if segment_ids is None else np.asarray(segment_ids)
    outs, finals = [], []
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if seg[b, t] != seg[b, t - 1]] + [T]
        pieces, S = [], None
        for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            part = lambda x: x[b:b + 1, lo:hi]
            o, S = naive.naive_recurrent_kda(*map(part, (q, k, v, g, beta)), output_final_state=True,
                                             initial_state=h0[b:b + 1] if i == 0 else None)
            pieces.append(o)
        outs.append(torch.cat(pieces, dim=1))
        finals.append(S)
    return torch.cat(outs, dim=0), torch.cat(finals, dim=0)


@pytest.fixture(scope="module")
def fla_naive():
    from test_kda import load_fla_naive

    return load_fla_naive()


@pytest.mark.parametrize("dtype,segments", [(F32, False), (F32, True),
                                            pytest.param(BF16, False, marks=pytest.mark.slow),
                                            pytest.param(BF16, True, marks=pytest.mark.slow)],
                         ids=["fp32-dense", "fp32-resets", "bf16-dense", "bf16-resets"])
def test_kda_matches_fla_naive(fla_naive, dtype, segments):
    """Output, final state and all six gradients against fla's own reference through torch autograd: 2 rows,
    T 40 (two chunks of 32, the second partial), 2 heads, resets (one at the chunk boundary) and an initial
    state. bf16 inputs: fla's fp32 reference on the same bf16 values, the bf16 tolerances."""
    torch, naive = fla_naive
    B, T, H, K, V = 2, 40, 2, 16, 16
    inputs = make_inputs(20, B, T, H, K, V, dtype=dtype)
    seg = segments_with_boundary_reset(20, B, T, 32) if segments else None
    kk = jax.random.split(jax.random.PRNGKey(21))
    do, dS = jax.random.normal(kk[0], (B, T, H, V)), jax.random.normal(kk[1], (B, H, K, V))

    def loss(*a):
        o, S = chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=32, segment_ids=seg,
                         safe_gate=True, **GPU)
        return jnp.sum(o.astype(F32) * do) + jnp.sum(S * dS), (o, S)

    got, (o, S) = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))(*inputs)
    leaves = [torch.tensor(np.asarray(x, np.float32), requires_grad=True) for x in inputs]
    o_f, S_f = fla_naive_by_document(torch, naive, leaves, seg)
    ((o_f * torch.from_numpy(np.array(do))).sum() + (S_f * torch.from_numpy(np.array(dS))).sum()).backward()
    tol, grad_tol = (FP32_TOL, FP32_TOL) if dtype == F32 else (BF16_TOL, BF16_GRAD_TOL)
    assert o.dtype == dtype and rel_err(o, o_f.detach().numpy()) < tol
    assert rel_err(S, S_f.detach().numpy()) < tol
    errs = {n: rel_err(a, t.grad.numpy()) for n, a, t in zip(NAMES, got, leaves)}
    assert all(e < grad_tol for e in errs.values()), errs


# ============================================================================= grouped matmul, interpret mode

TILING = (16, 32, 64)  # small tiles: groups span several row tiles, 3 contraction and 2 column blocks
D_, F_ = 96, 80  # not multiples of the tiles: zero padding of D and F


def test_tile_metadata_covers_each_group_once():
    gs = jnp.array(GROUPS, jnp.int32)
    gids, starts, offsets, total = tile_metadata(gs, M, 16)
    n = int(total[0])
    assert gids.shape[0] >= n
    covered = np.zeros(M, int)
    for g, s in zip(np.asarray(gids)[:n], np.asarray(starts)[:n]):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        assert lo <= s < hi  # a tile starts inside its (non-empty) group
        covered[s:min(s + 16, hi)] += 1
    assert list(covered) == [1] * sum(GROUPS) + [0] * (M - sum(GROUPS))  # every grouped row exactly once


def test_gmm_fp32_forward_and_transposed():
    x, w = rand(0, (M, D_)), rand(1, (len(GROUPS), D_, F_))
    gs = jnp.array(GROUPS, jnp.int32)
    y = gmm(x, w, gs, tiling=TILING, **GPU)
    assert y.shape == (M, F_) and max_rel(y, jax.lax.ragged_dot(x, w, gs, precision=HI)) < 1e-5
    assert np.all(np.asarray(y[sum(GROUPS):]) == 0)  # rows past the groups are zero
    dy = rand(2, (M, F_))
    dx = gmm(dy, w, gs, transpose_rhs=True, tiling=TILING, **GPU)
    assert max_rel(dx, jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs, precision=HI)) < 1e-5


def test_tgmm_fp32_with_empty_groups():
    x, dy = rand(3, (M, D_)), rand(4, (M, F_))
    gs = jnp.array(GROUPS, jnp.int32)
    dw = tgmm(x, dy, gs, tiling=TILING, **GPU)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs, precision=HI), jnp.zeros((len(GROUPS), D_, F_)))
    assert dw.shape == (len(GROUPS), D_, F_) and max_rel(dw, vjp(dy)[0]) < 1e-5
    for g, size in enumerate(GROUPS):
        if size == 0:
            assert np.all(np.asarray(dw[g]) == 0)


def test_grouped_matmul_grads_fp32():
    x, w, c = rand(5, (M, 24)), rand(6, (len(GROUPS), 24, 40)), rand(7, (M, 40))
    gs = jnp.array(GROUPS, jnp.int32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * c)
    got = jax.grad(loss(lambda x, w: grouped_matmul(x, w, gs, tiling=TILING, **GPU)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=HI)), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        assert a.shape == b.shape and max_rel(a, b) < 1e-5


def test_gpu_all_groups_empty():
    x, w = rand(8, (16, 24)), rand(9, (3, 24, 32))
    gs = jnp.zeros((3,), jnp.int32)
    assert np.all(np.asarray(gmm(x, w, gs, **GPU)) == 0)
    assert np.all(np.asarray(tgmm(x, rand(10, (16, 32)), gs, **GPU)) == 0)


def test_gmm_bf16():
    x, w = rand(11, (M, D_), BF16), rand(12, (len(GROUPS), D_, F_), BF16)
    gs = jnp.array(GROUPS, jnp.int32)
    y = gmm(x, w, gs, tiling=TILING, **GPU)
    y32 = jax.lax.ragged_dot(x.astype(F32), w.astype(F32), gs, precision=HI)
    assert y.dtype == BF16 and rms_rel(y, y32) < 2.0**-8
    dw = tgmm(x, y, gs, tiling=TILING, **GPU)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(F32), w, gs, precision=HI), w.astype(F32))
    assert dw.dtype == BF16 and rms_rel(dw, vjp(y.astype(F32))[0]) < 2.0**-8


@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=pytest.mark.slow)])
def test_grouped_glu_experts_matches_reference(dtype):
    """The MoE drop-in on the GPU kernels: forward and gradients of x and the 3 weights, 2 empty experts."""
    N, k, E, D, F = 12, 3, 6, 32, 48
    x = rand(13, (N, D), dtype)
    experts = jax.random.randint(jax.random.PRNGKey(14), (N, k), 0, E - 2)
    wg, wu = rand(15, (E, D, F), dtype, 0.3), rand(16, (E, D, F), dtype, 0.3)
    wd = rand(17, (E, F, D), dtype, 0.3)
    c = rand(18, (N, k, D))

    def loss(f, **kw):
        return lambda *a: jnp.sum(f(a[0], experts, *a[1:], activation="situ_glu", **kw).astype(F32) * c)

    args = (x, wg, wu, wd)
    with jax.default_matmul_precision("highest"):
        out = grouped_glu_experts(x, experts, wg, wu, wd, activation="situ_glu", **GPU)
        g = jax.grad(loss(grouped_glu_experts, **GPU), argnums=(0, 1, 2, 3))(*args)
        ref_out = ref_grouped_glu_experts(*map(up, (x,)), experts, *map(up, (wg, wu, wd)), activation="situ_glu")
        g_ref = jax.grad(loss(ref_grouped_glu_experts), argnums=(0, 1, 2, 3))(*map(up, args))
    tol, err = (1e-5, max_rel) if dtype == F32 else (3 * 2.0**-8, rms_rel)
    assert out.shape == (N, k, D) and out.dtype == dtype and err(out, ref_out) < tol
    for a, b, p in zip(g, g_ref, args):
        assert a.dtype == p.dtype and a.shape == p.shape and err(a, b) < tol
    assert np.all(np.asarray(g[1][E - 2:]) == 0)  # unused experts get zero gradient


# ============================================================================= Triton lowering (no GPU needed)


def triton_calls(fn, *shapes, mesh=None):
    """Lower ``jax.jit(fn)`` for CUDA from abstract shapes; return ``[(name, Triton module text, launch)]`` for
    every Pallas Triton custom call, each module parsed and verified with jaxlib's Triton dialect; launch =
    ``{"grid": (x, y, z), "num_warps": .., "num_stages": ..}``."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    specs = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    if mesh is None:
        traced = jax.jit(fn).trace(*specs)
    else:
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(fn).trace(*specs)
    module = traced.lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if (o.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(o.attributes["call_target_name"]).value == TRITON):
                        cfg = ir.DictAttr(o.attributes["mhlo.backend_config"])
                        num = lambda key: ir.IntegerAttr(cfg[key]).value
                        launch = {"grid": tuple(num(f"grid_{d}") for d in "xyz"), "num_warps": num("num_warps"),
                                  "num_stages": num("num_stages")}
                        found.append((ir.StringAttr(cfg["name"]).value, ir.StringAttr(cfg["ir"]).value_bytes, launch))
                    walk(o.operation)

    walk(module.operation)
    out = []
    for name, bytecode, launch in found:
        with ir.Context() as ctx:
            tt_dialect.register_dialect(ctx)
            tt_module = ir.Module.parse(bytecode)
            assert tt_module.operation.verify(), name
            out.append((name, str(tt_module), launch))
    return out


def triton_kernels(fn, *shapes, mesh=None):
    """``{name: Triton module text}`` of ``triton_calls``."""
    return {name: text for name, text, _ in triton_calls(fn, *shapes, mesh=mesh)}


def test_export_api_yields_triton_custom_calls():
    """The same lowering through ``jax.export`` (the route documented for deployment)."""
    f = lambda x, w, gs: gmm(x, w, gs, backend="gpu", interpret=False)
    exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
        jax.ShapeDtypeStruct((256, 256), BF16), jax.ShapeDtypeStruct((4, 256, 256), BF16),
        jax.ShapeDtypeStruct((4,), I32))
    assert TRITON in exp.mlir_module()


B, T, H, K, V = 1, 1024, 96, 128, 128  # one K3 KDA layer's heads, 1024 tokens
KDA_SHAPES = [((B, T, H, K), BF16), ((B, T, H, K), BF16), ((B, T, H, V), BF16), ((B, T, H, K), F32),
              ((B, T, H), F32), ((B, H, K, V), F32), ((B, T), I32)]


def kda_fwd_bwd(safe_gate, segments, **kw):
    def fwd_bwd(q, k, v, g, beta, h0, seg):
        def loss(q, k, v, g, beta, h0):
            o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=64,
                             segment_ids=seg if segments else None, safe_gate=safe_gate, **kw)
            return jnp.sum(o.astype(F32)) + jnp.sum(S)

        return jax.grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, h0)

    return fwd_bwd


KDA_FORWARD = ["kda_intra_fwd_gpu", "kda_state_fwd_gpu", "kda_output_gpu"]
KDA_BACKWARD = ["kda_intra_fwd_gpu", "kda_state_fwd_gpu", "kda_state_bwd_gpu", "kda_intra_bwd_gpu"]  # recompute first
KDA_SEQUENTIAL = {"kda_state_fwd_gpu", "kda_state_bwd_gpu"}


def check_kda_launches(calls, B, T, H, V, chunk, block_v, loop_stages):
    """Forward + backward: the five kernels in order; only the recurrence kernels loop over chunks, on a
    (B, H, V/BV) grid; the chunk-parallel kernels run one program per (batch, head, chunk)."""
    assert [name for name, _, _ in calls] == KDA_FORWARD + KDA_BACKWARD
    N, NV = T // chunk, V // block_v
    for name, text, launch in calls:
        assert "tt.dot" in text, name  # tensor-core products
        grid = math.prod(launch["grid"])
        if name in KDA_SEQUENTIAL:
            assert "scf.for" in text and grid == B * H * NV and launch["num_stages"] == loop_stages, (name, launch)
        else:
            assert "scf.for" not in text, name  # no loop: a chunk per program
            assert grid == B * H * N * (NV if name == "kda_output_gpu" else 1), (name, launch)


@pytest.mark.gpu_lower
@pytest.mark.parametrize("safe_gate,segments", [(True, True), (False, False)], ids=["dense-segments", "exact"])
def test_kda_lowers_to_triton(safe_gate, segments):
    """K3's layer: 96 heads, K = V = 128, bf16, chunk 64: V blocks of 64, pipelined recurrence loops."""
    calls = triton_calls(kda_fwd_bwd(safe_gate, segments, backend="gpu", interpret=False), *KDA_SHAPES)
    check_kda_launches(calls, B, T, H, V, 64, block_v=64, loop_stages=2)


@pytest.mark.gpu_lower
def test_kda_fp32_lowers_to_triton():
    """fp32 takes its own tiles (V blocks of 32, unpipelined recurrence loops: docs/kernels.md's shared
    memory arithmetic) and keeps fp32 operands (no TF32)."""
    shapes = [((1, T, 2, K), F32)] * 2 + [((1, T, 2, V), F32), ((1, T, 2, K), F32), ((1, T, 2), F32),
                                          ((1, 2, K, V), F32), ((1, T), I32)]
    calls = triton_calls(kda_fwd_bwd(True, True, backend="gpu", interpret=False), *shapes)
    check_kda_launches(calls, 1, T, 2, V, 64, block_v=32, loop_stages=1)
    for _, text, _ in calls:  # fp32 operands are not rounded to TF32 (IEEE is the default, not printed)
        assert "inputPrecision = tf32" not in text


MOE_M, MOE_D, MOE_F, MOE_E = 8192, 3584, 3072, 896


@pytest.mark.gpu_lower
@pytest.mark.parametrize("kernel", ["gmm", "gmm_transposed", "tgmm"])
def test_grouped_matmul_kernels_lower_to_triton(kernel):
    G = dict(backend="gpu", interpret=False)
    if kernel == "gmm":
        fn = lambda x, w, gs: gmm(x, w, gs, **G)
        shapes = [((MOE_M, MOE_D), BF16), ((MOE_E, MOE_D, MOE_F), BF16), ((MOE_E,), I32)]
    elif kernel == "gmm_transposed":  # dx = dy @ w^T
        fn = lambda dy, w, gs: gmm(dy, w, gs, transpose_rhs=True, **G)
        shapes = [((MOE_M, MOE_F), BF16), ((MOE_E, MOE_D, MOE_F), BF16), ((MOE_E,), I32)]
    else:  # dW = x^T dy per group
        fn = lambda x, dy, gs: tgmm(x, dy, gs, **G)
        shapes = [((MOE_M, MOE_D), BF16), ((MOE_M, MOE_F), BF16), ((MOE_E,), I32)]
    kernels = triton_kernels(fn, *shapes)
    name = "tgmm_gpu" if kernel == "tgmm" else "gmm_gpu"
    assert list(kernels) == [name]
    assert "i64" in kernels[name] or kernel == "tgmm"  # the 19.7 GB weight needs 64-bit offsets


@pytest.mark.gpu_lower
def test_grouped_glu_experts_forward_backward_lowers_to_triton():
    N, k, E_shard = 256, 16, 112  # an 8-way expert-parallel shard of K3's 896 experts

    def fwd_bwd(x, experts, wg, wu, wd):
        loss = lambda *a: jnp.sum(grouped_glu_experts(a[0], experts, *a[1:], activation="situ_glu", backend="gpu",
                                                      interpret=False).astype(F32))
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, wg, wu, wd)

    kernels = triton_kernels(fwd_bwd, ((N, MOE_D), BF16), ((N, k), I32), ((E_shard, MOE_D, MOE_F), BF16),
                             ((E_shard, MOE_D, MOE_F), BF16), ((E_shard, MOE_F, MOE_D), BF16))
    assert set(kernels) == {"gmm_gpu", "tgmm_gpu"}


@pytest.mark.gpu_lower
def test_kda_lowers_inside_shard_map():
    """Per shard inside ``jax.shard_map`` (the sequence- and data-parallel paths run it so): the kernels'
    outputs carry the operands' manual mesh axes, forward and backward."""
    from jax.sharding import AbstractDevice, AbstractMesh
    from jax.sharding import PartitionSpec as P

    mesh = AbstractMesh((2,), ("x",), abstract_device=AbstractDevice("H100", None, "cuda"))
    f = lambda *a: chunk_kda(*a, chunk_size=64, backend="gpu", interpret=False, safe_gate=True)[0]
    loss = lambda *a: jnp.sum(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x"))(*a).astype(F32))
    shapes = [((2, 256, 2, 128), BF16)] * 3 + [((2, 256, 2, 128), F32), ((2, 256, 2), F32)]
    calls = triton_calls(lambda *a: jax.grad(loss, argnums=tuple(range(5)))(*a), *shapes, mesh=mesh)
    check_kda_launches(calls, 1, 256, 2, 128, 64, block_v=64, loop_stages=2)  # one batch row per shard


@pytest.mark.gpu_lower
def test_kda_impl_auto_keeps_xla_on_gpu_until_measured():
    """``model.kda_impl: auto`` is the XLA op on every platform until the chunk-parallel Triton kernels are
    timed on a GPU (docs/kernels.md): traced for a GPU it lowers no Triton kernel. ``moe_impl: auto`` keeps
    ragged_dot on GPU until the grouped matmuls' values are checked there."""
    from jax.sharding import AbstractDevice, AbstractMesh

    from k3jax import kernels

    assert [kernels.resolve_kda_impl("auto", p) for p in ("cpu", "tpu", "gpu", "cuda")] == ["xla"] * 4
    assert kernels.resolve_kda_impl("pallas", "cuda") == "pallas"
    assert kernels.resolve_moe_impl("auto", "cuda") == "ragged_dot"
    assert kernels.resolve_moe_impl("auto", "tpu") == "pallas"
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("H100", None, "cuda"))
    small = [((1, 64, 1, 16), BF16)] * 3 + [((1, 64, 1, 16), F32), ((1, 64, 1), F32)]
    auto = lambda *a: kernels.chunk_kda("auto")(*a, chunk_size=64)[0]
    assert triton_kernels(auto, *small, mesh=mesh) == {}
    pallas = lambda *a: kernels.chunk_kda("pallas")(*a, chunk_size=64)[0]
    assert set(triton_kernels(pallas, *small, mesh=mesh)) == set(KDA_FORWARD)


@pytest.mark.gpu_lower
def test_default_backend_follows_a_gpu_mesh():
    """Without backend/interpret arguments the kernels pick Triton from a GPU mesh, even on a CPU host (at
    trace time the export platform is unknown; the abstract mesh carries it, as a TPU topology mesh does
    for the Mosaic kernels)."""
    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("H200", None, "cuda"))
    kernels = triton_kernels(lambda x, w, gs: gmm(x, w, gs), ((256, 256), BF16), ((4, 256, 256), BF16), ((4,), I32),
                             mesh=mesh)
    assert list(kernels) == ["gmm_gpu"]
    small = [((1, 64, 1, 16), BF16)] * 3 + [((1, 64, 1, 16), F32), ((1, 64, 1), F32), ((1, 1, 16, 16), F32),
                                            ((1, 64), I32)]
    kernels = triton_kernels(kda_fwd_bwd(True, False), *small, mesh=mesh)
    assert set(kernels) == set(KDA_FORWARD + KDA_BACKWARD)

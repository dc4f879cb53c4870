"""KDA ops: chunk_kda == recurrent_kda == an independent float64 numpy loop == fla's naive references.

Errors are measured as fla does (``fla/utils/testing.py``): RMSE(out - ref) / RMS(ref).
"""

import importlib.util
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from k3jax.ops import chunk_kda, kda_chunk, kda_gate_lower_bound, kda_gate_softplus, kda_step, recurrent_kda

# compiled without XLA's optimisation passes (values are compared, not programs), float32 matmuls at full
# precision on every backend
pytestmark = pytest.mark.usefixtures("fast_xla")

FP32_TOL = 1e-5  # fp32 vs float64: measured ~1e-7, fla's own fp32 naive-chunk test uses 5e-3

_chunk = jax.jit(chunk_kda, static_argnames=("output_final_state", "chunk_size", "scale"))
_recurrent = jax.jit(recurrent_kda, static_argnames=("output_final_state", "scale"))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)) / (np.sqrt(np.mean(ref**2)) + 1e-8))


# ----------------------------------------------------------------------------- references


def numpy_kda(q, k, v, g, beta, scale=None, h0=None, segment_ids=None):
    """float64 token loop written from the KDA recurrence; shares no code with k3jax."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = np.zeros((B, H, K, V)) if h0 is None else np.array(h0, np.float64)
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = 0.0
            for h in range(H):
                St = np.exp(g[b, t, h])[:, None] * S[b, h]
                err = v[b, t, h] - St.T @ k[b, t, h]
                St = St + beta[b, t, h] * np.outer(k[b, t, h], err)
                o[b, t, h] = St.T @ (scale * q[b, t, h])
                S[b, h] = St
    return o, S


def load_fla_naive():
    torch = pytest.importorskip("torch")
    pytest.importorskip("einops")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.exists():
        pytest.skip(f"{path} missing")
    # load the file alone: the fla package __init__ imports triton
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return torch, mod


@pytest.fixture(scope="module")
def fla():
    return load_fla_naive()


def fla_run(fla, fn, q, k, v, g, beta, h0=None, **kw):
    torch, _ = fla
    t = [torch.tensor(np.asarray(x, np.float32)) for x in (q, k, v, g, beta)]
    h0 = None if h0 is None else torch.tensor(np.asarray(h0, np.float32))
    o, S = fn(*t, initial_state=h0, output_final_state=True, **kw)
    return o.numpy(), S.numpy()


# ----------------------------------------------------------------------------- inputs


def make_inputs(seed, B, T, H, K, V, gate, h0=False):
    """fp32 numpy inputs as the layer feeds them: l2-normalised q/k, beta in (0, 1), activated g."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    z = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    if gate == "lb":  # K3: lower-bounded sigmoid gate, g in (-5, 0)
        g = kda_gate_lower_bound(z, jnp.asarray(rng.standard_normal(H) * 0.5, jnp.float32),
                                 jnp.asarray(rng.standard_normal((H, K)), jnp.float32))
    elif gate == "sp":  # Kimi Linear softplus gate, A_log up to log 16, large z: g down to -100 .. -200
        g = kda_gate_softplus(3 * z + 1, jnp.asarray(np.log(np.linspace(1, 16, H)), jnp.float32),
                              jnp.asarray(rng.standard_normal((H, K)), jnp.float32))
    else:  # "mild": slow decay, so that the initial state and earlier segments stay visible
        g = jnp.asarray(-rng.uniform(0, 0.05, (B, T, H, K)), jnp.float32)
    g = np.asarray(g)
    assert (g <= 0).all()
    h = rng.standard_normal((B, H, K, V)) if h0 else None
    f32 = lambda x: None if x is None else np.array(x, np.float32)  # writable copies
    return f32(q), f32(k), f32(v), f32(g), f32(beta), f32(h)


# ----------------------------------------------------------------------------- forward


slow = pytest.mark.slow
CASES = [  # T, chunk, gate, h0, (B, H, K, V); the slow ones only add more combinations
    (1, 64, "lb", True, (2, 2, 16, 24)),
    (64, 64, "lb", True, (2, 2, 16, 24)),
    (65, 64, "sp", True, (2, 2, 16, 24)),
    (200, 16, "mild", True, (2, 2, 16, 24)),
    (63, 16, "sp", False, (1, 3, 7, 5)),
    pytest.param(63, 64, "sp", True, (2, 2, 16, 24), marks=slow),
    pytest.param(200, 64, "mild", True, (2, 2, 16, 24), marks=slow),
    pytest.param(64, 16, "sp", True, (2, 2, 16, 24), marks=slow),
    pytest.param(65, 16, "lb", False, (2, 2, 16, 24), marks=slow),
    pytest.param(64, 64, "mild", True, (1, 1, 32, 32), marks=slow),
]


@pytest.mark.parametrize("T,C,gate,h0,dims", CASES)
def test_chunk_recurrent_numpy_fla_agree(fla, T, C, gate, h0, dims):
    B, H, K, V = dims
    q, k, v, g, beta, h = make_inputs(T * 7 + C, B, T, H, K, V, gate, h0)
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, h0=h)
    o_c, S_c = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True, chunk_size=C)
    o_r, S_r = _recurrent(q, k, v, g, beta, initial_state=h, output_final_state=True)
    o_f, S_f = fla_run(fla, fla[1].naive_recurrent_kda, q, k, v, g, beta, h)
    assert o_c.shape == (B, T, H, V) and o_c.dtype == jnp.float32 and S_c.dtype == jnp.float32
    for name, (o, S) in {"chunk": (o_c, S_c), "recurrent": (o_r, S_r), "fla": (o_f, S_f)}.items():
        assert rel_err(o, o_ref) < FP32_TOL, name
        assert rel_err(S, S_ref) < FP32_TOL, name
    assert rel_err(o_c, o_f) < FP32_TOL and rel_err(S_c, S_f) < FP32_TOL
    if T % C == 0:
        # fla's naive chunk takes exp of differences of a plain fp32 cumsum: measured up to 3e-5 off
        # the float64 loop with softplus gates (ours stays ~1e-7), hence the looser bound
        o_fc, S_fc = fla_run(fla, fla[1].naive_chunk_kda, q, k, v, g, beta, h, chunk_size=C)
        assert rel_err(o_c, o_fc) < 1e-4 and rel_err(S_c, S_fc) < 1e-4


def test_large_decays_keep_fp32_precision():
    """Softplus-size decays early in a chunk push its cumsum to ~-3000; later pairs with small decays
    need exp(G_i - G_j) from two such values. A plain fp32 cumsum gets those exponents wrong by
    ulp(3000) ~ 2e-4 (relative error ~1e-4); the chunk must stay at fp32-recurrence precision."""
    q, k, v, g, beta, h = make_inputs(12, 2, 64, 2, 16, 24, "mild", h0=True)
    g[:, :32, :, ::2] = -95.0
    o, S = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True)
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, h0=h)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


def test_output_final_state_flag_and_scale():
    q, k, v, g, beta, h = make_inputs(0, 2, 1, 2, 16, 24, "lb", h0=True)
    o, S = _chunk(q, k, v, g, beta, initial_state=h)
    assert S is None
    o2, S2 = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True)
    np.testing.assert_allclose(o, o2, rtol=1e-6, atol=1e-7)  # separately compiled programs
    assert _recurrent(q, k, v, g, beta, initial_state=h)[1] is None
    # an explicit scale multiplies q only
    o_s, S_s = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True, scale=0.5)
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, scale=0.5, h0=h)
    assert rel_err(o_s, o_ref) < FP32_TOL and rel_err(S_s, S_ref) < FP32_TOL
    assert rel_err(o_s, o2) > 0.1


def test_state_carry_two_halves_equals_whole():
    """Prefill in two calls (state carried) == one call; the cut (32) is inside a 64-token chunk."""
    q, k, v, g, beta, h = make_inputs(1, 2, 64, 2, 16, 24, "mild", h0=True)
    o, S = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True)
    o1, S1 = _chunk(*(x[:, :32] for x in (q, k, v, g, beta)), initial_state=h, output_final_state=True)
    o2, S2 = _chunk(*(x[:, 32:] for x in (q, k, v, g, beta)), initial_state=S1, output_final_state=True)
    assert rel_err(np.concatenate([o1, o2], 1), o) < FP32_TOL
    assert rel_err(S2, S) < FP32_TOL
    assert rel_err(o2, _chunk(*(x[:, 32:] for x in (q, k, v, g, beta)))[0]) > 0.05  # the carry matters


class KdaStepTest(chex.TestCase):
    """The one-token decode step, traced under ``jit`` and run op by op (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_kda_step_decode_matches_numpy(self):
        q, k, v, g, beta, h = make_inputs(2, 2, 3, 2, 16, 24, "lb", h0=True)
        step = self.variant(kda_step, static_argnums=6)
        S = jnp.asarray(h)
        outs = []
        for t in range(3):
            o_t, S = step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], 16**-0.5)
            chex.assert_shape(o_t, (2, 2, 24))
            outs.append(o_t)
        chex.assert_tree_all_finite((outs, S))
        o_ref, S_ref = numpy_kda(q, k, v, g, beta, h0=h)
        assert rel_err(np.stack(outs, 1), o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


# ----------------------------------------------------------------------------- segments

SEGMENTS = np.array(
    [
        # resets at 5 (inside chunk 0), 16 and 32 (chunk starts for C=16), 40, and a recurring id at 60
        [0] * 5 + [1] * 11 + [2] * 16 + [3] * 8 + [4] * 20 + [0] * 10,
        # one long segment across chunks, then several tiny ones (length 1) at the end
        [7] * 64 + [8, 9, 8, 8, 9, 10],
    ]
)


@pytest.mark.parametrize("C", [16, 64])
def test_segments_match_numpy_and_isolated_runs(C):
    B, T, H, K, V = 2, SEGMENTS.shape[1], 2, 16, 24
    q, k, v, g, beta, h = make_inputs(4, B, T, H, K, V, "mild", h0=True)
    seg = jnp.asarray(SEGMENTS, jnp.int32)
    o_c, S_c = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True, chunk_size=C, segment_ids=seg)
    o_r, S_r = _recurrent(q, k, v, g, beta, initial_state=h, output_final_state=True, segment_ids=seg)
    o_ref, S_ref = numpy_kda(q, k, v, g, beta, h0=h, segment_ids=SEGMENTS)
    for o, S in ((o_c, S_c), (o_r, S_r)):
        assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL
    # each segment alone (the first one from h0, the others from zeros) gives the packed result
    for b in range(B):
        starts = [0] + [t for t in range(1, T) if SEGMENTS[b, t] != SEGMENTS[b, t - 1]] + [T]
        for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
            h_seg = h[b : b + 1] if i == 0 else None
            o_s, S_s = numpy_kda(*(x[b : b + 1, s:e] for x in (q, k, v, g, beta)), h0=h_seg)
            assert rel_err(o_c[b : b + 1, s:e], o_s) < FP32_TOL, (b, s, e)
            if e == T:
                assert rel_err(S_c[b : b + 1], S_s) < FP32_TOL
    # the data can tell: ignoring the segments gives a clearly different result
    assert rel_err(numpy_kda(q, k, v, g, beta, h0=h)[0], o_ref) > 0.05


# ----------------------------------------------------------------------------- dtypes


def test_bf16_inputs_close_to_fp32():
    q, k, v, g, beta, h = make_inputs(6, 2, 65, 2, 16, 24, "sp", h0=True)
    o32, S32 = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, g, beta)]
    o16, S16 = _chunk(*bf, initial_state=h, output_final_state=True)
    assert o16.dtype == jnp.bfloat16 and S16.dtype == jnp.float32
    # inputs and the output are rounded to bf16 (eps 2**-8 = 3.9e-3, RMS rounding ~1e-3 each) and
    # the delta rule propagates the input errors: allow a few bf16 roundings in RMS terms
    assert rel_err(o16, o32) < 1e-2 and rel_err(S16, S32) < 1e-2
    o_r16, _ = _recurrent(*bf, initial_state=h)
    assert o_r16.dtype == jnp.bfloat16
    assert rel_err(o16, o_r16) < 3e-3  # same bf16 inputs: only the output rounding differs


# ----------------------------------------------------------------------------- gradients


def test_check_grads_float64():
    """Finite differences in float64 (recurrent_kda's gradients are covered through
    chunk == recurrent == torch autograd in the fp32 gradient test)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        B, T, H, K, V = 1, 7, 1, 3, 2
        q, k = (rng.standard_normal((B, T, H, K)) * 0.5 for _ in range(2))
        v = rng.standard_normal((B, T, H, V))
        g = -rng.uniform(0.01, 2.0, (B, T, H, K))
        beta = rng.uniform(0.2, 0.8, (B, T, H))
        h0 = rng.standard_normal((B, H, K, V))
        seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1]])
        args = tuple(jnp.asarray(x, jnp.float64) for x in (q, k, v, g, beta, h0))

        @jax.jit
        def chunk_fn(q, k, v, g, beta, h0):  # T=7 in chunks of 4: padding, a reset inside chunk 0
            return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4,
                             segment_ids=seg)

        assert chunk_fn(*args)[0].dtype == jnp.float64
        check_grads(chunk_fn, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
        z, A_log, dt_bias = args[3] * 3, jnp.full((H,), 0.3), jnp.ones((H, K))
        check_grads(jax.jit(kda_gate_lower_bound), (z, A_log, dt_bias), order=1, modes=["rev"])
        check_grads(jax.jit(kda_gate_softplus), (z, A_log, dt_bias), order=1, modes=["rev"])


def _loss(fn, **kw):
    def loss(q, k, v, g, beta, h, do, dS, seg):
        o, S = fn(q, k, v, g, beta, initial_state=h, output_final_state=True, segment_ids=seg, **kw)
        return jnp.sum(o * do) + jnp.sum(S * dS), (o, S)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


_chunk_fwd_bwd = _loss(chunk_kda, chunk_size=16)
_recurrent_fwd_bwd = _loss(recurrent_kda)
GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]


def test_chunk_gradients_match_recurrent_and_fla(fla):
    torch, naive = fla
    B, T, H, K, V = 2, 50, 2, 8, 12
    q, k, v, g, beta, h = make_inputs(8, B, T, H, K, V, "sp", h0=True)
    rng = np.random.default_rng(9)
    do = rng.standard_normal((B, T, H, V)).astype(np.float32)
    dS = rng.standard_normal((B, H, K, V)).astype(np.float32)
    no_seg = np.zeros((B, T), np.int32)
    seg = np.repeat([[0, 1], [2, 2]], T // 2, axis=1).astype(np.int32)
    g_extreme = g.copy()
    g_extreme[:, ::3] = -100.0  # softplus-scale decays ...
    g_extreme[:, 1::7] = -1e4  # ... and far beyond float32's exp range
    for gate, segment_ids in ((g, no_seg), (g, seg), (g_extreme, seg)):
        (_, (o, S)), gc = _chunk_fwd_bwd(q, k, v, gate, beta, h, do, dS, segment_ids)
        (_, (o_r, S_r)), gr = _recurrent_fwd_bwd(q, k, v, gate, beta, h, do, dS, segment_ids)
        o_ref, S_ref = numpy_kda(q, k, v, gate, beta, h0=h, segment_ids=segment_ids)
        assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL
        for name, a, b in zip(GRAD_NAMES, gc, gr):
            assert bool(jnp.isfinite(a).all()), name
            assert rel_err(a, b) < FP32_TOL, name
    # fla's torch reference through autograd (no segments)
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta, h)]
    o, S = naive.naive_recurrent_kda(*t[:5], initial_state=t[5], output_final_state=True)
    ((o * torch.from_numpy(do)).sum() + (S * torch.from_numpy(dS)).sum()).backward()
    _, gc = _chunk_fwd_bwd(q, k, v, g, beta, h, do, dS, no_seg)
    for name, a, b in zip(GRAD_NAMES, gc, t):
        assert rel_err(a, b.grad.numpy()) < FP32_TOL, name


# ----------------------------------------------------------------------------- intra-chunk algebra (kda_chunk)


def numpy_scores(x, k, g):
    """float64 ``A_ij = sum_d x_id k_jd exp(G_id - G_jd)`` (j <= i) from the pairwise decays."""
    x, k = np.asarray(x, np.float64), np.asarray(k, np.float64)
    G = np.cumsum(np.maximum(np.asarray(g, np.float64), kda_chunk.G_FLOOR), axis=-2)
    C = G.shape[-2]
    decay = np.exp(np.minimum(G[..., :, None, :] - G[..., None, :, :], 0.0))
    return np.einsum("...id,...jd,...ijd->...ij", x, k, decay) * np.tril(np.ones((C, C)))


@pytest.mark.parametrize("C", [64, 16, 8, 2])
@pytest.mark.parametrize("gate_scale", [0.3, 60.0])  # dense diagonal sub-tiles / the exact path
def test_chunk_scores_match_pairwise_decays(C, gate_scale):
    rng = np.random.default_rng(C)
    x, k = (rng.standard_normal((2, 3, C, 8)).astype(np.float32) for _ in range(2))
    g = -rng.uniform(0, gate_scale, (2, 3, C, 8)).astype(np.float32)
    g[0, 0, : C // 2] = -1e4  # far beyond exp's range: floored, and the later pairs must stay exact
    A = jax.jit(kda_chunk.chunk_scores)((x, k), k, g)
    if C >= 4:  # which path the check covers
        assert bool(kda_chunk.dense_ok(g[1:])) == (gate_scale < 1)
    for a, xx in zip(A, (x, k)):
        assert rel_err(a, numpy_scores(xx, k, g)) < 1e-6
    if C >= kda_chunk.SUBTILE:  # on a bounded gate both paths apply and agree
        g_b = -rng.uniform(0, 2.0, g.shape).astype(np.float32)
        dense, exact = (jax.jit(kda_chunk.chunk_scores_on_path, static_argnums=3)((x,), k, g_b, d)[0] for d in (True, False))
        assert rel_err(dense, exact) < 1e-6 and rel_err(exact, numpy_scores(x, k, g_b)) < 1e-6


def test_chunk_scores_and_inverse_gradients_float64():
    """Finite differences through both score paths (custom VJPs) and the unit-lower inverse."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        x, k = (jnp.asarray(rng.standard_normal((2, 32, 5)) * 0.5) for _ in range(2))
        for gate_scale in (0.3, 30.0):
            g = jnp.asarray(-rng.uniform(0, gate_scale, (2, 32, 5)))
            check_grads(lambda x, k, g: kda_chunk.chunk_scores((x, k), k, g), (x, k, g), order=1, modes=["rev"],
                        atol=1e-6, rtol=1e-6)
        L = jnp.tril(jnp.asarray(rng.standard_normal((2, 32, 32)) * 0.3), -1)
        X = kda_chunk.unit_lower_inverse(L)
        np.testing.assert_allclose(X, np.linalg.inv(np.eye(32) + np.asarray(L)), atol=1e-10)
        # the VJP only feeds the strictly lower part, which is all the function reads
        check_grads(lambda L: kda_chunk.unit_lower_inverse(jnp.tril(L, -1)), (L,), order=1, modes=["rev"])


@slow
def test_long_sequence_8192():
    """T = 8192, H = 4, K = V = 128: the old pairwise-decay form needed B*T*H*C*K*4 bytes = 1 GiB per decay
    tensor and ~16 GiB through autodiff. The forward must match the token loop (recurrent_kda), and the
    backward must run; its dv of the last token has the closed form ``beta (scale q.k) do`` (o_T is the
    only output that v_T reaches)."""
    B, T, H, K, V = 1, 8192, 4, 128, 128
    q, k, v, g, beta, h = make_inputs(13, B, T, H, K, V, "sp", h0=True)
    g[:, 4000:] = np.maximum(g[:, 4000:], -5.0)  # the second half on the dense path's gate range
    o, S = _chunk(q, k, v, g, beta, initial_state=h, output_final_state=True)
    o_r, S_r = _recurrent(q, k, v, g, beta, initial_state=h, output_final_state=True)
    assert rel_err(o, o_r) < FP32_TOL and rel_err(S, S_r) < FP32_TOL
    do = np.random.default_rng(14).standard_normal((B, T, H, V)).astype(np.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(chunk_kda(*a, initial_state=h)[0] * do), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, g, beta)
    assert all(bool(jnp.isfinite(x).all()) for x in grads)
    qk = np.sum(q[:, -1] * k[:, -1], axis=-1) * K**-0.5  # [B, H]
    np.testing.assert_allclose(grads[2][:, -1], (beta[:, -1] * qk)[..., None] * do[:, -1], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- gates, validation


def test_gate_functions_match_formula():
    rng = np.random.default_rng(10)
    z = rng.standard_normal((2, 3, 4, 5)).astype(np.float32) * 10
    A_log = rng.standard_normal(4).astype(np.float32)
    dt_bias = rng.standard_normal((4, 5)).astype(np.float32)
    a = np.exp(A_log.astype(np.float64))[:, None]
    x = z.astype(np.float64) + dt_bias
    lb = kda_gate_lower_bound(jnp.asarray(z), jnp.asarray(A_log), jnp.asarray(dt_bias), lower_bound=-3.0)
    np.testing.assert_allclose(lb, -3.0 / (1 + np.exp(-a * x)), rtol=1e-5, atol=1e-6)
    sp = kda_gate_softplus(jnp.asarray(z), jnp.asarray(A_log), jnp.asarray(dt_bias))
    np.testing.assert_allclose(sp, -a * np.logaddexp(x, 0.0), rtol=1e-5, atol=1e-6)
    sp0 = kda_gate_softplus(jnp.asarray(z, jnp.bfloat16), jnp.asarray(A_log), None)
    assert sp0.dtype == jnp.float32
    np.testing.assert_allclose(sp0, -a * np.logaddexp(np.asarray(jnp.asarray(z, jnp.bfloat16), np.float64), 0),
                               rtol=1e-5, atol=1e-6)
    big = kda_gate_softplus(jnp.full((1, 1, 4, 5), 1e4), jnp.zeros(4), None)  # no overflow
    np.testing.assert_allclose(big, -1e4)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate_softplus(jnp.asarray(z), jnp.zeros(3), None)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate_lower_bound(jnp.asarray(z), jnp.asarray(A_log), jnp.zeros(20))


def test_bad_inputs_raise():
    q, k, v, g, beta, h = make_inputs(11, 1, 5, 2, 4, 3, "lb", h0=True)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=h.astype(np.float16))
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda(q, k, v, g, beta, initial_state=h[:, :, :, :2])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="v must"):
        chunk_kda(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="segment_ids"):
        chunk_kda(q, k, v, g, beta, segment_ids=np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match="floating"):
        recurrent_kda(q, k, v.astype(np.int32), g, beta)
    with pytest.raises(ValueError, match="state"):
        kda_step(jnp.zeros((1, 2, 4, 3), jnp.bfloat16), q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    with pytest.raises(ValueError, match="v_t"):
        kda_step(jnp.asarray(h), q[:, 0], k[:, 0], v[:, 0, :, :2], g[:, 0], beta[:, 0])

"""Pallas grouped matmul (interpret mode on CPU) against ``jax.lax.ragged_dot`` and ``k3jax.ops.moe``.

Tolerances:

- fp32: the kernel computes the same fp32 dot products (HIGHEST precision) as ragged_dot, accumulated in
  tiles of tk columns, so only the summation order differs: relative error ~ sqrt(D) * eps ~ 1e-6.
  1e-5 of the output's largest magnitude.
- bf16: both sides multiply the same bf16 values with fp32 accumulation; the kernel rounds its result
  to bf16 once (u = 2^-9 relative), the reference rounds at its own points. Compared with an fp32
  computation on the same bf16 values: 2^-8 relative RMS (2u) for one rounding; the GLU chain (three
  matmuls and two bf16 hand-offs, as in the reference) gets 3 x 2^-8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.moe import grouped_glu_experts as ref_grouped_glu_experts
from pallas_kernels.moe import gmm, group_metadata, grouped_glu_experts, grouped_matmul, tgmm

HI = jax.lax.Precision.HIGHEST
# kernels and references compiled without XLA's optimisation passes (values are compared, not programs)
pytestmark = pytest.mark.usefixtures("fast_xla")
TILING = (16, 128, 128)  # small row tiles so groups straddle tiles; 2 k- and n-tiles at D = F = 256


def max_rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))


def rms_rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)) / (np.sqrt(np.mean(ref**2)) + 1e-30))


def rand(seed, shape, dtype=jnp.float32, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape)).astype(dtype)


# empty groups first, in the middle, consecutive and last; a group inside one tile; a group spanning
# several tiles; 3 rows past sum(group_sizes)
GROUPS = [0, 5, 0, 0, 30, 2, 0, 11, 0]
M = sum(GROUPS) + 3


def test_group_metadata_visits():
    gs = jnp.array(GROUPS, jnp.int32)
    offsets, gids, tids, n = group_metadata(gs, 64, 16, visit_empty=False)
    n = int(n)
    gids, tids = np.asarray(gids)[:n], np.asarray(tids)[:n]
    # every (group, tile) pair holding rows appears once, in order, tile visits consecutive
    want = []
    off = np.concatenate([[0], np.cumsum(GROUPS)])
    for g, size in enumerate(GROUPS):
        if size:
            want += [(g, t) for t in range(off[g] // 16, (off[g + 1] + 15) // 16)]
    assert list(zip(gids, tids)) == want
    _, gids_e, _, n_e = group_metadata(gs, 64, 16, visit_empty=True)
    assert sorted(set(np.asarray(gids_e)[:int(n_e)])) == list(range(len(GROUPS)))  # empty groups visited too


def test_gmm_fp32_forward_and_transposed():
    D, F = 256, 256
    x, w = rand(0, (M, D)), rand(1, (len(GROUPS), D, F))
    gs = jnp.array(GROUPS, jnp.int32)
    y = gmm(x, w, gs, tiling=TILING)
    y_ref = jax.lax.ragged_dot(x, w, gs, precision=HI)
    assert max_rel(y, y_ref) < 1e-5
    assert np.all(np.asarray(y[sum(GROUPS):]) == 0)  # rows past the groups are zero
    dy = rand(2, (M, F))
    dx = gmm(dy, w, gs, transpose_rhs=True, tiling=TILING)
    assert max_rel(dx, jax.lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), gs, precision=HI)) < 1e-5


def test_tgmm_fp32_with_empty_groups():
    D, F = 256, 40  # F a single (full-width) tile
    x, dy = rand(3, (M, D)), rand(4, (M, F))
    gs = jnp.array(GROUPS, jnp.int32)
    dw = tgmm(x, dy, gs, tiling=TILING)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, gs, precision=HI), jnp.zeros((len(GROUPS), D, F)))
    (dw_ref,) = vjp(dy)
    assert max_rel(dw, dw_ref) < 1e-5
    for g, size in enumerate(GROUPS):
        if size == 0:
            assert np.all(np.asarray(dw[g]) == 0)


def test_grouped_matmul_grads_fp32():
    D, F = 24, 40
    x, w, c = rand(5, (M, D)), rand(6, (len(GROUPS), D, F)), rand(7, (M, F))
    gs = jnp.array(GROUPS, jnp.int32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * c)
    got = jax.grad(loss(lambda x, w: grouped_matmul(x, w, gs, tiling=TILING)), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda x, w: jax.lax.ragged_dot(x, w, gs, precision=HI)), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        assert a.shape == b.shape and max_rel(a, b) < 1e-5


def test_all_groups_empty():
    x, w = rand(8, (16, 24)), rand(9, (3, 24, 32))
    gs = jnp.zeros((3,), jnp.int32)
    assert np.all(np.asarray(gmm(x, w, gs, tiling=TILING)) == 0)
    assert np.all(np.asarray(tgmm(x, rand(10, (16, 32)), gs, tiling=TILING)) == 0)


def test_gmm_bf16():
    D, F = 256, 256
    x, w = rand(11, (M, D), jnp.bfloat16), rand(12, (len(GROUPS), D, F), jnp.bfloat16)
    gs = jnp.array(GROUPS, jnp.int32)
    y = gmm(x, w, gs, tiling=TILING)
    assert y.dtype == jnp.bfloat16
    y32 = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), gs, precision=HI)
    assert rms_rel(y, y32) < 2.0**-8
    dw = tgmm(x, y, gs, tiling=TILING)
    _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(jnp.float32), w, gs, precision=HI), w.astype(jnp.float32))
    assert dw.dtype == jnp.bfloat16 and rms_rel(dw, vjp(y.astype(jnp.float32))[0]) < 2.0**-8


@pytest.mark.parametrize("dtype,activation", [(jnp.float32, "situ_glu"), (jnp.bfloat16, "situ_glu"),
                                              pytest.param(jnp.float32, "swiglu", marks=pytest.mark.slow)])
def test_grouped_glu_experts_matches_reference(dtype, activation):
    """The drop-in for k3jax.ops.moe.grouped_glu_experts: forward and gradients of x and the 3 weights."""
    N, k, E, D, F = 12, 3, 6, 32, 48
    x = rand(13, (N, D), dtype)
    experts = jax.random.randint(jax.random.PRNGKey(14), (N, k), 0, E - 2)  # the last two experts stay empty
    wg, wu = rand(15, (E, D, F), dtype, 0.3), rand(16, (E, D, F), dtype, 0.3)
    wd = rand(17, (E, F, D), dtype, 0.3)
    c = rand(18, (N, k, D))

    def loss(f):
        return lambda *a: jnp.sum(f(a[0], experts, *a[1:], activation=activation).astype(jnp.float32) * c)

    args = (x, wg, wu, wd)
    up = lambda a: a.astype(jnp.float32)  # noqa: E731

    @jax.jit  # one program (op by op, the kernel's glue and the reference compiled dozens of small ones)
    def run(x, wg, wu, wd):
        out = grouped_glu_experts(x, experts, wg, wu, wd, activation=activation)
        g = jax.grad(loss(grouped_glu_experts), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
        ref_out = ref_grouped_glu_experts(up(x), experts, up(wg), up(wu), up(wd), activation=activation)
        g_ref = jax.grad(loss(ref_grouped_glu_experts), argnums=(0, 1, 2, 3))(*map(up, (x, wg, wu, wd)))
        return out, g, ref_out, g_ref

    with jax.default_matmul_precision("highest"):
        out, g, ref_out, g_ref = run(*args)
    tol = 1e-5 if dtype == jnp.float32 else 3 * 2.0**-8
    err = rms_rel if dtype == jnp.bfloat16 else max_rel
    assert out.shape == (N, k, D) and out.dtype == dtype
    assert err(out, ref_out) < tol
    for a, b, p in zip(g, g_ref, args):
        assert a.dtype == p.dtype and a.shape == p.shape
        assert err(a, b) < tol
    assert np.all(np.asarray(g[1][E - 2:]) == 0)  # unused experts get zero gradient


def test_mxfp8_inputs_match_the_reference():
    """With MXFP8 fake quantization of both matmul stages' inputs (``quant.activations=mxfp8``), the
    Pallas experts compute what the reference computes: forward and gradients (straight-through)."""
    from k3jax.config import QuantConfig
    from k3jax.layers.quantized_experts import activation_quantizer

    act_quant = activation_quantizer(QuantConfig(activations="mxfp8"))
    N, k, E, D, F = 12, 2, 4, 64, 64  # D and F multiples of the 32-wide MXFP8 blocks
    x = rand(20, (N, D))
    experts = jax.random.randint(jax.random.PRNGKey(21), (N, k), 0, E)
    ws = (rand(22, (E, D, F), scale=0.3), rand(23, (E, D, F), scale=0.3), rand(24, (E, F, D), scale=0.3))
    c = rand(25, (N, k, D))

    def loss(f, quant):
        return lambda x, *w: jnp.sum(f(x, experts, *w, activation="situ_glu", act_quant=quant) * c)

    @jax.jit  # one program (op by op, the quantizers and the kernel's glue compiled dozens of small ones)
    def run(x, *ws):
        got = jax.value_and_grad(loss(grouped_glu_experts, act_quant), argnums=(0, 1, 2, 3))(x, *ws)
        want = jax.value_and_grad(loss(ref_grouped_glu_experts, act_quant), argnums=(0, 1, 2, 3))(x, *ws)
        return got, want, loss(ref_grouped_glu_experts, None)(x, *ws)

    with jax.default_matmul_precision("highest"):
        got, want, plain = run(x, *ws)
    assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
    assert abs(float(want[0]) - float(plain)) > 1e-3 * abs(float(plain))  # the quantization is on
    for a, b in zip(got[1], want[1]):
        assert max_rel(a, b) < 1e-5

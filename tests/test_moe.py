"""Stable LatentMoE: routing, dropless grouped experts (ragged_dot, and the padded tiles that run
on CPU) and the layer against dense per-token float64 numpy loops; gradients against dense jnp
formulations; FLOPs that scale with top_k, in the program and in XLA:CPU's compiled cost."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprs import sub_jaxprs
from k3jax.config import load_config
from k3jax.layers.latent_moe import LatentMoE
from k3jax.ops.moe import grouped_glu_experts, ragged_glu, sigmoid_topk_route, tile_plan, tiled_glu

pytestmark = pytest.mark.usefixtures("fast_xla")


# ----------------------------------------------------------------------------- float64 references


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_glu(gate, up, activation, beta=4.0, linear_beta=25.0):
    if activation == "situ_glu":  # K3: softcap(g, 4) * sigmoid(g) * softcap(u, 25)
        return beta * np.tanh(gate / beta) * np_sigmoid(gate) * (linear_beta * np.tanh(up / linear_beta))
    return gate * np_sigmoid(gate) * up  # SwiGLU


def np_rms_norm(x, gain, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def np_route(x_n, router, bias, top_k, rsf, renormalize=True):
    """One token: returns (selected experts in descending biased-score order, their combine weights)."""
    s = np_sigmoid(x_n @ router)
    biased = s + (0.0 if bias is None else bias)
    sel = np.argsort(-biased, kind="stable")[:top_k]
    w = s[sel] / s[sel].sum() if renormalize else s[sel]
    return sel, w * rsf, s, biased


def np_moe(x, P, cfg, bias):
    """Dense per-token loop of the K3 MoE in float64. x [N, d]; P: the layer's params as float64 arrays."""
    m = cfg.moe
    out = np.zeros_like(x)
    selections = []
    for n in range(x.shape[0]):
        sel, w, _, _ = np_route(x[n], P["router"], bias, m.top_k, m.routed_scaling_factor)
        selections.append(sel)
        z = x[n] @ P["down"] if m.latent_dim else x[n]
        u = np.zeros_like(z)
        for e, we in zip(sel, w):
            h = np_glu(z @ P["w_gate"][e], z @ P["w_up"][e], cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
            u += we * (h @ P["w_down"][e])
        if m.latent_dim:
            if m.latent_norm:
                u = np_rms_norm(u, P["latent_norm"]["weight"], cfg.norm_eps)
            y = u @ P["up"]
        else:
            y = u
        if m.num_shared_experts:
            S = P["shared"]
            y = y + np_glu(x[n] @ S["w_gate"], x[n] @ S["w_up"], cfg.activation, cfg.situ_beta,
                           cfg.situ_linear_beta) @ S["w_down"]
        out[n] = y
    return out, np.array(selections)


def _y(out):
    """LatentMoE returns (y, Quantile Balancing statistics); accept a bare y too."""
    return out[0] if isinstance(out, tuple) else out


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / (np.max(np.abs(ref)) + 1e-30))


# ----------------------------------------------------------------------------- routing op


@pytest.mark.parametrize("top_k, num_experts, renormalize, rsf", [(2, 8, True, 1.0), (3, 7, True, 2.5),
                                                                  (4, 4, True, 1.0), (2, 6, False, 1.7)])
def test_sigmoid_topk_route(top_k, num_experts, renormalize, rsf):
    rng = np.random.default_rng(0)
    n, d = 40, 6
    x = rng.standard_normal((n, d))
    router = rng.standard_normal((d, num_experts))
    bias = rng.standard_normal(num_experts) * 0.3
    logits = jnp.asarray(x @ router, jnp.float32)
    r = jax.jit(sigmoid_topk_route, static_argnums=2, static_argnames=("renormalize", "scaling_factor"))(
        logits, jnp.asarray(bias, jnp.float32), top_k, renormalize=renormalize, scaling_factor=rsf)
    changed = 0
    for i in range(n):
        s = np_sigmoid(np.asarray(logits[i], np.float64))
        biased = s + bias
        order = np.argsort(-biased, kind="stable")
        sel = order[:top_k]
        w = s[sel] / s[sel].sum() if renormalize else s[sel]
        np.testing.assert_array_equal(np.asarray(r.experts[i]), sel)  # descending biased score
        np.testing.assert_allclose(np.asarray(r.weights[i]), w * rsf, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(r.scores[i]), s, rtol=1e-6)
        expected_threshold = biased[order[top_k]] if top_k < num_experts else -np.inf
        np.testing.assert_allclose(float(r.threshold[i]), expected_threshold, rtol=1e-6, atol=1e-7)
        changed += set(sel) != set(np.argsort(-s, kind="stable")[:top_k])
    if top_k < num_experts:
        assert changed > 0, "the bias should change some selections for this test to mean anything"
    assert r.experts.dtype == jnp.int32 and r.weights.dtype == jnp.float32


def test_route_bias_gets_no_gradient_and_weights_use_raw_scores():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4)), jnp.float32)
    bias = jnp.array([0.0, 0.0, 0.0, 10.0])  # expert 3 always selected, its weight is still from s_3
    r = sigmoid_topk_route(logits, bias, 2, scaling_factor=1.0)
    assert bool(jnp.all(r.experts[:, 0] == 3))
    s = jax.nn.sigmoid(logits)
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)
    other = r.experts[:, 1]
    np.testing.assert_allclose(r.weights[:, 0], s[:, 3] / (s[:, 3] + s[jnp.arange(5), other]), rtol=1e-6)
    g = jax.grad(lambda b: jnp.sum(sigmoid_topk_route(logits, b, 2).weights ** 2))(bias)
    assert bool(jnp.all(g == 0))


# ----------------------------------------------------------------------------- grouped experts op


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_grouped_glu_experts(activation):
    rng = np.random.default_rng(2)
    n, k, e, d, f = 11, 3, 6, 5, 7
    x = rng.standard_normal((n, d)) * 2
    wg, wu = rng.standard_normal((e, d, f)), rng.standard_normal((e, d, f)) * 3
    wd = rng.standard_normal((e, f, d))
    experts = np.stack([rng.permutation([0, 1, 3, 4, 5])[:k] for _ in range(n)])  # expert 2 gets no token
    experts[:, 0] = np.where(np.arange(n) % 2 == 0, 5, experts[:, 0])  # expert 5 gets most
    experts[:, 1] = np.where(experts[:, 1] == 5, 1, experts[:, 1])
    experts[:, 2] = np.where(experts[:, 2] == 5, 0, experts[:, 2])
    experts[:, 2] = np.where(experts[:, 2] == experts[:, 1], 4 - (experts[:, 1] == 4) * 4, experts[:, 2])
    assert all(len(set(row)) == k for row in experts) and not (experts == 2).any()
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out = jax.jit(grouped_glu_experts, static_argnames=("activation", "beta", "linear_beta"))(
        f32(x), jnp.asarray(experts, jnp.int32), f32(wg), f32(wu), f32(wd), activation=activation)
    ref = np.zeros((n, k, d))
    for i in range(n):
        for j in range(k):
            ei = experts[i, j]
            ref[i, j] = np_glu(x[i] @ wg[ei], x[i] @ wu[ei], activation) @ wd[ei]
    assert out.shape == (n, k, d)
    err = rel_err(out, ref)
    assert err < 1e-5, err
    if activation == "situ_glu":  # the soft caps were actually exercised
        assert np.abs(x @ wg[5]).max() > 4 and np.abs(x @ wu[5]).max() > 4


def np_ragged_glu(xs, sizes, wg, wu, wd, activation):
    """Rows [0, sizes[0]) through expert 0, the next sizes[1] through expert 1, ...; the rest zeros."""
    out = np.zeros((xs.shape[0], wd.shape[-1]))
    r = 0
    for e, n in enumerate(sizes):
        for i in range(r, r + n):
            out[i] = np_glu(xs[i] @ wg[e], xs[i] @ wu[e], activation) @ wd[e]
        r += n
    return out


def dense_ragged_glu(xs, sizes, wg, wu, wd, activation):
    """Every row through every expert, the row's own selected by a one-hot mask (jnp, differentiable;
    independent of k3jax's ops)."""
    expert_of_row = np.repeat(np.arange(len(sizes)), sizes)
    onehot = np.zeros((xs.shape[0], len(sizes)), np.float32)
    onehot[np.arange(len(expert_of_row)), expert_of_row] = 1.0
    g, u = jnp.einsum("md,edf->mef", xs, wg), jnp.einsum("md,edf->mef", xs, wu)
    if activation == "situ_glu":
        h = 4.0 * jnp.tanh(g / 4.0) * jax.nn.sigmoid(g) * (25.0 * jnp.tanh(u / 25.0))
    else:
        h = g * jax.nn.sigmoid(g) * u
    return jnp.einsum("me,mef,efd->md", jnp.asarray(onehot), h, wd)


# name: (rows M, experts E, D, F, group sizes (sum <= M), tile (None = tile_plan's))
RAGGED_CASES = {
    "random": (45, 6, 5, 7, [9, 0, 14, 3, 12, 5], None),
    "rows_past_sum": (30, 4, 6, 3, [7, 0, 11, 2], None),  # 10 rows of no expert, empty group
    "singletons_max_padding": (13, 13, 4, 5, [1] * 13, 4),  # every group wastes 3 of its tile's 4 rows
    "tile_1": (11, 3, 3, 4, [4, 5, 2], 1),
    "odd_tile": (29, 5, 7, 6, [0, 13, 0, 9, 7], 3),
    "one_group_big_tile": (23, 4, 5, 5, [0, 0, 23, 0], 64),
    "single_row": (1, 7, 4, 3, [0, 0, 0, 0, 0, 1, 0], None),
    "no_rows_routed": (5, 3, 4, 4, [0, 0, 0], None),
}


@pytest.mark.parametrize("case", list(RAGGED_CASES))
@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_tiled_glu_matches_numpy(case, activation):
    """The CPU expert path (padded tiles) against the float64 loop; and ragged_glu, which picks it on CPU."""
    m, e, d, f, sizes, tile = RAGGED_CASES[case]
    rng = np.random.default_rng(len(case))
    xs = rng.standard_normal((m, d)) * 2
    wg, wu, wd = rng.standard_normal((e, d, f)), rng.standard_normal((e, d, f)) * 3, rng.standard_normal((e, f, d))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    ref = np_ragged_glu(xs, sizes, wg, wu, wd, activation)
    args = (f32(xs), jnp.asarray(sizes, jnp.int32), f32(wg), f32(wu), f32(wd))
    out = jax.jit(functools.partial(tiled_glu, activation=activation, tile=tile))(*args)
    assert out.shape == (m, d) and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    assert not np.any(np.asarray(out[sum(sizes):]))  # rows of no expert: zeros
    via_dispatch = jax.jit(functools.partial(ragged_glu, activation=activation))(*args)
    assert rel_err(via_dispatch, ref) < 1e-5


@pytest.mark.parametrize("case", ["random", "rows_past_sum", "singletons_max_padding", "odd_tile"])
def test_tiled_glu_grads_match_dense(case):
    m, e, d, f, sizes, tile = RAGGED_CASES[case]
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    cot = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    tiled = lambda xs, ws: jnp.sum(tiled_glu(xs, gs, *ws, activation="situ_glu", tile=tile) * cot)  # noqa: E731
    dense = lambda xs, ws: jnp.sum(dense_ragged_glu(xs, sizes, *ws, "situ_glu") * cot)  # noqa: E731
    got = jax.jit(jax.grad(tiled, argnums=(0, 1)))(xs, ws)
    want = jax.jit(jax.grad(dense, argnums=(0, 1)))(xs, ws)
    errs = jax.tree.map(rel_err, got, want)
    assert max(jax.tree.leaves(errs)) < 1e-5, errs
    assert not np.any(np.asarray(got[0][sum(sizes):]))  # rows of no expert get no gradient
    for w in got[1]:  # nor do empty experts' weights
        assert all((np.abs(np.asarray(w[i])).max() == 0) == (sizes[i] == 0) for i in range(e))


@pytest.mark.parametrize("case", ["random", "rows_past_sum", "odd_tile", "no_rows_routed"])
def test_row_weights_scale_each_rows_output(case):
    """``row_weights`` scale each row's GLU output before the down projection, which (linear) scales the
    row's output: the CPU tiles, ``ragged_dot`` (the TPU / GPU path, run here on CPU) and the Pallas
    grouped matmul in interpret mode, against the unweighted float64 loop, forward and gradients (the
    weights' gradient is the row's ``<dy, y>``; every other input's, the unweighted one's with ``dy``
    scaled)."""
    from k3jax.ops.moe import ragged_dot_glu
    from pallas_kernels.moe import ragged_glu as pallas_ragged_glu

    m, e, d, f, sizes, tile = RAGGED_CASES[case]
    rng = np.random.default_rng(11)
    xs = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    weights = jnp.asarray(rng.uniform(-1, 2, size=m), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = np_ragged_glu(np.asarray(xs, np.float64), sizes, *(np.asarray(w, np.float64) for w in ws), "situ_glu")
    real = np.arange(m)[:, None] < sum(sizes)

    def unweighted(xs, ws, w):  # the reference: weights applied to the output
        return jnp.sum(dense_ragged_glu(xs, sizes, *ws, "situ_glu") * w[:, None] * cot * real)

    impls = {"tiled": functools.partial(tiled_glu, activation="situ_glu", tile=tile),
             "ragged_dot": functools.partial(ragged_dot_glu, activation="situ_glu", beta=4.0, linear_beta=25.0,
                                             act_quant=None),
             "pallas": functools.partial(pallas_ragged_glu, activation="situ_glu", interpret=True, backend="tpu")}
    want = jax.jit(jax.grad(unweighted, argnums=(0, 1, 2)))(xs, ws, weights)
    for name, fn in impls.items():
        out = jax.jit(lambda xs, ws, w: fn(xs, gs, *ws, row_weights=w))(xs, ws, weights)
        assert rel_err(np.asarray(out) * real, ref * np.asarray(weights)[:, None] * real) < 1e-5, name
        got = jax.jit(jax.grad(lambda xs, ws, w: jnp.sum(fn(xs, gs, *ws, row_weights=w) * cot * real),
                               argnums=(0, 1, 2)))(xs, ws, weights)
        errs = jax.tree.map(rel_err, got, want)
        assert max(jax.tree.leaves(errs)) < 1e-5, (name, errs)


def test_row_weights_come_after_the_activation_quantization():
    """With MXFP8 activations the down projection's input is quantized unweighted, then weighted: each
    implementation's weighted rows are the weights times its unweighted rows (weighting first would move
    a block's scale with the weight and round differently from the single-device path, which weights the
    outputs)."""
    from k3jax.ops.moe import ragged_dot_glu
    from k3jax.quant import fake_quantize_mxfp8
    from pallas_kernels.moe import ragged_glu as pallas_ragged_glu

    m, e, d, f, sizes, tile = RAGGED_CASES["odd_tile"]
    d, f = 64, 96  # whole 32-value MXFP8 blocks
    rng = np.random.default_rng(5)
    xs = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    ws = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    weights = jnp.asarray(rng.uniform(0.05, 0.9, size=m), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    real = np.arange(m)[:, None] < sum(sizes)
    q = fake_quantize_mxfp8
    impls = {"tiled": functools.partial(tiled_glu, activation="situ_glu", tile=tile, act_quant=q),
             "ragged_dot": functools.partial(ragged_dot_glu, activation="situ_glu", beta=4.0, linear_beta=25.0,
                                             act_quant=q),
             "pallas": functools.partial(pallas_ragged_glu, activation="situ_glu", interpret=True, backend="tpu",
                                         act_quant=q)}
    for name, fn in impls.items():
        plain = np.asarray(jax.jit(lambda xs, ws: fn(xs, gs, *ws))(xs, ws))
        weighted = np.asarray(jax.jit(lambda xs, ws, w: fn(xs, gs, *ws, row_weights=w))(xs, ws, weights))
        assert rel_err(weighted * real, plain * np.asarray(weights)[:, None] * real) < 1e-6, name


def test_tile_plan_covers_the_worst_case():
    """Any grouping of `rows` rows into E groups fits the planned tiles (checked on the layouts that
    waste the most: as many non-empty groups as possible, each one row past a multiple of the tile)."""
    rng = np.random.default_rng(0)
    for rows, e in [(1, 8), (7, 3), (64, 64), (100, 7), (512, 64), (2048, 8), (4096, 32), (50, 200)]:
        tile, num_tiles = tile_plan(rows, e)
        assert tile >= 1 and num_tiles * tile >= rows
        groups = min(e, rows)
        worst = np.ones(groups, int)
        worst[0] += rows - groups
        layouts = [worst] + [np.bincount(rng.integers(0, e, rows), minlength=e) for _ in range(20)]
        per = (rows // groups - 1) // tile * tile + 1  # one row past a multiple of the tile
        if per >= 1:
            spread = np.full(groups, per)
            spread[0] += rows - spread.sum()
            layouts.append(spread)
        for sizes in layouts:
            assert int(np.sum(-(-sizes // tile))) <= num_tiles, (rows, e, tile, sizes)
    assert tile_plan(4096, 32)[0] > 1 and tile_plan(4096, 32)[1] * tile_plan(4096, 32)[0] < 1.5 * 4096


def test_ragged_glu_lowers_per_platform():
    """The platform being lowered for decides (an AOT compile for TPU on a CPU host gets ragged_dot);
    gradients included."""
    xs, gs = jnp.zeros((24, 8)), jnp.array([10, 0, 10, 4], jnp.int32)
    ws = (jnp.zeros((4, 8, 16)), jnp.zeros((4, 8, 16)), jnp.zeros((4, 16, 8)))
    step = jax.jit(jax.grad(lambda xs, ws: jnp.sum(ragged_glu(xs, gs, *ws, activation="swiglu")), argnums=(0, 1)))
    traced = step.trace(xs, ws)
    for platform, ragged in (("tpu", True), ("cuda", True), ("cpu", False)):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert ("ragged_dot" in text) == ragged, platform
        assert ("dot_general" in text) == (not ragged), platform


# ----------------------------------------------------------------------------- the layer


LAYER_CASES = {
    # name: overrides on tiny (d = 64)
    "latent_norm_situ": ["model.moe.latent_dim=32", "model.moe.latent_norm=true", "model.activation=situ_glu"],
    "latent_nonorm_swiglu": ["model.moe.latent_dim=24", "model.moe.latent_norm=false", "model.activation=swiglu",
                             "model.moe.top_k=3", "model.moe.routed_scaling_factor=2.5"],
    "no_latent_situ": ["model.moe.latent_dim=0", "model.activation=situ_glu", "model.moe.num_experts=6",
                       "model.moe.routed_scaling_factor=2.827", "model.moe.num_shared_experts=2"],
    "no_latent_swiglu_no_shared": ["model.moe.latent_dim=0", "model.activation=swiglu",
                                   "model.moe.num_shared_experts=0"],
    "topk_eq_E": ["model.moe.num_experts=4", "model.moe.top_k=4", "model.moe.latent_dim=16"],
}
DEAD_EXPERT = 1


def make_layer(overrides, seed=0):
    cfg = load_config("tiny", ["model.init_std=0.25", *overrides]).model
    with nnx.use_eager_sharding(False):
        layer = LatentMoE(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    e = cfg.moe.num_experts
    bias = rng.standard_normal(e) * 0.2
    if cfg.moe.top_k < e:
        bias[DEAD_EXPERT] = -100.0  # never selected: an expert with no tokens
    layer.router_bias.value = jnp.asarray(bias, jnp.float32)
    if cfg.moe.latent_dim and cfg.moe.latent_norm:  # a non-trivial gain
        layer.latent_norm.weight.value = jnp.asarray(1 + 0.5 * rng.standard_normal(cfg.moe.latent_dim), jnp.float32)
    return cfg, layer, bias


def layer_params_f64(layer):
    _, params, _ = nnx.split(layer, nnx.Param, ...)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(params))


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_latent_moe_matches_numpy_loop(case):
    cfg, layer, bias = make_layer(LAYER_CASES[case])
    m = cfg.moe
    x = np.random.default_rng(3).standard_normal((2, 15, cfg.hidden_size)) * 1.5
    graphdef, state = nnx.split(layer)
    fwd = jax.jit(lambda s, x: _y(nnx.merge(graphdef, s)(x)))
    y = fwd(state, jnp.asarray(x, jnp.float32))
    P = layer_params_f64(layer)
    ref, sel = np_moe(x.reshape(-1, cfg.hidden_size), P, cfg, bias)
    err = rel_err(y.reshape(-1, cfg.hidden_size), ref)
    assert y.shape == x.shape and err < 2e-5, err
    if m.top_k < m.num_experts:
        assert not (sel == DEAD_EXPERT).any()
        # the bias changes the selection of some tokens (so a router ignoring it would fail)
        unbiased = [set(np_route(xn, P["router"], None, m.top_k, 1.0)[0]) for xn in x.reshape(-1, cfg.hidden_size)]
        assert any(set(s) != u for s, u in zip(sel, unbiased))
    # a different bias gives different outputs (bias is used for selection)
    layer.router_bias.value = jnp.zeros(m.num_experts)
    y0 = fwd(nnx.state(layer), jnp.asarray(x, jnp.float32))  # same shapes: no recompile
    if m.top_k < m.num_experts:
        assert rel_err(y0.reshape(-1, cfg.hidden_size), ref) > 1e-3
    else:
        assert rel_err(y0.reshape(-1, cfg.hidden_size), ref) < 2e-5  # all experts selected: bias irrelevant


# ----------------------------------------------------------------------------- gradients vs dense jnp


def dense_moe(P, x, bias, cfg):
    """All experts for every token, combined with a one-hot mask of the top-k (of s + bias) times the
    renormalised raw scores. Independent of k3jax's ops."""
    m = cfg.moe
    xf = x.reshape(-1, x.shape[-1])
    s = jax.nn.sigmoid(xf @ P["router"])
    biased = s + bias
    kth = jnp.sort(biased, axis=-1)[:, -m.top_k]
    onehot = (biased >= kth[:, None]).astype(s.dtype)  # [N, E], exactly top_k ones (no ties)
    w = s * onehot
    w = w / jnp.sum(w, axis=-1, keepdims=True) * m.routed_scaling_factor

    def glu(g, u):
        if cfg.activation == "situ_glu":
            return cfg.situ_beta * jnp.tanh(g / cfg.situ_beta) * jax.nn.sigmoid(g) * (
                cfg.situ_linear_beta * jnp.tanh(u / cfg.situ_linear_beta))
        return g * jax.nn.sigmoid(g) * u

    z = xf @ P["down"] if m.latent_dim else xf
    h = glu(jnp.einsum("nl,elf->nef", z, P["w_gate"]), jnp.einsum("nl,elf->nef", z, P["w_up"]))
    u = jnp.einsum("ne,nel->nl", w, jnp.einsum("nef,efl->nel", h, P["w_down"]))
    if m.latent_dim:
        if m.latent_norm:
            u = u * jax.lax.rsqrt(jnp.mean(u * u, -1, keepdims=True) + cfg.norm_eps) * P["latent_norm"]["weight"]
        u = u @ P["up"]
    if m.num_shared_experts:
        S = P["shared"]
        u = u + glu(xf @ S["w_gate"], xf @ S["w_up"]) @ S["w_down"]
    return u.reshape(x.shape)


@pytest.mark.parametrize("case", ["latent_norm_situ", "no_latent_swiglu_no_shared"])
def test_latent_moe_grads_match_dense(case):
    cfg, layer, bias = make_layer(LAYER_CASES[case], seed=1)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)

    def loss_layer(pure, x):
        p = nnx.State(params)  # same structure, new leaves
        nnx.replace_by_pure_dict(p, pure)
        return jnp.sum(_y(nnx.merge(graphdef, p, rest)(x)) * cot)

    def loss_dense(pure, x):
        return jnp.sum(dense_moe(pure, x, jnp.asarray(bias, jnp.float32), cfg) * cot)

    (gl_p, gl_x) = jax.jit(jax.grad(loss_layer, argnums=(0, 1)))(pure, x)
    (gd_p, gd_x) = jax.jit(jax.grad(loss_dense, argnums=(0, 1)))(pure, x)
    errs = jax.tree.map(rel_err, gl_p, gd_p)
    errs["x"] = rel_err(gl_x, gd_x)
    worst = max(jax.tree.leaves(errs))
    assert worst < 1e-4, errs
    # every parameter gets a gradient (the router's comes through the combine weights)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(gl_p))
    # dead expert: zero gradient for its weights; the others do get one
    if cfg.moe.top_k < cfg.moe.num_experts:
        assert float(jnp.max(jnp.abs(gl_p["w_gate"][DEAD_EXPERT]))) == 0.0


# ----------------------------------------------------------------------------- FLOPs


def _moe_flops_fns(num_experts, n_tokens=256):
    cfg = load_config("tiny", [f"model.moe.num_experts={num_experts}", "model.moe.top_k=2", "model.hidden_size=32",
                               "model.moe.latent_dim=32", "model.moe.expert_dim=128",
                               "model.moe.num_shared_experts=1"]).model
    with nnx.use_eager_sharding(False):
        layer = LatentMoE(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    x = jnp.zeros((1, n_tokens, cfg.hidden_size), jnp.float32)

    def sparse(pure, x):
        p = nnx.State(params)
        nnx.replace_by_pure_dict(p, pure)
        return _y(nnx.merge(graphdef, p, rest)(x))

    def dense(pure, x):
        return dense_moe(pure, x, jnp.zeros(num_experts), cfg)

    router_flops = 2 * n_tokens * cfg.hidden_size * num_experts
    return sparse, dense, (pure, x), router_flops


def _logical_matmul_flops(jaxpr, platform: str) -> int:
    """2 * (output elements) * (contracted size) for every dot_general / ragged_dot_general, recursively,
    in the program lowered for ``platform`` (of a ``lax.platform_dependent`` choice only that
    platform's branch): the FLOPs the program asks for, whatever a backend's lowering does with them."""
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            dims = (eqn.params["dimension_numbers"] if name == "dot_general"
                    else eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers)
            (lhs_contract, _), _ = dims
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
        if eqn.params.get("branches_platforms") is not None:  # platform_dependent: one branch is lowered
            chosen = next(i for i, ps in enumerate(eqn.params["branches_platforms"]) if ps is None or platform in ps)
            subs = [eqn.params["branches"][chosen].jaxpr]
        else:
            subs = sub_jaxprs(eqn)
        total += sum(_logical_matmul_flops(sub, platform) for sub in subs)
    return total


def test_logical_flops_scale_with_top_k_not_num_experts():
    """The TPU / GPU program (ragged_dot) asks for the routed FLOPs exactly: only the router grows with E."""
    counts = {}
    for e in (8, 64):
        sparse, dense, args, router = _moe_flops_fns(e)
        counts[e] = (_logical_matmul_flops(jax.make_jaxpr(sparse)(*args).jaxpr, "tpu"),
                     _logical_matmul_flops(jax.make_jaxpr(dense)(*args).jaxpr, "tpu"), router)
    (s8, d8, r8), (s64, d64, r64) = counts[8], counts[64]
    assert s64 - s8 == r64 - r8  # only the router grows
    assert d64 > 5 * d8  # while the dense formulation grows with E (sanity check of the counter)


def test_compiled_flops_scale_with_top_k_not_num_experts():
    """XLA:CPU's cost analysis of the compiled layer: the tiled experts cost about the routed FLOPs
    (tokens x k, up to the padding of each expert's last tile), not tokens x E as jax's dense lowering
    of ragged_dot would."""
    flops = {}
    for e in (8, 64):
        sparse, dense, args, router = _moe_flops_fns(e)

        def cost(fn):
            ca = jax.jit(fn).lower(*args).compile().cost_analysis()
            return (ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"]

        routed = _logical_matmul_flops(jax.make_jaxpr(sparse)(*args).jaxpr, "tpu")  # tokens x k
        flops[e] = (cost(sparse), cost(dense), routed)
    (s8, d8, t8), (s64, d64, t64) = flops[8], flops[64]
    assert d64 > 4 * d8  # the dense formulation grows ~E
    for s, t in ((s8, t8), (s64, t64)):  # compiled = routed matmuls + padding + elementwise work
        assert s < 2 * t, (s, t)
    assert s64 < 0.1 * d64, (s64, d64)

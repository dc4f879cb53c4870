"""Quantile Balancing (docs/design.md "Stable LatentMoE and Quantile Balancing"): the bias rule against a
direct NumPy computation, the histogram estimator, pooling, expert loads, convergence of a skewed
router, and the bias update keyed by layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import quantile_balancing as qb
from k3jax.ops.moe import sigmoid_topk_route


def _numpy_new_bias(scores: np.ndarray, bias: np.ndarray, mask: np.ndarray, top_k: int) -> np.ndarray:
    """The rule written out: alpha_i = (k+1)-th largest biased score of token i; the new bias of expert
    j is minus the (q+1)-th largest margin s_ij - alpha_i over real tokens, q = floor(m k / n); centred."""
    s = scores[mask].astype(np.float64)
    m, n = s.shape
    alpha = np.sort(s + bias, axis=1)[:, ::-1][:, top_k]
    margins = s - alpha[:, None]
    q = (m * top_k) // n
    b = np.array([-np.sort(margins[:, j])[::-1][q] for j in range(n)])
    return b - b.mean()


def _route_stats(logits, bias, top_k, mask=None, method="exact", num_bins=256):
    route = sigmoid_topk_route(jnp.asarray(logits), jnp.asarray(bias), top_k)
    st = qb.router_statistics(route.scores, route.threshold, jnp.asarray(bias),
                              None if mask is None else jnp.asarray(mask), method=method, num_bins=num_bins)
    return route, st


@pytest.mark.parametrize("m,n,top_k", [(64, 8, 2), (37, 16, 3), (5, 4, 1), (200, 6, 5)])
def test_exact_rule_matches_numpy(m, n, top_k):
    rng = np.random.default_rng(m * n + top_k)
    logits = rng.normal(size=(m, n)).astype(np.float32) * 2 + np.linspace(-1, 1, n, dtype=np.float32)
    bias = rng.normal(size=(n,)).astype(np.float32) * 0.1
    mask = rng.random(m) > 0.2
    mask[0] = True
    route, st = _route_stats(logits, bias, top_k, mask)
    got = np.asarray(qb.new_bias(st, top_k))
    want = _numpy_new_bias(np.asarray(route.scores), bias, mask, top_k)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert float(st.num_tokens) == mask.sum()


def test_padding_changes_nothing():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(48, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    mask = np.arange(48) < 30
    _, st_masked = _route_stats(logits, bias, 2, mask)
    _, st_real = _route_stats(logits[:30], bias, 2)
    np.testing.assert_array_equal(qb.new_bias(st_masked, 2), qb.new_bias(st_real, 2))


@pytest.mark.parametrize("method", ["exact", "histogram"])
def test_pooled_micro_batches_equal_the_whole_batch(method):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(96, 8)).astype(np.float32)
    bias = rng.normal(size=(8,)).astype(np.float32) * 0.05
    _, whole = _route_stats(logits, bias, 2, method=method)
    parts = [_route_stats(logits[i:i + 32], bias, 2, method=method)[1] for i in (0, 32, 64)]
    pooled = qb.pool(jax.tree.map(lambda *xs: jnp.stack(xs), *parts))  # micro-batches on a leading axis
    np.testing.assert_allclose(qb.new_bias(pooled, 2), qb.new_bias(whole, 2), atol=1e-6)


def test_histogram_is_within_one_bin_of_exact():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(512, 16)).astype(np.float32) * 1.5
    bias = rng.normal(size=(16,)).astype(np.float32) * 0.2
    num_bins = 512
    _, exact = _route_stats(logits, bias, 4)
    _, hist = _route_stats(logits, bias, 4, method="histogram", num_bins=num_bins)
    width = float(hist.high - hist.low) / num_bins
    # Centring moves both by a mean of per-expert errors, so allow two bin widths.
    np.testing.assert_allclose(qb.new_bias(hist, 4), qb.new_bias(exact, 4), atol=2 * width)


@pytest.mark.parametrize("method", ["exact", "histogram"])
def test_expert_load_counts_the_routed_tokens(method):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(300, 8)).astype(np.float32) + np.arange(8, dtype=np.float32) * 0.3
    bias = rng.normal(size=(8,)).astype(np.float32) * 0.1
    mask = rng.random(300) > 0.1
    route, st = _route_stats(logits, bias, 2, mask, method=method, num_bins=1024)
    want = np.bincount(np.asarray(route.experts)[mask].ravel(), minlength=8)
    np.testing.assert_array_equal(st.load, want)
    assert float(jnp.sum(st.load)) == 2 * mask.sum()


@pytest.mark.parametrize("method", ["exact", "histogram"])
def test_skewed_router_converges_to_balanced_within_a_few_steps(method):
    """A router whose logits strongly favour a few experts: each step routes fresh tokens from the same
    distribution with the current bias, then replaces the bias. The busiest expert goes from ~4x its
    fair share to within 20% of it in four steps."""
    n, top_k, m, d = 16, 2, 4096, 32
    rng = np.random.default_rng(4)
    w = rng.normal(size=(d, n)).astype(np.float32) * 0.5
    skew = np.where(np.arange(n) < 2, 3.0, -1.0).astype(np.float32)  # experts 0, 1 favoured
    bias = np.zeros(n, np.float32)
    history = []
    for _ in range(8):
        logits = rng.normal(size=(m, d)).astype(np.float32) @ w + skew
        _, st = _route_stats(logits, bias, top_k, method=method, num_bins=1024)
        history.append(float(qb.load_imbalance(st)))
        bias = np.asarray(qb.new_bias(st, top_k))
    assert history[0] > 3.5, history
    assert max(history[4:]) < 1.2, history  # the rest is sampling noise of fresh tokens (~1.1)


def test_update_bias_of_stacked_layers():
    """``update_bias`` stacks one statistics entry per scanned group and vmaps the rule over them."""
    from k3jax.layers.initializers import RouterBias

    bias = RouterBias(jnp.zeros((3, 8), jnp.float32))  # a slot of 3 scanned groups
    rng = np.random.default_rng(5)
    per_layer = [_route_stats(rng.normal(size=(64, 8)).astype(np.float32), np.zeros(8, np.float32), 2)[1]
                 for _ in range(3)]
    qb.update_bias(bias, per_layer, 2)
    np.testing.assert_allclose(bias[...], np.stack([qb.new_bias(s, 2) for s in per_layer]), atol=1e-7)


@pytest.mark.usefixtures("fast_xla_test")  # compiles the tiny model's forward; checks values only
def test_apply_keys_statistics_by_layer():
    """``model.forward`` keys the statistics by layer index and ``apply`` puts each layer's new bias
    where the layer plan keeps it (unrolled layers and stacked slices of the scanned groups)."""
    from flax import nnx

    from k3jax import create_model, load_config

    model = create_model(load_config("tiny").model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)
    stats = nnx.jit(lambda m, t: m.forward(t)[2])(model, tokens)  # op by op: 30 s
    assert sorted(stats.router) == [i for i in range(model.cfg.num_layers) if model.cfg.ffn(i) == "moe"]
    top_k = model.cfg.moe.top_k
    qb.apply(model, stats.router, top_k)
    for i in stats.router:
        path, index = model.plan.locate(i)
        layer = model
        for p in path:
            layer = layer[p] if isinstance(p, int) else getattr(layer, p)
        np.testing.assert_allclose(layer.ffn.router_bias[...][index], qb.new_bias(stats.router[i], top_k), atol=1e-7)

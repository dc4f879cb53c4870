"""causal_conv1d: numpy loop, torch Conv1d, segments, decode state carry."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from k3jax.ops import causal_conv1d

_conv = jax.jit(causal_conv1d, static_argnames=("output_final_state",))  # one compile per shape


def numpy_conv(x, w, segment_ids=None, init=None):
    """float64 loop: y_t = sum_w w[w] x_{t-(W-1)+w}, other-segment inputs and missing history are 0."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    B, T, C = x.shape
    W = w.shape[0]
    y = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            for i in range(W):
                s = t - (W - 1) + i
                if segment_ids is not None and any(
                    segment_ids[b, r] != segment_ids[b, r - 1] for r in range(max(s, 0) + 1, t + 1)
                ):
                    continue  # a reset lies between s and t
                if s >= 0:
                    y[b, t] += w[i] * x[b, s]
                elif init is not None:
                    y[b, t] += w[i] * np.asarray(init, np.float64)[b, (W - 1) + s]
    return y


def make(seed, B, T, C, W):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, T, C)).astype(np.float32), rng.standard_normal((W, C)).astype(np.float32)


SEG = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 0, 0, 3], [5] * 12 + [6]])  # recurring id 0 is a new document


@pytest.mark.parametrize("W", [1, 2, 4])
def test_matches_numpy_and_torch(W):
    x, w = make(W, 2, 13, 6, W)
    y, state = _conv(jnp.asarray(x), jnp.asarray(w))
    assert y.shape == x.shape and y.dtype == jnp.float32 and state is None
    np.testing.assert_allclose(y, numpy_conv(x, w), rtol=1e-5, atol=1e-6)
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.conv1d(
        torch.tensor(x).transpose(1, 2), torch.tensor(w.T[:, None, :]), groups=6, padding=W - 1
    )[..., :13].transpose(1, 2)
    np.testing.assert_allclose(y, ref.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("W", [2, 4])
def test_segments_and_initial_state(W):
    x, w = make(10 + W, 2, 13, 5, W)
    init = np.random.default_rng(0).standard_normal((2, W - 1, 5)).astype(np.float32)
    y, _ = _conv(jnp.asarray(x), jnp.asarray(w), segment_ids=jnp.asarray(SEG), initial_state=jnp.asarray(init))
    ref = numpy_conv(x, w, SEG, init)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert np.abs(ref - numpy_conv(x, w, None, init)).max() > 0.1  # the segments do change the result
    # a document alone (zero history) gives its packed output
    np.testing.assert_allclose(y[0, 5:10], numpy_conv(x[:1, 5:10], w)[0], rtol=1e-5, atol=1e-6)


class CarryTest(chex.TestCase):
    """Decode-style carry: final_state of the first part is the initial_state of the second, traced
    under ``jit`` and run op by op (chex variants).

    A call never starts with a reset, so with segments only the rows whose cut lies inside a segment
    must match. cut=6 and cut=11 come right after a reset (at 5 and 10), so the carried window
    spans two documents and its older entries must have been zeroed; cut=2 is shorter than W-1.
    """

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(cut=(2, 6, 11), use_segments=(False, True))
    def test_two_halves_with_state_equal_whole(self, cut, use_segments):
        W = 4
        conv = self.variant(causal_conv1d, static_argnames=("output_final_state",))
        x, w = make(20 + cut, 2, 13, 5, W)
        seg = jnp.asarray(SEG) if use_segments else None
        init = np.random.default_rng(1).standard_normal((2, W - 1, 5)).astype(np.float32)
        y, s = conv(jnp.asarray(x), jnp.asarray(w), segment_ids=seg, initial_state=jnp.asarray(init),
                    output_final_state=True)
        parts = []
        state = jnp.asarray(init)
        for lo, hi in ((0, cut), (cut, 13)):
            seg_part = None if seg is None else seg[:, lo:hi]
            y_p, state = conv(jnp.asarray(x[:, lo:hi]), jnp.asarray(w), segment_ids=seg_part, initial_state=state,
                              output_final_state=True)
            chex.assert_shape((y_p, state), ((2, hi - lo, 5), (2, W - 1, 5)))
            parts.append(y_p)
        rows = (SEG[:, cut] == SEG[:, cut - 1]) if use_segments else np.ones(2, bool)
        assert rows.any()
        chex.assert_trees_all_close(np.concatenate(parts, 1)[rows], np.asarray(y)[rows], rtol=1e-6, atol=1e-6)
        chex.assert_trees_all_equal(state, s)


def test_final_state_contents():
    W, C = 4, 3
    x, w = make(30, 1, 2, C, W)  # T=2 < W-1: the state keeps one initial input
    init = np.arange(3 * C, dtype=np.float32).reshape(1, 3, C)
    _, s = _conv(jnp.asarray(x), jnp.asarray(w), initial_state=jnp.asarray(init), output_final_state=True)
    np.testing.assert_array_equal(s, np.concatenate([init[:, 2:], x], 1))
    _, s0 = _conv(jnp.asarray(x), jnp.asarray(w), output_final_state=True)
    np.testing.assert_array_equal(s0, np.concatenate([np.zeros((1, 1, C), np.float32), x], 1))
    # a reset at the last token: older inputs belong to another document and are zeroed
    x5, _ = make(31, 1, 5, C, W)
    _, s5 = _conv(jnp.asarray(x5), jnp.asarray(w), segment_ids=jnp.asarray([[0, 0, 0, 0, 1]]),
                          output_final_state=True)
    np.testing.assert_array_equal(s5, np.concatenate([np.zeros((1, 2, C), np.float32), x5[:, 4:]], 1))
    _, s1 = _conv(jnp.asarray(x5), jnp.asarray(w[:1]), output_final_state=True)
    assert s1.shape == (1, 0, C)


def test_bf16():
    x, w = make(40, 2, 13, 8, 4)
    xb = jnp.asarray(x, jnp.bfloat16)
    y, s = _conv(xb, jnp.asarray(w, jnp.bfloat16), segment_ids=jnp.asarray(SEG), output_final_state=True)
    assert y.dtype == jnp.bfloat16 and s.dtype == jnp.bfloat16
    # fp32 products of the bf16 values, summed in fp32: only the final bf16 rounding (rel. 2**-9) remains
    ref = numpy_conv(np.asarray(xb, np.float32), np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32), SEG)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2**-8, atol=1e-6)


def test_bad_inputs_raise():
    x, w = make(50, 1, 5, 3, 4)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w[:, :2])
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=np.zeros((1, 2, 3), np.float32))
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=np.zeros((1, 3, 3), np.float16))
    with pytest.raises(ValueError, match="segment_ids"):
        causal_conv1d(x, w, segment_ids=np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="x must"):
        causal_conv1d(x[0], w)

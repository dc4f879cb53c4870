"""Pallas chunkwise KDA (interpret mode on CPU) against the pure-JAX reference ``k3jax.ops.chunk_kda``.

Errors are fla's metric: RMSE(out - ref) / RMS(ref). Tolerances:

- fp32 inputs: the kernel and the reference do the same fp32 algebra in a different order (anchored
  16-token tiles, a doubling-based triangular inverse instead of a substitution), so they differ by
  rounding only: a few dozen roundings of eps = 6e-8 per output. 1e-5 (the reference's own fp32 vs
  float64 bound) leaves a 10x margin over the measured ~3e-7 (dense) / ~2e-6 (exact, softplus gate).
- bf16 inputs: compared with the fp32 reference run on the same (bf16-valued) inputs. The kernel feeds
  the MXU bf16 operands (unit roundoff u = 2^-9 ~ 2e-3) in ~3 chained products per output and rounds
  o to bf16 (alone ~1.7e-3 RMS here), so ~3u ~ 6e-3 is expected: 8e-3 for o and the state (fla
  allows 5e-3 for its own bf16 kernel against fp32), 2e-2 for the gradients (fla: dq/dk/dv 8e-3, dg
  and dbeta 2e-2; dg sums many products and measured 1.1e-2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import chunk_kda as ref_chunk_kda
from pallas_kernels.kda import chunk_kda

# kernel and reference compiled without XLA's optimisation passes (values are compared, not programs);
# float32 matmuls at full precision on every backend
pytestmark = pytest.mark.usefixtures("fast_xla")

FP32_TOL = 1e-5
BF16_TOL = 8e-3
BF16_GRAD_TOL = 2e-2


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((out - ref) ** 2)) / (np.sqrt(np.mean(ref**2)) + 1e-8))


def make_inputs(seed, B, T, H, K, V, dtype=jnp.float32, gate="lower_bound"):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    z = 2.0 * jax.random.normal(ks[3], (B, T, H, K))
    if gate == "lower_bound":  # K3: g in (-5, 0)
        g = -5.0 * jax.nn.sigmoid(z)
    else:  # Kimi Linear softplus gate with large A_log: steps far below -5 (down to about -60)
        g = -jnp.exp(1.5) * jax.nn.softplus(3.0 * z)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    h0 = 0.5 * jax.random.normal(ks[5], (B, H, K, V))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, h0


def make_segments(seed, B, T, p=0.06):
    return jnp.asarray(np.cumsum(np.random.RandomState(seed).rand(B, T) < p, axis=1), jnp.int32)


def up(x):
    return x.astype(jnp.float32)


def run_both(q, k, v, g, beta, h0, *, chunk_size, segment_ids=None, **kw):
    o, S = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=chunk_size,
                                        segment_ids=segment_ids, **kw))(q, k, v, g, beta, h0)
    o_ref, S_ref = jax.jit(lambda *a: ref_chunk_kda(*a[:5], initial_state=a[5], output_final_state=True,
                                                    chunk_size=chunk_size, segment_ids=segment_ids))(
        up(q), up(k), up(v), g, beta, h0)
    return o, S, o_ref, S_ref


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "B,T,H,K,V,chunk,gate,safe",
    [
        (1, 70, 2, 128, 128, 64, "lower_bound", True),  # lane-aligned heads-last layout, 4 sub-tiles, T % C != 0
        (1, 40, 2, 16, 16, 32, "softplus", False),  # exact per-pair diagonal tiles, g down to ~-60
        (1, 1, 2, 16, 16, 64, "lower_bound", True),  # T = 1
        pytest.param(2, 80, 1, 16, 32, 64, "lower_bound", True, marks=pytest.mark.slow),
    ],
)
def test_forward_fp32(B, T, H, K, V, chunk, gate, safe):
    q, k, v, g, beta, h0 = make_inputs(0, B, T, H, K, V, gate=gate)
    o, S, o_ref, S_ref = run_both(q, k, v, g, beta, h0, chunk_size=chunk, safe_gate=safe)
    assert o.shape == o_ref.shape and o.dtype == v.dtype and S.dtype == jnp.float32
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(S, S_ref) < FP32_TOL


def test_forward_segments_and_initial_state():
    B, T, H, K, V = 2, 70, 2, 16, 32  # head-major layout (K, V not multiples of 128), 3 chunks of 32
    q, k, v, g, beta, h0 = make_inputs(1, B, T, H, K, V)
    seg = make_segments(1, B, T)
    seg = seg.at[:, 32].set(seg[:, 31] + 1)  # a reset exactly at a chunk boundary too
    o, S, o_ref, S_ref = run_both(q, k, v, g, beta, h0, chunk_size=32, segment_ids=seg, safe_gate=True)
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(S, S_ref) < FP32_TOL


def test_forward_gate_choice_at_run_time():
    """safe_gate=None picks dense tiles for the K3 gate and exact tiles for a strong softplus gate."""
    kw = dict(output_final_state=True, chunk_size=32)
    f = jax.jit(lambda *a: chunk_kda(*a[:5], initial_state=a[5], safe_gate=None, **kw))
    f_ref = jax.jit(lambda *a: ref_chunk_kda(*a[:5], initial_state=a[5], **kw))
    for gate in ("lower_bound", "softplus"):  # same shapes: one compile each
        inputs = make_inputs(2, 1, 40, 1, 16, 16, gate=gate)
        (o, S), (o_ref, S_ref) = f(*inputs), f_ref(*inputs)
        assert np.all(np.isfinite(np.asarray(o)))
        assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


def test_forward_bf16():
    q, k, v, g, beta, h0 = make_inputs(3, 1, 70, 2, 128, 128, dtype=jnp.bfloat16)
    o, S, o_ref, S_ref = run_both(q, k, v, g, beta, h0, chunk_size=64, segment_ids=make_segments(3, 1, 70),
                                  safe_gate=True)
    assert o.dtype == jnp.bfloat16
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(S, S_ref) < BF16_TOL


def test_no_future_token_leakage():
    """Changing tokens after t0 leaves o[:t0+1] bit-identical (anchors come from the causal past only)."""
    B, T, H, K, V, t0 = 1, 64, 1, 16, 16, 20
    q, k, v, g, beta, h0 = make_inputs(4, B, T, H, K, V)
    q2, k2, v2, g2, beta2, _ = make_inputs(5, B, T, H, K, V)
    later = (jnp.arange(T) > t0)[None, :, None, None]
    mix = lambda a, b: jnp.where(later if a.ndim == 4 else later[..., 0], b, a)
    f = jax.jit(lambda *a: chunk_kda(*a, initial_state=h0, chunk_size=64, safe_gate=True)[0])
    o1 = f(q, k, v, g, beta)
    o2 = f(mix(q, q2), mix(k, k2), mix(v, v2), mix(g, 1.5 * g2), mix(beta, beta2))
    np.testing.assert_array_equal(np.asarray(o1[:, :t0 + 1]), np.asarray(o2[:, :t0 + 1]))
    assert not np.array_equal(np.asarray(o1[:, t0 + 1:]), np.asarray(o2[:, t0 + 1:]))


def test_tpu_semantics_interpreter():
    """The TPU interpreter (NaN-filled uninitialised VMEM, out-of-bounds reads raise) agrees too."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, g, beta, h0 = make_inputs(6, 1, 40, 1, 16, 16)
    params = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")
    o, S, o_ref, S_ref = run_both(q, k, v, g, beta, h0, chunk_size=32, safe_gate=True, interpret=params)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(S, S_ref) < FP32_TOL


def test_api_contract():
    q, k, v, g, beta, _ = make_inputs(7, 1, 20, 1, 16, 16)
    o, S = chunk_kda(q, k, v, g, beta, chunk_size=32, safe_gate=True)
    assert S is None and o.shape == v.shape
    with pytest.raises(ValueError, match="multiple of 16"):
        chunk_kda(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError):
        chunk_kda(q, k, v[:, :10], g, beta)


# ----------------------------------------------------------------------------- gradients


def grads(fn, inputs, segment_ids, chunk_size, seed=11, **kw):
    q, k, v, g, beta, h0 = inputs
    kk = jax.random.split(jax.random.PRNGKey(seed))
    do = jax.random.normal(kk[0], v.shape)
    dS = jax.random.normal(kk[1], h0.shape)

    def loss(q, k, v, g, beta, h0):
        o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size,
                  segment_ids=segment_ids, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(S * dS)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, h0)


NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def check_grads(inputs, segment_ids, chunk_size, tol, **kw):
    got = grads(chunk_kda, inputs, segment_ids, chunk_size, **kw)
    q, k, v, g, beta, h0 = inputs
    want = grads(ref_chunk_kda, (up(q), up(k), up(v), g, beta, h0), segment_ids, chunk_size)
    errs = {n: rel_err(a, b) for n, a, b in zip(NAMES, got, want)}
    for (n, e), x, a in zip(errs.items(), inputs, got):
        assert a.shape == x.shape and a.dtype == x.dtype, n
    assert all(e < tol for e in errs.values()), errs


def test_grads_fp32_segments_initial_state():
    """All six gradients through the Pallas backward kernel, T % chunk != 0, resets, h0, heads-last."""
    B, T, H, K, V = 1, 40, 1, 128, 128
    inputs = make_inputs(8, B, T, H, K, V)
    check_grads(inputs, make_segments(8, B, T, p=0.05), 32, FP32_TOL, safe_gate=True)


@pytest.mark.slow
def test_grads_fp32_exact_tiles():
    inputs = make_inputs(9, 1, 40, 2, 16, 16, gate="softplus")
    check_grads(inputs, None, 32, FP32_TOL, safe_gate=False)


@pytest.mark.slow
def test_grads_bf16():
    inputs = make_inputs(10, 1, 70, 1, 128, 128, dtype=jnp.bfloat16)
    check_grads(inputs, make_segments(10, 1, 70), 64, BF16_GRAD_TOL, safe_gate=True)


@pytest.mark.slow
def test_grads_t1_and_xla_backward_option():
    inputs = make_inputs(12, 1, 1, 2, 16, 16)
    check_grads(inputs, None, 64, FP32_TOL, safe_gate=True)
    inputs = make_inputs(13, 1, 40, 2, 16, 16)
    check_grads(inputs, make_segments(13, 1, 40), 32, FP32_TOL, safe_gate=True, backward="xla")

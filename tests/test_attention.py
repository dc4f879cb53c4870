"""Query/key-chunked attention (``chunked_attention``) against the plain masked softmax
(``attention`` over ``attention_mask``): odd shapes, one token, packed documents, causal with a cache
offset and left padding, the shared-key (absorbed MLA) form, gradients, and the memory bound (no
intermediate as large as the ``[B, H, T, S]`` scores)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprs import equations
from k3jax.ops import attention as attn_ops

pytestmark = pytest.mark.usefixtures("fast_xla")

# jitted: eagerly, every primitive inside the loops would compile on its own
chunked_attention = jax.jit(attn_ops.chunked_attention, static_argnames=("scale", "q_chunk", "kv_chunk"))
B, H, D, DV = 2, 3, 8, 5
TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(t, s, *, shared_kv=False, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    hk = 1 if shared_kv else H
    q = jax.random.normal(kq, (B, t, H, D), dtype)
    k = jax.random.normal(kk, (B, s, hk, D), dtype)
    v = jax.random.normal(kv, (B, s, hk, DV), dtype)
    return q, k, v


@functools.partial(jax.jit, static_argnames=("scale",))
def _plain(q, k, v, q_index, kv_index, *, scale, q_segment_ids=None, kv_segment_ids=None, kv_valid=None):
    mask = attn_ops.attention_mask(q_index, kv_index, q_segment_ids, kv_segment_ids, kv_valid)
    return attn_ops.attention(q, k, v, mask, scale=scale)


def _arange(b, n, offset=0):
    return jnp.broadcast_to(offset + jnp.arange(n, dtype=jnp.int32), (b, n))


def _packed_segments(t):
    """Two rows of packed documents, the second ending in padding (segment id 0)."""
    a = np.repeat([1, 2, 3], [5, 1, t - 6])
    b = np.concatenate([np.repeat([1, 2], [3, t - 6]), np.zeros(3, int)])
    return jnp.asarray(np.stack([a, b]), jnp.int32)


@pytest.mark.parametrize("t,q_chunk,kv_chunk", [
    (13, 4, 5),    # T a multiple of neither chunk
    (16, 4, 4),    # exact multiples, aligned blocks (whole blocks skipped by the causal cond)
    (7, 16, 3),    # one query block, several key blocks
    (13, 3, 64),   # several query blocks, one key block
    (1, 4, 4),     # one token
    (9, 9, 9),     # exactly one block: no loop at all
])
def test_causal_matches_plain(t, q_chunk, kv_chunk):
    q, k, v = _inputs(t, t)
    idx = _arange(B, t)
    scale = 1 / math.sqrt(D)
    out = chunked_attention(q, k, v, idx, idx, scale=scale, q_chunk=q_chunk, kv_chunk=kv_chunk)
    assert out.shape == (B, t, H, DV) and out.dtype == v.dtype
    np.testing.assert_allclose(out, _plain(q, k, v, idx, idx, scale=scale), **TOL)


def test_default_chunks_long_sequence():
    """The default block sizes the MLA layer uses, on a sequence longer than both (and a multiple of
    neither): several query blocks, several key blocks, causal blocks skipped."""
    t = attn_ops.KV_CHUNK + attn_ops.Q_CHUNK // 2 + 3
    kq, kk, kv = jax.random.split(jax.random.key(11), 3)
    q, k = jax.random.normal(kq, (1, t, 2, 4)), jax.random.normal(kk, (1, t, 1, 4))  # shared key
    v = jax.random.normal(kv, (1, t, 1, 3))
    idx = _arange(1, t)
    out = chunked_attention(q, k, v, idx, idx, scale=0.5)
    np.testing.assert_allclose(out, _plain(q, k, v, idx, idx, scale=0.5), **TOL)


def test_packed_segments():
    t = 14
    q, k, v = _inputs(t, t, seed=1)
    seg = _packed_segments(t)
    # positions restart per document, as the model passes them; the mask only needs them monotone
    idx = _arange(B, t)
    kw = dict(scale=0.3, q_segment_ids=seg, kv_segment_ids=seg)
    out = chunked_attention(q, k, v, idx, idx, q_chunk=4, kv_chunk=3, **kw)
    ref = _plain(q, k, v, idx, idx, **kw)
    np.testing.assert_allclose(out, ref, **TOL)
    # padding queries see only padding keys: finite, and equal to the plain path
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("shared_kv", [False, True])
def test_cache_offset_left_padding(t, shared_kv):
    """Prefill continuation / decode: T new queries at slots [offset, offset + T) of an S-slot cache
    whose later slots are unwritten and whose first slots are left padding of row 0."""
    s, offset = 19, 7
    q, k, v = _inputs(t, s, shared_kv=shared_kv, seed=2)
    q_index, kv_index = _arange(B, t, offset), _arange(B, s)
    written = kv_index < offset + t
    left_pad = jnp.asarray([[True] * 3 + [False] * (s - 3), [False] * s])
    kv_valid = written & ~left_pad
    kw = dict(scale=0.25, kv_valid=kv_valid)
    out = chunked_attention(q, k, v, q_index, kv_index, q_chunk=2, kv_chunk=4, **kw)
    np.testing.assert_allclose(out, _plain(q, k, v, q_index, kv_index, **kw), **TOL)


def test_row_without_visible_keys_is_zero():
    t = 6
    q, k, v = _inputs(t, t, seed=3)
    idx = _arange(B, t)
    kv_valid = jnp.asarray([[True] * t, [False] * t])
    out = chunked_attention(q, k, v, idx, idx, scale=0.5, kv_valid=kv_valid, q_chunk=4, kv_chunk=4)
    np.testing.assert_allclose(out, _plain(q, k, v, idx, idx, scale=0.5, kv_valid=kv_valid), **TOL)
    assert np.all(np.asarray(out[1]) == 0)


@pytest.mark.parametrize("shared_kv", [False, True])
def test_gradients_match_plain(shared_kv):
    t = 13
    q, k, v = _inputs(t, t, shared_kv=shared_kv, seed=4)
    seg = _packed_segments(t)
    idx = _arange(B, t)
    w = jax.random.normal(jax.random.key(9), (B, t, H, DV))
    kw = dict(scale=0.4, q_segment_ids=seg, kv_segment_ids=seg)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, idx, idx, **kw) * w)

    chunked = functools.partial(attn_ops.chunked_attention, q_chunk=4, kv_chunk=5)
    got = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(functools.partial(loss, _plain), argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_plain():
    t = 11
    q, k, v = _inputs(t, t, seed=5, dtype=jnp.bfloat16)
    idx = _arange(B, t)
    out = chunked_attention(q, k, v, idx, idx, scale=0.35, q_chunk=4, kv_chunk=4)
    assert out.dtype == jnp.bfloat16
    ref = _plain(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), idx, idx, scale=0.35)
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)


def _largest_intermediate(jaxpr) -> int:
    """Elements of the largest value any equation produces, nested jaxprs (scan, cond, remat) included."""
    return max(math.prod(getattr(v.aval, "shape", ())) for eqn, _ in equations(jaxpr) for v in eqn.outvars)


def test_memory_bounded():
    """Neither the forward nor the backward pass creates anything of the size of the scores."""
    t, chunk = 64, 8
    q, k, v = _inputs(t, t, seed=6)
    idx = _arange(B, t)
    full_scores = B * H * t * t

    def fwd(q, k, v):
        return attn_ops.chunked_attention(q, k, v, idx, idx, scale=0.3, q_chunk=chunk, kv_chunk=chunk)

    def grad(q, k, v):
        return jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=(0, 1, 2))(q, k, v)

    fwd_peak = _largest_intermediate(jax.make_jaxpr(fwd)(q, k, v).jaxpr)
    bwd_peak = _largest_intermediate(jax.make_jaxpr(grad)(q, k, v).jaxpr)
    inputs = B * t * H * max(D, DV)  # q, k, v and the output, blocked or not
    assert fwd_peak <= max(inputs, B * H * chunk * chunk), fwd_peak  # one block's scores
    assert bwd_peak <= max(inputs, B * H * chunk * t), bwd_peak  # one query block's scores over all keys
    assert max(fwd_peak, bwd_peak) < full_scores
    # and the plain path does materialise them (the check has teeth)
    plain = _plain.__wrapped__
    plain_peak = _largest_intermediate(jax.make_jaxpr(lambda *a: plain(*a, idx, idx, scale=0.3))(q, k, v).jaxpr)
    assert plain_peak >= full_scores


def test_mla_layer_chunked_equals_single_block(monkeypatch):
    """The MLA call sites (latent training/prefill form and absorbed cached form) give the same output
    when their sequences are cut into many blocks as in one block."""
    from flax import nnx

    from k3jax.cache import layer_cache
    from k3jax.config import load_config
    from k3jax.layers import mla as mla_module

    cfg = load_config("tiny").model
    with nnx.use_eager_sharding(False):  # params carry logical axis names, no mesh here
        layer = mla_module.MLA(cfg, rngs=nnx.Rngs(0))
    t, slots = 13, 20
    x = jax.random.normal(jax.random.key(7), (B, t, cfg.hidden_size))
    seg = _packed_segments(t)
    positions = _arange(B, t)
    kv_valid = jnp.broadcast_to(jnp.arange(slots) < t, (B, slots))

    def run(layer):
        expanded, _ = layer(x, positions=positions, segment_ids=seg)
        cache = layer_cache(cfg, "mla", B, slots, jnp.float32)
        absorbed, _ = layer(x, positions=positions, cache=cache, cache_index=0, kv_valid=kv_valid)
        return expanded, absorbed

    one_block = nnx.jit(run)(layer)  # 13 tokens < Q_CHUNK: one block
    calls = []

    def small_blocks(*args, **kwargs):
        calls.append(args[0].shape)
        return attn_ops.chunked_attention(*args, **kwargs, q_chunk=4, kv_chunk=6)

    def small_latent_blocks(*args, **kwargs):
        calls.append(args[0].shape)
        return attn_ops.latent_attention(*args, **kwargs, q_chunk=4, kv_chunk=6)

    monkeypatch.setattr(mla_module, "chunked_attention", small_blocks)
    monkeypatch.setattr(mla_module, "latent_attention", small_latent_blocks)
    blocked = nnx.jit(run)(layer)
    assert len(calls) == 2  # the two call sites, each through its blockwise op
    for got, want in zip(blocked, one_block):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_shape_mismatches_fail_at_trace_time():
    """A wrong shape at the op's boundary is named there, not deep inside XLA's einsum."""
    q = jnp.zeros((2, 5, 4, 8))
    k, v = jnp.zeros((2, 7, 3, 8)), jnp.zeros((2, 7, 4, 6))  # 3 key heads for 4 query heads
    idx_q, idx_k = jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 7), jnp.int32)
    with pytest.raises(AssertionError, match="shape"):
        jax.jit(lambda k: attn_ops.chunked_attention(q, k, v, idx_q, idx_k, scale=1.0))(k)
    with pytest.raises(AssertionError, match="shape"):  # kv positions of the query length
        attn_ops.chunked_attention(q, v[..., :8], v, idx_q, idx_q, scale=1.0)
    with pytest.raises(AssertionError, match="shape"):
        attn_ops.attention(q, v[..., :8], v, jnp.ones((2, 5, 5), bool), scale=1.0)


# ---------------------------------------------------------------------------------------------
# latent_attention: keys and values expanded from a per-token latent one key block at a time

LATENT = 7  # per-token latent width: smaller than the H * (D + DV) = 39 expanded values


def _expand(kv, w):
    """kv ``[B, C, L]``, w ``[L, H, D + DV]`` -> keys ``[B, C, H, D]``, values ``[B, C, H, DV]``."""
    x = jnp.einsum("bcl,lhp->bchp", kv, w)
    return x[..., :D], x[..., D:]


def _latent_inputs(t, s, seed=0):
    kq, kkv, kw = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, t, H, D)), jax.random.normal(kkv, (B, s, LATENT)),
            jax.random.normal(kw, (LATENT, H, D + DV)) * 0.4)


@pytest.mark.parametrize("t,s,q_chunk,kv_chunk,packed", [
    (13, 13, 4, 5, True),    # T a multiple of neither chunk, packed documents and padding
    (16, 16, 4, 4, False),   # aligned blocks
    (5, 13, 2, 3, False),    # the queries are the last 5 of 13 positions (a sequence shard's view)
    (9, 9, 16, 16, True),    # one block
])
def test_latent_attention_matches_plain(t, s, q_chunk, kv_chunk, packed):
    """Output and gradients (q, latent, expansion weights) equal the plain softmax over the expanded keys."""
    q, kv, w = _latent_inputs(t, s, seed=t + s)
    q_index, kv_index = _arange(B, t, s - t), _arange(B, s)
    seg = _packed_segments(s) if packed else None
    q_seg = None if seg is None else seg[:, s - t:]

    def latent(q, kv, w):
        return attn_ops.latent_attention(q, kv, w, q_index, kv_index, expand=_expand, scale=0.4,
                                         q_segment_ids=q_seg, kv_segment_ids=seg, q_chunk=q_chunk, kv_chunk=kv_chunk)

    def plain(q, kv, w):
        k, v = _expand(kv, w)
        return _plain(q, k, v, q_index, kv_index, scale=0.4, q_segment_ids=q_seg, kv_segment_ids=seg)

    np.testing.assert_allclose(jax.jit(latent)(q, kv, w), plain(q, kv, w), **TOL)
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))  # noqa: E731
    for got, want in zip(loss(latent)(q, kv, w), loss(plain)(q, kv, w)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_latent_attention_never_expands_the_whole_sequence():
    """Forward and backward hold one key block's keys and values, never ``[B, S, H, D]``; key blocks after
    every query are not expanded at all (the causal skip a sequence shard relies on)."""
    t, s, chunk = 8, 64, 8
    q, kv, w = _latent_inputs(t, s, seed=3)
    q_index, kv_index = _arange(B, t), _arange(B, s)  # the queries are the first 8 positions
    expansions = []

    def counted_expand(kv, w):
        jax.debug.callback(lambda: expansions.append(1))
        return _expand(kv, w)

    def fwd(q, kv, w):
        return attn_ops.latent_attention(q, kv, w, q_index, kv_index, expand=counted_expand, scale=0.3,
                                         q_chunk=chunk, kv_chunk=chunk)

    grad = jax.grad(lambda *a: jnp.sum(fwd(*a)), argnums=(0, 1, 2))
    expanded_keys = B * s * H * D
    for f in (fwd, grad):
        assert _largest_intermediate(jax.make_jaxpr(f)(q, kv, w).jaxpr) < expanded_keys
    jax.block_until_ready(jax.jit(fwd)(q, kv, w))
    assert len(expansions) == 1  # of 8 key blocks, only the first holds a position <= 7
    expansions.clear()
    jax.block_until_ready(jax.jit(grad)(q, kv, w))
    assert len(expansions) == 2  # the forward's and the backward's


def test_latent_attention_in_a_scan_over_layers_masks_one_block_pair_at_a_time():
    """Differentiated inside a ``lax.scan`` over layers (the model's scanned groups), with the positions and
    segments loop-invariant: JAX hoists what depends on them alone out of the linearized loop, which once
    built every block pair's mask and padded scores at once (``[Nk, Nq, B, H, Cq, Ck]``, the size of the
    whole score matrix: full K3's 1M-token row, 1 TB per device). Output and gradients still match the
    plain attention."""
    t, chunk, layers = 64, 8, 2
    q, kv, w = _latent_inputs(t, t, seed=9)
    idx, seg = _arange(B, t), _packed_segments(t)
    ws = jnp.stack([w, w * 0.5])

    def stack(q, kv, ws, f):
        def layer(x, w):
            return x.at[..., :DV].add(f(x, kv, w)), None  # the next layer's queries
        return jnp.sum(jnp.sin(jax.lax.scan(layer, q, ws)[0]))

    def latent(x, kv, w):
        return attn_ops.latent_attention(x, kv, w, idx, idx, expand=_expand, scale=0.4, q_segment_ids=seg,
                                         kv_segment_ids=seg, q_chunk=chunk, kv_chunk=chunk)

    def plain(x, kv, w):
        return _plain(x, *_expand(kv, w), idx, idx, scale=0.4, q_segment_ids=seg, kv_segment_ids=seg)

    grad = lambda f: jax.grad(functools.partial(stack, f=f), argnums=(0, 1, 2))  # noqa: E731
    assert _largest_intermediate(jax.make_jaxpr(grad(latent))(q, kv, ws).jaxpr) < B * H * t * t
    for got, want in zip(jax.jit(grad(latent))(q, kv, ws), grad(plain)(q, kv, ws)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_latent_attention_rejects_half_the_segment_ids():
    q, kv, w = _latent_inputs(4, 4)
    idx = _arange(B, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        attn_ops.latent_attention(q, kv, w, idx, idx, expand=_expand, scale=1.0, q_segment_ids=idx)

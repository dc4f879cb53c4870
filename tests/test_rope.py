"""RoPE / YaRN against HF transformers' DeepSeek-V3 code, and the attention op against a numpy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import YarnConfig
from k3jax.ops.attention import attention, attention_mask
from k3jax.ops.rope import apply_rope as _apply_rope_eager
from k3jax.ops.rope import rope_frequencies, yarn_softmax_scale

torch = pytest.importorskip("torch")
ds3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
from transformers import DeepseekV3Config  # noqa: E402

# (rope_dim, theta, yarn) cases: K2's release, DeepSeek-V3's release, YaRN defaults, plain RoPE
CASES = {
    "k2": (64, 50000.0, YarnConfig(factor=32.0, original_max_position=4096, beta_fast=1.0, beta_slow=1.0,
                                   mscale=1.0, mscale_all_dim=1.0)),
    "deepseek_v3": (64, 10000.0, YarnConfig(factor=40.0, original_max_position=4096, beta_fast=32.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "mscale_ratio": (32, 10000.0, YarnConfig(factor=8.0, original_max_position=2048, beta_fast=32.0,
                                             beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)),
    "no_mscale_all_dim": (16, 10000.0, YarnConfig(factor=4.0, original_max_position=256, beta_fast=32.0,
                                                  beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)),
    "plain": (64, 10000.0, None),
}


def _hf_config(dim, theta, yarn):
    if yarn is None:
        rope = {"rope_type": "default", "rope_theta": theta}
    else:
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_position, "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim}
    max_pos = 131072 if yarn is None else int(yarn.factor * yarn.original_max_position)
    return DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=dim,
                            qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=8, q_lora_rank=16,
                            max_position_embeddings=max_pos, rope_parameters=rope, num_hidden_layers=1,
                            vocab_size=32, intermediate_size=16, moe_intermediate_size=8, n_routed_experts=4,
                            num_experts_per_tok=2, n_group=1, topk_group=1)


def _positions():
    rng = np.random.default_rng(0)
    pos = np.stack([np.arange(24), np.sort(rng.integers(0, 120000, 24))]).astype(np.int64)
    return pos  # [B=2, T=24]: small positions and long-context ones across the YaRN ramp


apply_rope = jax.jit(_apply_rope_eager, static_argnames=("interleave",))  # eager op-by-op is slower on CPU


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_match_hf(case):
    dim, theta, yarn = CASES[case]
    rotary = ds3.DeepseekV3RotaryEmbedding(_hf_config(dim, theta, yarn))
    inv_freq, factor = rope_frequencies(dim, theta, yarn)
    np.testing.assert_allclose(np.asarray(inv_freq), rotary.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    if yarn is not None and yarn.factor > 1:
        # the ramp really interpolates some frequencies and keeps others (so the test can see the ramp)
        plain, _ = rope_frequencies(dim, theta, None)
        ratio = np.asarray(plain) / np.asarray(inv_freq)
        assert ratio.min() == pytest.approx(1.0) and ratio.max() == pytest.approx(yarn.factor, rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_softmax_scale_matches_hf(case):
    dim, theta, yarn = CASES[case]
    cfg = _hf_config(dim, theta, yarn)
    qk_head_dim = 128 + dim
    expected = ds3.yarn_apply_mscale(cfg.rope_parameters, qk_head_dim ** -0.5)
    assert yarn_softmax_scale(qk_head_dim, yarn) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", ["k2", "mscale_ratio", "plain"])
def test_apply_rope_matches_hf(case, interleave):
    """The rotation itself, given HF's frequencies: the same float32 angles, so a tight tolerance even at
    long-context positions."""
    dim, theta, yarn = CASES[case]
    rotary = ds3.DeepseekV3RotaryEmbedding(_hf_config(dim, theta, yarn))
    pos = _positions()
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 24, 3, dim)).astype(np.float32)  # [B, T, H, R]
    k = rng.standard_normal((2, 24, 1, dim)).astype(np.float32)  # one shared rope key (MLA)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(pos))
    fn = ds3.apply_rotary_pos_emb_interleave if interleave else ds3.apply_rotary_pos_emb
    q_ref, k_ref = fn(torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2)
    inv_freq = jnp.asarray(rotary.inv_freq.numpy())
    for x, ref in ((q, q_ref), (k, k_ref)):
        out = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), inv_freq, rotary.attention_scaling, interleave)
        np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_rope_pipeline_matches_hf(case, interleave):
    """rope_frequencies + apply_rope against HF end to end. Both compute the frequencies in float32 and
    may differ by a few ulps, which moves an angle by ``pos * d_inv_freq``: the tolerance allows exactly
    that (at positions < 4096 it is ~1e-4 or less)."""
    dim, theta, yarn = CASES[case]
    rotary = ds3.DeepseekV3RotaryEmbedding(_hf_config(dim, theta, yarn))
    pos = np.stack([np.arange(24), np.arange(4000, 4096, 4)]).astype(np.int64)
    x = np.random.default_rng(6).standard_normal((2, 24, 2, dim)).astype(np.float32)
    cos, sin = rotary(torch.from_numpy(x), torch.from_numpy(pos))
    fn = ds3.apply_rotary_pos_emb_interleave if interleave else ds3.apply_rotary_pos_emb
    ref, _ = fn(torch.from_numpy(x), torch.from_numpy(x), cos, sin, unsqueeze_dim=2)
    inv_freq, factor = rope_frequencies(dim, theta, yarn)
    out = apply_rope(jnp.asarray(x), jnp.asarray(pos, jnp.int32), inv_freq, factor, interleave)
    d_angle = pos.max() * np.abs(np.asarray(inv_freq, np.float64) - rotary.inv_freq.numpy()).max()
    atol = 2e-5 + 2 * np.abs(x).max() * factor * d_angle
    assert atol < 1e-3
    np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=0, atol=atol)


def test_apply_rope_keeps_dtype_and_relative_positions():
    dim, theta, yarn = CASES["k2"]
    inv_freq, factor = rope_frequencies(dim, theta, yarn)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, dim)), jnp.float32)
    assert apply_rope(q.astype(jnp.bfloat16), jnp.zeros((1, 1), jnp.int32), inv_freq).dtype == jnp.bfloat16

    def dot(pq, pk, interleave):
        a = apply_rope(q, jnp.full((1, 1), pq, jnp.int32), inv_freq, factor, interleave)
        b = apply_rope(k, jnp.full((1, 1), pk, jnp.int32), inv_freq, factor, interleave)
        return float(jnp.sum(a * b))

    for interleave in (True, False):  # q.k depends only on the offset
        assert dot(7, 3, interleave) == pytest.approx(dot(1007, 1003, interleave), rel=1e-3, abs=1e-4)
        assert dot(7, 3, interleave) != pytest.approx(dot(7, 4, interleave), rel=1e-3)


# ----------------------------------------------------------------------------- attention


def numpy_attention(q, k, v, q_index, kv_index, q_seg, kv_seg, kv_valid, scale):
    """float64 loop: softmax over the keys that are causal, same-segment and valid; zeros if none."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, _ = q.shape
    S = k.shape[1]
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            kh = k[b, :, min(h, k.shape[2] - 1)]
            vh = v[b, :, min(h, v.shape[2] - 1)]
            for i in range(T):
                vis = [j for j in range(S) if kv_index[b, j] <= q_index[b, i] and q_seg[b, i] == kv_seg[b, j]
                       and kv_valid[b, j]]
                if not vis:
                    continue
                s = np.array([q[b, i, h] @ kh[j] for j in vis]) * scale
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, i, h] = sum(pj * vh[j] for pj, j in zip(p, vis))
    return out


def test_attention_mask_rule():
    rng = np.random.default_rng(3)
    qi = rng.integers(0, 6, (2, 5))
    ki = rng.integers(0, 6, (2, 7))
    qs = rng.integers(0, 2, (2, 5))
    ks = rng.integers(0, 2, (2, 7))
    kv = rng.random((2, 7)) < 0.7
    m = np.asarray(attention_mask(jnp.asarray(qi), jnp.asarray(ki), jnp.asarray(qs), jnp.asarray(ks), jnp.asarray(kv)))
    for b in range(2):
        for i in range(5):
            for j in range(7):
                assert m[b, i, j] == (ki[b, j] <= qi[b, i] and qs[b, i] == ks[b, j] and kv[b, j])
    m2 = np.asarray(attention_mask(jnp.asarray(qi), jnp.asarray(ki)))
    assert (m2 == (ki[:, None, :] <= qi[:, :, None])).all()


@pytest.mark.parametrize("shared_kv", [False, True])
def test_attention_matches_numpy_with_segments(shared_kv):
    rng = np.random.default_rng(4)
    B, T, H, D, Dv = 2, 13, 3, 8, 5
    q = rng.standard_normal((B, T, H, D)).astype(np.float32) * 2
    hk = 1 if shared_kv else H
    k = rng.standard_normal((B, T, hk, D)).astype(np.float32) * 2
    v = rng.standard_normal((B, T, hk, Dv)).astype(np.float32)
    seg = np.array([[0] * 4 + [1] * 6 + [2] * 3, [5] * 13])
    index = np.broadcast_to(np.arange(T), (B, T))
    valid = np.ones((B, T), bool)
    mask = attention_mask(jnp.asarray(index), jnp.asarray(index), jnp.asarray(seg), jnp.asarray(seg))
    out = jax.jit(attention, static_argnames="scale")(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, scale=0.3)
    ref = numpy_attention(q, k, v, index, index, seg, seg, valid, 0.3)
    assert out.shape == (B, T, H, Dv)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_attention_cache_layout_and_empty_rows():
    """Queries at later positions against a partly written cache; a row with no visible key gives 0."""
    rng = np.random.default_rng(5)
    B, T, S, H, D = 1, 3, 6, 2, 4
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, S, H, D)).astype(np.float32)
    v = rng.standard_normal((B, S, H, D)).astype(np.float32)
    q_index = np.array([[2, 3, 4]])
    kv_index = np.arange(S)[None]
    kv_valid = np.array([[True, True, False, True, True, True]])
    q_seg = np.array([[0, 0, 9]])  # the last query's segment has no keys at all
    kv_seg = np.zeros((B, S), int)
    mask = attention_mask(*(jnp.asarray(a) for a in (q_index, kv_index, q_seg, kv_seg, kv_valid)))
    f = lambda q, k, v: attention(q, k, v, mask, scale=D ** -0.5)  # noqa: E731
    out = jax.jit(f)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    ref = numpy_attention(q, k, v, q_index, kv_index, q_seg, kv_seg, kv_valid, D ** -0.5)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(out)[0, 2] == 0)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(*(jnp.asarray(a) for a in (q, k, v)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)

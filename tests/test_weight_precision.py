"""bf16 master weights (``model.param_dtype=bfloat16``): float32 optimizer statistics, the float32
update rounded once, and stochastic rounding (``train.optim.weight_rounding=stochastic``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax import optim
from k3jax.optim import precision
from k3jax.config import ConfigError, OptimConfig, load_config


class Toy(nnx.Module):
    """Per-head projections, an output projection, routed experts, a norm and an embedding, in ``dtype``."""

    def __init__(self, dtype, d=64, h=4, dh=16, e=4, din=32, dout=16):
        r = np.random.default_rng(0)

        def p(shape, axes, scale=0.02):
            return nnx.Param(jnp.asarray(scale * r.standard_normal(shape), dtype), out_sharding=axes)

        with nnx.use_eager_sharding(False):
            self.embed = p((32, d), ("vocab", "embed"))
            self.q_proj = p((d, h, dh), ("embed", "heads", "head_dim"))
            self.o_proj = p((h, dh, d), ("heads", "head_dim", "embed"))
            self.w_up = p((e, din, dout), ("expert", "expert_in", "expert_mlp"))
            self.norm_weight = p((d,), ("norm",), scale=1.0)


def _cfg(**kw) -> OptimConfig:
    base = dict(learning_rate=3e-3, schedule="constant", warmup_steps=0, weight_decay=0.1, grad_clip=0.0)
    return OptimConfig(**{**base, **kw})


def _steps(model, grads_per_step, cfg, seed=0):
    """The params after applying ``tx`` to each step's gradients, and the final optimizer state."""
    tx = optim.make_optimizer(cfg, model, total_steps=10, seed=seed)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    state = tx.init(params)

    @jax.jit
    def one(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads_per_step:
        params, state = one(params, state, g)
    return params, state


def _grads(model, steps, dtype):
    r = np.random.default_rng(1)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    return [jax.tree.map(lambda x: jnp.asarray(r.standard_normal(x.shape), dtype), params) for _ in range(steps)]


def test_bf16_weights_keep_float32_statistics():
    """Muon momentum and AdamW moments stay float32 under bf16 weights (optax would keep them in the
    weights' dtype); muon_dtype=bfloat16 still gives bf16 momentum."""
    model = Toy(jnp.bfloat16)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    for muon_dtype, want in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        state = optim.make_optimizer(_cfg(muon_dtype=muon_dtype), model, 10).init(params)
        leaves = jax.tree.leaves_with_path(state)
        mus = [x for p, x in leaves if "mu" in jax.tree_util.keystr(p) and x.ndim >= 2]
        nus = [x for p, x in leaves if "nu" in jax.tree_util.keystr(p)]
        assert mus and nus
        muon_mu = [x for x in mus if x.shape in ((64, 4, 16), (4, 16, 64), (4, 32, 16))]
        assert muon_mu and all(x.dtype == want for x in muon_mu), [(x.shape, x.dtype) for x in mus]
        assert all(x.dtype == jnp.float32 for x in nus)


def test_bf16_master_update_equals_the_float32_update_rounded():
    """Three steps from the same bf16 values: the bf16 weights after each step are the float32
    optimizer's sum ``w + u`` (same weights and gradients, in float32) rounded to the nearest bf16.
    (Weights of scanned layer stacks over ``group_max_size`` get their update written into the
    gradient's buffer, so in bf16 it is rounded once more before the sum; a Toy has none.)"""
    bf16, f32 = Toy(jnp.bfloat16), Toy(jnp.float32)
    nnx.update(f32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(bf16, nnx.Param)))
    grads = _grads(bf16, 3, jnp.bfloat16)
    p16 = nnx.as_pure(nnx.state(bf16, nnx.Param))
    p32 = nnx.as_pure(nnx.state(f32, nnx.Param))
    cfg = _cfg()
    tx16, tx32 = (optim.make_optimizer(cfg, m, total_steps=10) for m in (bf16, f32))
    s16, s32 = tx16.init(p16), tx32.init(p32)
    moved = 0
    for g in grads:
        u16, s16 = jax.jit(tx16.update)(g, s16, p16)
        u32, s32 = jax.jit(tx32.update)(jax.tree.map(lambda x: x.astype(jnp.float32), g), s32, p32)
        new16 = optax.apply_updates(p16, u16)
        want = jax.tree.map(lambda w, u: (w + u).astype(jnp.bfloat16), p32, u32)
        for a, b in zip(jax.tree.leaves(new16), jax.tree.leaves(want)):
            assert a.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        moved += sum(int(np.sum(np.asarray(a != w))) for a, w in zip(jax.tree.leaves(new16), jax.tree.leaves(p16)))
        p16 = new16
        p32 = jax.tree.map(lambda x: x.astype(jnp.float32), new16)  # the next step from the same values
    assert moved > 0


def test_stochastic_round_is_unbiased_and_picks_a_neighbour():
    """Each result is one of the two bf16 values around x; over 4000 keys the mean is x (within 4
    standard errors); a bf16 value stays as it is."""
    x = jnp.asarray([1.0 + 2.0 ** -10, 1.0 + 3 * 2.0 ** -11, -3.0 - 2.0 ** -9 / 3, 1e-3 * (1 + 1 / 7), 7.0], jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4000)
    r = np.asarray(jax.vmap(lambda k: precision.stochastic_round(x, jnp.bfloat16, k))(keys), np.float64)
    lo = np.asarray(jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32), np.float64)
    spacing = np.asarray([np.abs(float(jnp.nextafter(jnp.bfloat16(v), jnp.bfloat16(np.sign(v) * np.inf))) - v)
                          for v in lo])
    hi = lo + np.sign(lo) * spacing
    assert np.all((r == lo[None]) | (r == hi[None]))
    x64 = np.asarray(x, np.float64)
    p = np.abs(x64 - lo) / spacing
    stderr = spacing * np.sqrt(p * (1 - p) / len(keys)) + 1e-30
    assert np.all(np.abs(r.mean(0) - x64) <= 4 * stderr + 1e-12), (r.mean(0), x64)
    assert r[:, -1].tolist() == [7.0] * len(keys)  # exact values stay


def test_stochastic_weight_rounding_moves_weights_that_nearest_leaves():
    """With updates far below half a bf16 spacing, rounding to nearest never moves the weights;
    stochastic rounding moves them by the update on average over seeds (unbiased), each weight to
    one of its two neighbours."""
    w = jnp.full((64,), 1.0, jnp.bfloat16)
    u = jnp.full((64,), 2.0 ** -7 / 10, jnp.float32)  # a tenth of the spacing above 1 (2^-7)
    assert np.all(np.asarray(optax.apply_updates(w, u)) == 1.0)
    tx = precision.stochastic_weight_rounding(seed=0)
    state = tx.init(w)
    news = []
    for _ in range(50):  # consecutive steps draw new bits
        out, state = jax.jit(tx.update)(u, state, w)
        news.append(np.asarray(optax.apply_updates(w, out), np.float64))
    news = np.stack(news)
    assert set(np.unique(news)) <= {1.0, 1.0 + 2.0 ** -7}
    mean = news.mean()
    assert abs(mean - (1.0 + 2.0 ** -7 / 10)) < 4 * 2.0 ** -7 * np.sqrt(0.1 * 0.9 / news.size)
    f32 = jnp.ones((4,), jnp.float32)  # float32 weights pass unchanged
    out, _ = tx.update(jnp.full((4,), 1e-9), tx.init(f32), f32)
    np.testing.assert_array_equal(np.asarray(out), np.float32(1e-9))


def test_stochastic_rounding_in_the_optimizer_and_its_config():
    """weight_rounding=stochastic through the whole optimizer: every new bf16 weight is one of the two
    bf16 neighbours of the float32 sum ``w + u`` (the float32 optimizer's, same weights and gradients),
    some are not the nearest one, and two seeds draw different roundings. Float32 weights refuse it."""
    model = Toy(jnp.bfloat16)
    grads = _grads(model, 1, jnp.bfloat16)
    f32 = Toy(jnp.float32)
    nnx.update(f32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model, nnx.Param)))
    exact, _ = _steps(f32, [jax.tree.map(lambda g: g.astype(jnp.float32), grads[0])], _cfg())
    runs = [_steps(model, grads, _cfg(weight_rounding="stochastic"), seed=s)[0] for s in (0, 1)]
    for name in ("q_proj", "w_up", "embed", "norm_weight"):
        x = exact[name]
        lo = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000),
                                          jnp.float32).astype(jnp.bfloat16)
        hi = jnp.nextafter(lo, jnp.where(x > 0, jnp.inf, -jnp.inf).astype(jnp.bfloat16))
        for r in runs:
            assert r[name].dtype == jnp.bfloat16
            assert bool(jnp.all((r[name] == lo) | (r[name] == hi))), name
        assert bool(jnp.any(runs[0][name] != x.astype(jnp.bfloat16))), name  # not always the nearest
        assert bool(jnp.any(runs[0][name] != runs[1][name])), name
    with pytest.raises(ConfigError, match="weight_rounding"):
        load_config("tiny", ["train.optim.weight_rounding=stochastic"])
    cfg = load_config("tiny", ["train.optim.weight_rounding=stochastic", "model.param_dtype=bfloat16"])
    assert cfg.train.optim.weight_rounding == "stochastic"

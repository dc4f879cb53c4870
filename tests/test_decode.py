"""Decoding caches: cached prefill + token-by-token decode == the full forward pass, for the K3, K2-like
(RoPE + YaRN) and Kimi-Linear-like switch settings; ragged batches == prompts one by one; greedy
generation == repeated argmax of the full forward; absorbed MLA == expanded MLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import create_model, generate, load_config
from k3jax.cache import cache_bytes

pytestmark = pytest.mark.usefixtures("fast_xla")

K2_LIKE = ["model.layout=mla", "model.mla.rope=yarn", "model.mla.output_gate=false",
           "model.mla.yarn={factor: 4.0, original_max_position: 16, beta_fast: 1.0, beta_slow: 1.0, "
           "mscale: 1.0, mscale_all_dim: 1.0}", "model.attn_res.enabled=false", "model.activation=swiglu",
           "model.moe.latent_dim=0"]
KIMI_LINEAR_LIKE = ["model.kda.gate=softplus", "model.kda.output_gate=low_rank", "model.mla.q_lora_rank=0",
                    "model.mla.output_gate=false", "model.attn_res.enabled=false", "model.activation=swiglu",
                    "model.moe.latent_dim=0"]
SMALL = ["model.num_layers=5"]  # KDA (dense), KDA, KDA, MLA, MLA: both mixers, few compiles


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("overrides", [[], K2_LIKE, KIMI_LINEAR_LIKE], ids=["k3", "k2_like", "kimi_linear_like"])
def test_prefill_then_decode_equals_full_forward(overrides):
    cfg = load_config("tiny", SMALL + overrides).model
    model = create_model(cfg, seed=1)
    graphdef, state = nnx.split(model)
    tok = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.vocab_size)
    full = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, tok)
    step = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c))
    cache = model.init_cache(2, 16)
    assert cache_bytes(cache) > 0
    outs = []
    logits, cache = step(state, tok[:, :4], cache)  # prefill, then one token at a time
    outs.append(logits)
    for i in range(4, 11):
        logits, cache = step(state, tok[:, i:i + 1], cache)
        outs.append(logits)
    assert int(cache.length) == 11 and np.all(np.asarray(cache.positions) == 11)
    err = _rel(jnp.concatenate(outs, axis=1), full)
    assert err < 1e-5, err


def test_generate_greedy_ragged_and_argmax():
    cfg = load_config("tiny", SMALL).model
    model = create_model(cfg, seed=3)
    prompts = np.array([[1, 2, 3, 4, 5], [9, 8, 0, 0, 0]], np.int32)
    out = np.asarray(generate(model, prompts, 4, prompt_lengths=[5, 2]))
    assert out.shape == (2, 9)
    for row, length in ((0, 5), (1, 2)):
        alone = np.asarray(generate(model, prompts[row:row + 1, :length], 4))
        np.testing.assert_array_equal(out[row, :length + 4], alone[0])
    # greedy == argmax of the full forward at every generated position
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, jnp.asarray(out[:1]))  # op by op: 5x longer
    np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, 4:8]), -1), out[0, 5:9])


def test_absorbed_mla_equals_expanded():
    cfg = load_config("tiny", SMALL).model
    model = create_model(cfg, seed=4)
    mla = model.prefix[3].mixer  # layer 3 is MLA
    x = jax.random.normal(jax.random.key(5), (2, 7, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    expanded, _ = mla(x, positions=pos)
    cache = model.init_cache(2, 10).prefix[3]
    absorbed, new = mla(x, positions=pos, cache=cache, cache_index=jnp.int32(0),
                        kv_valid=jnp.arange(10)[None].repeat(2, 0) < 7)
    assert new.ckv.shape == (2, 10, cfg.mla.kv_lora_rank)
    assert _rel(absorbed, expanded) < 1e-5


def test_cache_too_long_raises():
    cfg = load_config("tiny", SMALL).model
    model = create_model(cfg)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.init_cache(1, cfg.max_seq_len + 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, np.ones((1, 4), np.int32), cfg.max_seq_len)


def test_unroll_layers_keeps_every_layer_and_decodes_the_same():
    """``unroll_layers``: the scanned groups' stacked weights (and other state: the router biases) are
    split into one module per layer, each equal to its slice of the stack; the logits and the greedy
    continuation are those of the scanned model. A model with nothing scanned comes back as is."""
    from k3jax.layers.initializers import RouterBias
    from k3jax.model import unroll_layers

    cfg = load_config("tiny", ["model.num_layers=6", "model.mla_period=2"]).model
    model = create_model(cfg, seed=4)
    assert model.groups is not None and model.plan.num_groups == 2
    rng = np.random.default_rng(0)
    for _, var in nnx.iter_graph(model):  # non-zero biases: a dropped or misplaced one shows
        if isinstance(var, RouterBias):
            var.value = jnp.asarray(rng.standard_normal(var.value.shape), jnp.float32)
    unrolled = unroll_layers(model)
    assert unrolled.groups is None and len(unrolled.prefix) == cfg.num_layers and not unrolled.suffix
    for i in range(cfg.num_layers):
        (path, index) = model.plan.locate(i)
        scanned = model
        for name in path:
            scanned = scanned[name] if isinstance(name, int) else getattr(scanned, name)
        want = nnx.to_flat_state(nnx.state(scanned))
        got = dict(nnx.to_flat_state(nnx.state(unrolled.prefix[i])))
        assert len(want) == len(got), i
        for p, v in want:
            np.testing.assert_array_equal(got[p].get_raw_value(), np.asarray(v.get_raw_value())[index],
                                          err_msg=str((i, p)))
    tok = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)

    def logits(m):  # jitted: run eagerly, the unrolled model's ops cost more than its compile
        graphdef, state = nnx.split(m)
        return jax.jit(lambda state: nnx.merge(graphdef, state)(tok)[0])(state)

    assert _rel(logits(unrolled), logits(model)) < 1e-5
    np.testing.assert_array_equal(generate(unrolled, tok, 5), generate(model, tok, 5))
    flat = create_model(load_config("tiny", SMALL).model)
    assert flat.groups is None and unroll_layers(flat) is flat

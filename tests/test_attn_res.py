"""Block Attention Residuals (docs/design.md "Block Attention Residuals"): the helpers against a direct
numpy formula, the model against a test-side reimplementation that calls the model's own sublayer
modules, and the plain pre-norm stack when AttnRes is off."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.layers import attn_res
from k3jax.layers.attn_res import AttnResMix
from k3jax.model import create_model

pytestmark = pytest.mark.usefixtures("fast_xla")


# ----------------------------------------------------------------------------- (a) helpers vs numpy


def np_attn_res(sources, query, gain, eps):
    """The AttnRes mix in float64: score_j = (gain*w).v_j / sqrt(mean(v_j^2) + eps), softmax over j, sum p_j v_j."""
    v = np.stack([np.asarray(s, np.float64) for s in sources])  # [S, B, T, d]
    rms = np.sqrt(np.mean(v * v, axis=-1) + eps)
    scores = np.einsum("sbtd,d->sbt", v, np.asarray(gain, np.float64) * np.asarray(query, np.float64)) / rms
    p = np.exp(scores - scores.max(0))
    p /= p.sum(0)
    return np.einsum("sbt,sbtd->btd", p, v), p


def test_attn_res_mix_matches_formula():
    rng = np.random.default_rng(0)
    S, B, T, d = 5, 2, 3, 16
    values = rng.standard_normal((S, B, T, d)) * rng.uniform(0.2, 5, (S, 1, 1, 1))
    valid = np.array([True, True, False, True, True])  # row 2 is an unused bank slot: must be ignored
    values[2] = 1e3  # huge garbage in the invalid row
    query, gain = rng.standard_normal(d) * 0.5, 1 + 0.3 * rng.standard_normal(d)
    out = jax.jit(attn_res.attn_res_mix, static_argnames="eps")(
        *(jnp.asarray(a, jnp.float32) for a in (values, valid)), jnp.asarray(query, jnp.float32),
        jnp.asarray(gain, jnp.float32), eps=1e-5)
    ref, p = np_attn_res([values[j] for j in range(S) if valid[j]], query, gain, 1e-5)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    assert p.max() > 0.6 and p.min() < 0.1  # the weights are far from uniform: the scores matter


def _state_sources(state):
    values, valid = attn_res.sources(state)
    return [np.asarray(values[j]) for j in range(values.shape[0]) if bool(valid[j])]


@pytest.mark.parametrize("flush_every", [1, 2, 3])
def test_bank_bookkeeping_matches_a_python_list(flush_every):
    """init_state / close_block / add / flush against a list of sources, under jit with traced
    predicates; the bank written every ``flush_every`` layers, as a scanned group of that many layers
    does (a closed block waits as the pending source until then)."""
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((2, 3, 4)).astype(np.float32)
    close = jax.jit(attn_res.close_block)
    add = jax.jit(attn_res.add)
    flush = jax.jit(attn_res.flush)
    num_layers, bs = 7, 3
    slots = -(-num_layers // bs)  # embedding + blocks closed at 3, 6
    state = attn_res.init_state(jnp.asarray(emb), slots)
    bank, partial, written = [], emb.astype(np.float64), 0
    assert len(_state_sources(state)) == 1
    np.testing.assert_array_equal(_state_sources(state)[0], emb)
    for layer in range(num_layers):
        for sub in range(2):  # attention then FFN sublayer
            got = _state_sources(state)
            assert len(got) == len(bank) + 1
            for a, b in zip(got, bank + [partial]):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            if sub == 0:
                is_close = layer % bs == 0
                state = close(state, jnp.asarray(is_close))
                if is_close:
                    bank.append(partial)
                    partial = np.zeros_like(partial)
            y = rng.standard_normal(emb.shape).astype(np.float32)
            state = add(state, jnp.asarray(y))
            partial = partial + y
        if layer % flush_every == flush_every - 1:
            state, written = flush(state), len(bank)
        # a block closed since the last flush is pending: a source, not yet in the bank
        assert int(state.stored) == written and int(state.num_blocks) == len(bank)
    state = flush(state)
    assert int(state.num_blocks) == int(state.stored) == len(bank) == slots
    np.testing.assert_allclose(np.asarray(state.bank), np.stack(bank), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.partial), partial, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_size", [1, 3, 4, 5, 13])
def test_residual_stream_protocol_matches_a_python_list(block_size):
    """ResidualStream driven as the model drives it (an unrolled layer 0, three scanned groups of four
    layers, the readout) reads, at every sublayer, the sources of the AttnRes definition: the blocks
    closed so far (a layer ``i`` with ``i % block_size == 0`` closes one after its attention read) and the
    running partial. The bank is written after the unrolled layer that closes a block and at each group's
    end, or after every layer when blocks are shorter than a group."""
    cfg = load_config("tiny", [f"model.attn_res.block_size={block_size}"]).model
    stream = attn_res.ResidualStream.of(cfg)
    assert stream.num_slots == len(range(0, cfg.num_layers, block_size))
    rng = np.random.default_rng(4)
    emb = rng.standard_normal((1, 2, 3)).astype(np.float32)
    read = lambda state: state  # noqa: E731  a "mix" that hands back what it read
    carry, bank, partial = stream.start(jnp.asarray(emb)), [], emb.astype(np.float64)

    def check(state, expected):
        got = _state_sources(state)
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    for i in range(cfg.num_layers):
        seen, carry = stream.mixer_input(carry, jnp.asarray(i), read)
        check(seen, bank + [partial])
        if i % block_size == 0:
            bank, partial = bank + [partial], np.zeros_like(partial)
        y = rng.standard_normal(emb.shape).astype(np.float32)
        seen, carry = stream.ffn_input(carry, jnp.asarray(y), read)
        partial = partial + y
        check(seen, bank + [partial])
        y = rng.standard_normal(emb.shape).astype(np.float32)
        carry, partial = stream.layer_output(carry, jnp.asarray(y)), partial + y
        if i == 0:  # layer 0 closes a block: written at once
            carry, stored = stream.after_unrolled_layer(carry, i), len(bank)
        else:
            slot = (i - 1) % 4
            carry = stream.after_group_layer(carry, slot, 4)
            stored = len(bank) if slot == 3 or block_size < 4 else stored
        assert (int(carry.num_blocks), int(carry.stored)) == (len(bank), stored)
    check(stream.readout(carry, read), bank + [partial])
    assert int(carry.stored) == stream.num_slots


def test_residual_stream_without_attn_res_is_the_plain_residual():
    stream = attn_res.ResidualStream.of(load_config("tiny", ["model.attn_res.enabled=false"]).model)
    x, y1, y2 = (jnp.asarray(np.random.default_rng(s).standard_normal((2, 3, 4)), jnp.float32) for s in range(3))
    h, carry = stream.mixer_input(stream.start(x), 0, None)
    assert h is x and carry is x
    h, carry = stream.ffn_input(carry, y1, None)
    np.testing.assert_array_equal(h, x + y1)
    out = stream.after_group_layer(stream.layer_output(carry, y2), 3, 4)
    np.testing.assert_array_equal(stream.readout(out, None), x + y1 + y2)


def test_zero_query_gives_uniform_weights():
    rng = np.random.default_rng(2)
    with nnx.use_eager_sharding(False):
        mix = AttnResMix(8, 1e-5)
    assert float(jnp.max(jnp.abs(mix.query[...]))) == 0.0  # zero-initialised pseudo-query
    emb = rng.standard_normal((2, 5, 8)).astype(np.float32)
    state = attn_res.close_block(attn_res.init_state(jnp.asarray(emb), 3), True)
    blocks = [emb]
    for _ in range(2):
        y = (rng.standard_normal(emb.shape) * 10).astype(np.float32)
        state = attn_res.close_block(attn_res.flush(attn_res.add(state, jnp.asarray(y))), True)
        blocks.append(y)
    last = rng.standard_normal(emb.shape).astype(np.float32)
    state = attn_res.add(state, jnp.asarray(last))
    blocks.append(last)
    # uniform weights over the valid sources whatever their scale (4 = embedding + 2 blocks + partial)
    np.testing.assert_allclose(np.asarray(mix(state)), np.mean(blocks, axis=0), rtol=1e-5, atol=1e-5)
    mix.query.value = jnp.ones(8)  # a non-zero query is not uniform
    assert np.abs(np.asarray(mix(state)) - np.mean(blocks, axis=0)).max() > 1e-2


# ----------------------------------------------------------------------------- model-level references


def _y(out):
    """Sublayers return y, or (y, router statistics / decode cache): keep y."""
    return out[0] if isinstance(out, tuple) else out


def iter_layers(model):
    """The model's DecoderLayers in depth order (the scanned groups unstacked)."""
    layers = list(model.prefix)
    if model.groups is not None:
        graphdef, state = nnx.split(model.groups)
        for g in range(model.plan.num_groups):
            group = nnx.merge(graphdef, jax.tree.map(lambda a: a[g], state))
            layers.extend(group.layers)
    layers.extend(model.suffix)
    return layers


def sublayer_mix(layer, h, positions, segment_ids):
    if layer.kind[0] == "kda":
        return _y(layer.mixer(layer.attn_norm(h), segment_ids=segment_ids))
    return _y(layer.mixer(layer.attn_norm(h), positions=positions, segment_ids=segment_ids))


def sublayer_ffn(layer, h):
    return _y(layer.ffn(layer.ffn_norm(h)))


def jnp_mix(mix, sources, eps):
    """The AttnRes mix written out on a Python list of sources (no fixed-size bank, no masks)."""
    v = jnp.stack(sources).astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(v * v, axis=-1) + eps)
    scores = jnp.einsum("sbtd,d->sbt", v, mix.norm[...] * mix.query[...]) / rms
    return jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(scores, axis=0), v)


def reference_attn_res_logits(model, tokens):
    """All sources kept in a list: the embedding, every completed block sum, the running partial."""
    cfg = model.cfg
    bs, eps = cfg.attn_res.block_size, cfg.attn_res.eps
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    sources, partial = [], model.embed[...][tokens]
    for i, layer in enumerate(iter_layers(model)):
        h = jnp_mix(layer.attn_res_mix, sources + [partial], eps)
        if i % bs == 0:  # a block closes at layers 0, bs, 2bs, ...: the partial sum becomes a source
            sources.append(partial)
            partial = jnp.zeros_like(partial)
        partial = partial + sublayer_mix(layer, h, positions, None)
        h = jnp_mix(layer.ffn_res_mix, sources + [partial], eps)
        partial = partial + sublayer_ffn(layer, h)
    assert len(sources) == -(-cfg.num_layers // bs)
    h = jnp_mix(model.final_res_mix, sources + [partial], eps)
    return model.final_norm(h) @ model.lm_head[...]


def reference_plain_logits(model, tokens):
    """A plain pre-norm residual stack over the model's own sublayers."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h = model.embed[...][tokens]
    for layer in iter_layers(model):
        h = h + sublayer_mix(layer, h, positions, None)
        h = h + sublayer_ffn(layer, h)
    return model.final_norm(h) @ model.lm_head[...]


def randomize_attn_res(model, seed=0):
    """Non-zero pseudo-queries and non-unit gains everywhere, so that a source list off by one entry
    (or a block closed at the wrong layer) changes the logits. Values are drawn per (layer, side) in
    depth order, so scanned and unrolled models with the same seed get the same values."""
    rng = np.random.default_rng(seed)
    cfg, plan = model.cfg, model.plan
    d = cfg.hidden_size
    draw = {(i, side): (rng.standard_normal(d) * 0.3, 1 + 0.3 * rng.standard_normal(d))
            for i in range(cfg.num_layers) for side in ("attn_res_mix", "ffn_res_mix")}
    final = (rng.standard_normal(d) * 0.3, 1 + 0.3 * rng.standard_normal(d))

    def put(mix, query, gain):
        assert mix.query[...].shape == np.shape(query)
        mix.query.value = jnp.asarray(query, jnp.float32)
        mix.norm.value = jnp.asarray(gain, jnp.float32)

    for layers, ids in ((model.prefix, plan.prefix), (model.suffix, plan.suffix)):
        for layer, i in zip(layers, ids):
            for side in ("attn_res_mix", "ffn_res_mix"):
                put(getattr(layer, side), *draw[(i, side)])
    for pos in range(plan.period if model.groups is not None else 0):
        ids = plan.slot_layers(pos)
        for side in ("attn_res_mix", "ffn_res_mix"):
            put(getattr(model.groups.layers[pos], side), np.stack([draw[(i, side)][0] for i in ids]),
                np.stack([draw[(i, side)][1] for i in ids]))
    put(model.final_res_mix, *final)


def model_logits(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)[0])(state, tokens)


def reference_logits(fn, model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, t: fn(nnx.merge(graphdef, s), t))(state, tokens)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


# tiny with 6 layers, an MLA every 2nd: dense KDA layer 0, two scanned [MLA, KDA] groups (layers 1-4) and a
# final MLA (layer 5), so the prefix, scan and suffix paths all carry the AttnRes state.
SMALL = ["model.num_layers=6", "model.mla_period=2", "model.init_std=0.1"]
TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 19)), jnp.int32)


@pytest.fixture(scope="module")
def full_attn_res_reference():
    """block_size = 1 (every layer closes a block: 'full' AttnRes over per-layer outputs)."""
    model = create_model(load_config("tiny", SMALL + ["model.attn_res.block_size=1"]).model, seed=1)
    randomize_attn_res(model)
    return reference_logits(reference_attn_res_logits, model, TOKENS)


@pytest.mark.parametrize("scan", [True, False])
def test_block_size_one_is_full_attn_res(full_attn_res_reference, scan):
    cfg = load_config("tiny", SMALL + ["model.attn_res.block_size=1", f"model.scan_layers={str(scan).lower()}"]).model
    model = create_model(cfg, seed=1)
    assert (model.plan.num_groups == 2 and model.plan.suffix == (5,)) if scan else model.groups is None
    randomize_attn_res(model)  # same seed: the same values whether the layers are stacked or not
    out = model_logits(model, TOKENS)
    err = rel_err(out, full_attn_res_reference)
    assert err < 1e-4, err


@pytest.mark.slow
def test_block_size_three_closes_blocks_inside_the_scan():
    """Blocks close at layers 0 and 3: not in the first scanned group (layers 1, 2), at the first
    position of the second (layers 3, 4): the close predicate is traced inside the scan."""
    cfg = load_config("tiny", SMALL + ["model.attn_res.block_size=3"]).model
    model = create_model(cfg, seed=2)
    assert model.plan.group_start == 1 and model.plan.num_groups == 2 and len(model.plan.group_kinds) == 2
    randomize_attn_res(model, seed=1)
    out = model_logits(model, TOKENS)
    ref = reference_logits(reference_attn_res_logits, model, TOKENS)
    err = rel_err(out, ref)
    assert err < 1e-4, err


def test_attn_res_off_is_plain_pre_norm_stack():
    cfg = load_config("tiny", SMALL + ["model.attn_res.enabled=false"]).model
    model = create_model(cfg, seed=3)
    assert model.groups is not None
    assert not any(isinstance(n, AttnResMix) for _, n in nnx.iter_graph(model))
    out = model_logits(model, TOKENS)
    ref = reference_logits(reference_plain_logits, model, TOKENS)
    err = rel_err(out, ref)
    assert err < 1e-4, err

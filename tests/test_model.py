"""The whole decoder: shapes, finiteness, gradients, scan/remat/bf16 equivalences, packed-document
isolation for the K3, K2-like and Kimi-Linear-like switch settings, edge-case lengths, input errors.

XLA:CPU needs ~10-20 s per compile of the tiny model, so compiled functions are module-scoped fixtures
and reused wherever the shapes allow.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import load_config
from k3jax.model import create_model, segment_positions

pytestmark = pytest.mark.usefixtures("fast_xla")

# ----------------------------------------------------------------------------- helpers


def compiled_forward(model):
    """A jitted ``(state, tokens, segment_ids) -> logits`` for this model's graph."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens, segment_ids=None):
        return nnx.merge(graphdef, state)(tokens, segment_ids=segment_ids)[0]

    return lambda tokens, segment_ids=None, state=state: fwd(state, tokens, segment_ids)


def compiled_grad(model, with_logits=False):
    """A jitted gradient of ``sum(logits * cotangent)`` w.r.t. the model's nnx.Params (``with_logits``:
    (logits, gradient) from the one program), optionally on packed rows (``segment_ids``)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def grad(params, tokens, cot, segment_ids=None):
        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(tokens, segment_ids=segment_ids)[0]
            return jnp.sum(logits * cot), logits

        grads, logits = jax.grad(loss, has_aux=True)(params)
        return (logits, grads) if with_logits else grads

    return lambda tokens, cot, segment_ids=None: grad(params, tokens, cot, segment_ids)


def iter_layers(model):
    """The model's DecoderLayers in depth order (the scanned groups unstacked)."""
    layers = list(model.prefix)
    if model.groups is not None:
        graphdef, state = nnx.split(model.groups)
        for g in range(model.plan.num_groups):
            layers.extend(nnx.merge(graphdef, jax.tree.map(lambda a: a[g], state)).layers)
    layers.extend(model.suffix)
    return layers


def pure(module):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module)))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def tokens(shape, seed=0, vocab=256):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


T_MAIN = 37  # not a multiple of tiny's KDA chunk (16)
TOK = tokens((2, T_MAIN))

# Packed rows: row 0 = docs A | B | C | 2 padding tokens (segment ids 1, 2, 3, 0: documents start
# mid-chunk); rows 1 and 2 hold B and C alone, followed by unrelated tokens that causality hides.
LA, LB, LC, T_PACK = 13, 21, 4, 40


def _packing_batch():
    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(0, 256, n) for n in (LA, LB, LC))
    junk = lambda n: rng.integers(0, 256, n)  # noqa: E731
    tok = np.stack([np.concatenate([a, b, c, junk(T_PACK - LA - LB - LC)]),
                    np.concatenate([b, junk(T_PACK - LB)]),
                    np.concatenate([c, junk(T_PACK - LC)])])
    seg = np.stack([np.repeat([1, 2, 3, 0], [LA, LB, LC, T_PACK - LA - LB - LC]),
                    np.ones(T_PACK, int), np.full(T_PACK, 5)])
    return jnp.asarray(tok, jnp.int32), jnp.asarray(seg, jnp.int32)


PACK_TOK, PACK_SEG = _packing_batch()


def check_packing(fwd, packed_logits=None):
    """B and C inside the pack must give the logits they give alone."""
    out = np.asarray(fwd(PACK_TOK, PACK_SEG) if packed_logits is None else packed_logits)
    err_b = rel_err(out[0, LA:LA + LB], out[1, :LB])
    err_c = rel_err(out[0, LA + LB:LA + LB + LC], out[2, :LC])
    assert err_b < 1e-4 and err_c < 1e-4, (err_b, err_c)
    # control: the same pack with one segment id everywhere does let B see A (same shapes: no recompile)
    leak = np.asarray(fwd(PACK_TOK, jnp.ones_like(PACK_SEG)))
    assert rel_err(leak[0, LA:LA + LB], out[1, :LB]) > 1e-3
    return max(err_b, err_c)


# tiny with 6 layers and an MLA every 2nd layer: dense KDA layer 0, two scanned [MLA, KDA] groups and a
# final MLA, so the prefix / scan / suffix paths, KDA, MLA, MoE and AttnRes (blocks close at 0 and 4) are
# all there at about half the compile time of the 13-layer tiny.
TINY6 = ["model.num_layers=6", "model.mla_period=2"]


@pytest.fixture(scope="module")
def tiny():
    """The 13-layer tiny, compiled once, on the packed batch (the None-segment path runs in tiny6):
    ``(cfg, model, fwd, logits, grads)``. One forward + backward program gives the logits and the
    gradients (a separate forward program cost another compile of the 13 layers); ``fwd`` is that
    program's logits, for other segment ids of the same shape (no recompile)."""
    cfg = load_config("tiny").model
    model = create_model(cfg, seed=0)
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(PACK_TOK.shape + (cfg.vocab_size,)), jnp.float32)
    grad = compiled_grad(model, with_logits=True)
    logits, grads = grad(PACK_TOK, cot, PACK_SEG)
    flat = {"/".join(map(str, k)): np.asarray(v) for k, v in _flat(nnx.to_pure_dict(grads)).items()}
    return cfg, model, lambda tokens, segment_ids: grad(tokens, cot, segment_ids)[0], logits, flat


@pytest.fixture(scope="module")
def tiny6():
    """tiny6 on ``TOK``: ``(cfg, model, fwd, logits, grads)``. One forward + backward program gives the
    logits and the gradients; ``fwd`` is that program's logits for other tokens of ``TOK``'s shape
    (no recompile) and a plain forward program for other shapes."""
    cfg = load_config("tiny", TINY6).model
    model = create_model(cfg, seed=0)
    assert model.plan.prefix == (0,) and model.plan.num_groups == 2 and model.plan.suffix == (5,)
    cot = _cotangent(TOK, cfg.vocab_size)
    grad = compiled_grad(model, with_logits=True)
    logits, grads = grad(TOK, cot)
    forward = compiled_forward(model)

    def fwd(tokens):
        return grad(tokens, cot)[0] if tokens.shape == TOK.shape else forward(tokens)

    return cfg, model, fwd, logits, _flat_grads(grads)


@pytest.fixture(scope="module")
def unrolled6(tiny6):
    """tiny6 with ``scan_layers=False`` (same seed: the same parameters) and its ``forward(TOK,
    max_logits=True)``, one program for the logits and the per-layer max logits:
    ``(model, logits, max_logits)``."""
    model = create_model(dataclasses.replace(tiny6[0], scan_layers=False), seed=0)
    logits, max_logits = max_logits_forward(model, TOK)
    return model, logits, max_logits


def max_logits_forward(model, tokens):
    """``forward(tokens, max_logits=True)`` jitted: (logits, {layer: max logit per head})."""
    graphdef, state = nnx.split(model)
    out, _, stats = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward(t, max_logits=True))(state, tokens)
    return out, stats.max_logits


# ----------------------------------------------------------------------------- shapes, grads


def test_tiny_forward_shape_and_finite(tiny):
    cfg, model, _, logits, _ = tiny
    assert T_PACK % cfg.kda.chunk_size != 0
    assert model.groups is not None and model.suffix  # prefix, scanned groups and suffix all run
    assert logits.shape == (3, T_PACK, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert float(jnp.std(logits[0, 1:] - logits[0, :-1])) > 0  # depends on the token


def _cotangent(tok, vocab_size, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(tok.shape + (vocab_size,)), jnp.float32)


def _flat_grads(grads):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in _flat(nnx.to_pure_dict(grads)).items()}


def model_grads(model, tok, seed=1, with_logits=False):
    """{parameter path: gradient}; ``with_logits``: (logits, that) from one compiled program."""
    out = compiled_grad(model, with_logits)(tok, _cotangent(tok, model.cfg.vocab_size, seed))
    logits, grads = out if with_logits else (None, out)
    return (logits, _flat_grads(grads)) if with_logits else _flat_grads(grads)


def check_grads_finite_nonzero(model, flat):
    assert len(flat) == sum(1 for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    zero = set()
    for name, g in flat.items():
        assert np.all(np.isfinite(g)), name
        stacked = name.startswith("groups/")  # leading axis = the scanned layers: check each one
        for row in (g if stacked else [g]):
            if not np.any(row != 0):
                zero.add(name)
    # Expected exact zeros at initialisation, and nothing else:
    # - layer 0's attention-side AttnRes mixes a single source (the embedding; docs/design.md "Block
    #   Attention Residuals"): its softmax is constant, so its pseudo-query and gain get no gradient;
    # - every AttnRes gain enters only as (gain * query) and the queries start at zero (docs/design.md
    #   "Initialisation"), so the gains' gradients are zero until the queries move.
    expected = {n for n in flat if n.endswith("_res_mix/norm") or n.startswith("prefix/0/attn_res_mix/")}
    assert zero == expected, (sorted(zero - expected), sorted(expected - zero))


@pytest.fixture(scope="module")
def tiny6_grads(tiny6):
    return tiny6[4]


def test_tiny6_grads_finite_and_nonzero(tiny6, tiny6_grads):
    check_grads_finite_nonzero(tiny6[1], tiny6_grads)


@pytest.mark.slow
def test_tiny_grads_finite_and_nonzero(tiny):
    """The 13-layer tiny's gradients on the packed rows (the fixture's program; padding included)."""
    check_grads_finite_nonzero(tiny[1], tiny[4])


def _flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


@pytest.fixture(scope="module")
def small():
    """small on 70 tokens (not a multiple of its KDA chunk, 64): the model, its logits and gradients,
    from one compiled forward + backward (a separate forward program cost another compile)."""
    model = create_model(load_config("small").model, seed=0)
    return (model, *model_grads(model, tokens((1, 70), seed=2), with_logits=True))


@pytest.mark.slow
def test_small_grads_finite_and_nonzero(small):
    model, _, grads = small
    check_grads_finite_nonzero(model, grads)


def test_small_forward_shape_and_finite(small):
    model, logits, _ = small
    assert model.groups is not None
    assert logits.shape == (1, 70, model.cfg.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


# ----------------------------------------------------------------------------- equivalences


def test_scan_on_off_same_params_and_logits(tiny6, unrolled6):
    cfg, model, _, logits, _ = tiny6
    unrolled, unrolled_logits, _ = unrolled6
    assert unrolled.groups is None and len(unrolled.prefix) == cfg.num_layers
    # same seed, same parameter order: every layer's parameters are identical
    scanned_layers = iter_layers(model)
    assert len(scanned_layers) == cfg.num_layers
    for i, (a, b) in enumerate(zip(scanned_layers, unrolled.prefix)):
        assert a.kind == b.kind, i
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), pure(a), pure(b))
    top = lambda m: {k: v for k, v in pure(m).items() if k not in ("prefix", "groups", "suffix")}  # noqa: E731
    assert set(top(model)) == {"embed", "lm_head", "final_norm", "final_res_mix"}
    jax.tree.map(np.testing.assert_array_equal, top(model), top(unrolled))
    # the stacked params are not trivially equal across layers (a scan over copies would pass anyway)
    assert not np.array_equal(pure(scanned_layers[2].mixer)["o_proj"], pure(scanned_layers[4].mixer)["o_proj"])
    err = rel_err(unrolled_logits, logits)
    assert err < 1e-5, err


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "nested", "dots", "selective", "outputs", "outputs_offload"])
def test_remat_gives_identical_grads(tiny6, tiny6_grads, remat):
    cfg = tiny6[0]
    assert cfg.remat == "none"
    model = create_model(dataclasses.replace(cfg, remat=remat), seed=0)
    flat = model_grads(model, TOK)
    assert flat.keys() == tiny6_grads.keys()
    errs = {k: rel_err(flat[k], tiny6_grads[k]) for k in flat if np.any(tiny6_grads[k] != 0)}
    assert all(not np.any(flat[k] != 0) for k in flat if k not in errs)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("block_size", [4, 2])
def test_scan_saves_one_attn_res_bank_per_group(block_size):
    """With per-layer remat, the backward pass keeps what each layer's checkpoint reads. A group's
    layers read one bank (a closed block waits as the pending source; attn_res.flush writes it at the
    group's end), so the scan saves one ``[G, S, B, T, d]`` bank, not one per layer. Blocks shorter
    than a group (2 < 4 layers) are written after every layer: one bank per layer, as before."""
    cfg = dataclasses.replace(load_config("tiny", [f"model.attn_res.block_size={block_size}"]).model, remat="full")
    model = create_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tok = TOK[:, :32]

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tok)[0])

    residuals = jax.tree.leaves(jax.eval_shape(lambda s: jax.vjp(loss, s)[1], state))  # vjp_fn's leaves
    bank = (model.plan.num_groups, model.residual.num_slots, *tok.shape, cfg.hidden_size)
    saved = sum(r.shape == bank for r in residuals)
    assert saved == (1 if block_size >= model.plan.period else model.plan.period), saved


def test_bf16_compute_close_to_fp32(tiny6):
    """bf16 has an 8-bit mantissa (unit roundoff 2^-9 ~ 2e-3); with ~30 matmul/norm stages the logits
    drift by a few percent of their scale at most. 5% (norm-wise) bounds that while still catching a
    wrong cast (e.g. a bf16 softmax or a dropped residual gives O(1) errors)."""
    cfg, _, _, logits, _ = tiny6
    model = create_model(dataclasses.replace(cfg, dtype="bfloat16"), seed=0)
    out = compiled_forward(model)(TOK)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    a, b = np.asarray(out, np.float64), np.asarray(logits, np.float64)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert 0 < err < 5e-2, err  # > 0: bf16 really was used
    assert np.mean(a.argmax(-1) == b.argmax(-1)) > 0.8


# ----------------------------------------------------------------------------- packing isolation


def test_packing_isolation_tiny(tiny):
    _, _, fwd, logits, _ = tiny
    check_packing(fwd, logits)


K2_LIKE = ["model.layout=mla", "model.num_layers=3", "model.mla.rope=yarn", "model.mla.rope_interleave=true",
           "model.mla.yarn={factor: 4.0, original_max_position: 16, beta_fast: 32.0, beta_slow: 1.0, "
           "mscale: 1.0, mscale_all_dim: 1.0}", "model.mla.output_gate=false", "model.activation=swiglu",
           "model.moe.latent_dim=0", "model.moe.routed_scaling_factor=2.5", "model.attn_res.enabled=false"]
KIMI_LINEAR_LIKE = ["model.num_layers=4", "model.kda.gate=softplus", "model.kda.output_gate=low_rank",
                    "model.mla.q_lora_rank=0", "model.mla.output_gate=false", "model.activation=swiglu",
                    "model.moe.latent_dim=0", "model.attn_res.enabled=false"]


@pytest.mark.parametrize("overrides", [K2_LIKE, KIMI_LINEAR_LIKE], ids=["k2_like", "kimi_linear_like"])
def test_packing_isolation_other_families(overrides):
    model = create_model(load_config("tiny", overrides).model, seed=0)
    check_packing(compiled_forward(model))


# ----------------------------------------------------------------------------- edge cases


def test_single_token(tiny6):
    cfg, model, fwd, logits, _ = tiny6
    out = fwd(TOK[:, :1])
    assert out.shape == (2, 1, cfg.vocab_size) and bool(jnp.all(jnp.isfinite(out)))
    # causality: the first position of the longer sequence saw the same single token
    err = rel_err(out, logits[:, :1])
    assert err < 1e-5, err


def test_bad_inputs_raise(tiny):
    _, model, _, _, _ = tiny
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(jnp.zeros((1, 2, 3), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.zeros((1, 5), jnp.int32))
    if hasattr(model, "init_cache"):  # packing is for training; a decode cache takes token_valid instead
        with pytest.raises(ValueError, match="segment_ids"):
            model(jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.ones((1, 4), jnp.int32), cache=model.init_cache(1, 8))


def test_out_of_vocabulary_ids_are_named_eagerly(tiny6):
    _, model, _, _, _ = tiny6
    for bad in (256, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} at position \(row 1, column 3\) is outside the "
                                             r"vocabulary \[0, 256\)"):
            model(TOK.at[1, 3].set(bad))


def test_out_of_vocabulary_ids_under_jit_flag_only_their_position(tiny6):
    """Under jit the id cannot raise: its logits are NaN, nothing else is (the lookup is clamped, so no
    NaN spreads along the row), and the positions before it and the other row are unchanged."""
    _, _, fwd, clean, _ = tiny6
    for bad in (256, -1):
        out = np.asarray(fwd(TOK.at[1, 3].set(bad)))
        assert np.isnan(out[1, 3]).all() and np.isfinite(np.delete(out[1], 3, axis=0)).all()
        np.testing.assert_array_equal(out[0], np.asarray(clean)[0])
        np.testing.assert_array_equal(out[1, :3], np.asarray(clean)[1, :3])


def test_layer_plan_locates_every_layer():
    """``LayerPlan`` is the one map between layer indices and places in the model: every layer is found
    exactly once, a stacked slice's layer is where ``locate`` says, and the optimizer's stacked test
    agrees with it."""
    from k3jax.layer_plan import LayerPlan
    from k3jax.model import abstract_model

    for name in ("k3", "k2", "kimi_linear_48b", "tiny"):
        cfg = load_config(name).model
        plan = abstract_model(cfg).plan
        places = [plan.locate(i) for i in range(cfg.num_layers)]
        assert len(set(places)) == cfg.num_layers
        for g in range(plan.num_groups):
            for j in range(plan.period):
                i = plan.layer_at(g, j)
                assert plan.locate(i) == (("groups", "layers", j), (g,))
                assert (cfg.mixer(i), cfg.ffn(i)) == plan.group_kinds[j]
                assert LayerPlan.is_stacked(plan.locate(i)[0])
        for i in plan.prefix + plan.suffix:
            assert not LayerPlan.is_stacked(plan.locate(i)[0])
        assert sorted(plan.prefix + plan.suffix + sum((plan.slot_layers(j) for j in range(plan.period)), ())) == \
            list(range(cfg.num_layers))
    with pytest.raises(IndexError):
        plan.locate(cfg.num_layers)


def test_head_max_logits_matches_dense_scores():
    """The QK-clip statistic, computed block by block, equals the max of the dense masked scores."""
    from k3jax.layers.mla import head_max_logits
    from k3jax.ops.attention import attention_mask

    rng = np.random.default_rng(0)
    b, t, h, p = 2, 13, 3, 8
    q, k = (jnp.asarray(rng.normal(size=(b, t, h, p)), jnp.float32) for _ in range(2))
    index = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [3] * 13])
    for segment_ids in (None, seg):
        scores = jnp.einsum("bthd,bshd->bhts", q, k) * 0.3
        visible = attention_mask(index, index, segment_ids, segment_ids)[:, None]
        want = jnp.max(jnp.where(visible, scores, -jnp.inf), axis=(0, 2, 3))
        for chunks in ((3, 5), (13, 13), (4, 13)):
            got = head_max_logits(q, k, index, segment_ids, 0.3, q_chunk=chunks[0], kv_chunk=chunks[1])
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_max_logits_come_out_of_the_forward_keyed_by_layer(tiny6, unrolled6):
    """``forward(max_logits=True)``: one ``[H]`` entry per MLA layer, the same scanned or unrolled, and
    the logits unchanged."""
    cfg, model, _, logits, _ = tiny6
    _, unrolled_logits, unrolled_max = unrolled6
    scanned_logits, scanned_max = max_logits_forward(model, TOK)
    got = {True: scanned_max, False: unrolled_max}
    for out in (scanned_logits, unrolled_logits):
        np.testing.assert_allclose(out, logits, rtol=1e-5, atol=1e-6)
    assert sorted(got[True]) == [i for i in range(cfg.num_layers) if cfg.mixer(i) == "mla"]
    for i, v in got[True].items():
        assert v.shape == (cfg.mla.num_heads,) and np.all(np.asarray(v) > 0)
        np.testing.assert_allclose(v, got[False][i], rtol=1e-5)


def test_segment_positions():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 3], [4, 4, 4, 4, 4, 4, 4, 4], [1, 2, 1, 1, 2, 2, 2, 0]])
    expected = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            expected[b, t] = expected[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
    np.testing.assert_array_equal(np.asarray(segment_positions(jnp.asarray(seg))), expected)

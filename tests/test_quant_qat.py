"""Quantization-aware training of the routed experts: the config switch, the QAT forward pass
(MXFP4 weights, MXFP8 inputs), straight-through gradients, the jitted train step, and that QAT
fine-tuning brings the quantized model's loss towards the unquantized one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.config import ConfigError, load_config
from k3jax.interop import mxfp4
from k3jax.model import abstract_model, create_model
from k3jax.ops.moe import ragged_glu
from k3jax.quant.mxfp4 import fake_quantize_mxfp4
from k3jax.quant.mxfp8 import fake_quantize_mxfp8

pytestmark = pytest.mark.usefixtures("fast_xla")

SMALL = ["model.num_layers=3", "train.seq_len=32", "train.batch_size=4"]  # KDA + dense FFN, KDA + MoE, MLA + MoE


def config(*extra):
    return load_config("tiny", SMALL + list(extra))


def is_routed_expert(var) -> bool:
    axes = var.get_metadata().get("out_sharding") or ()
    return isinstance(var, nnx.Param) and "expert" in axes and "expert_mlp" in axes


def routed_expert(model, name: str):
    """(path, variable) of the first routed-expert weight called ``name`` (w_gate, w_up, w_down)."""
    return next((tuple(p), v) for p, v in nnx.iter_graph(model)
                if isinstance(v, nnx.Variable) and is_routed_expert(v) and p[-1] == name)


def with_state(cfg, state):
    """A model of ``cfg`` (same structure, other quant switches) holding ``state``."""
    return nnx.merge(nnx.graphdef(abstract_model(cfg.model)), state)


def logits_of(tokens, *models):
    """Each model's logits on ``tokens``, all in one jitted program (op by op, every forward pass
    compiles hundreds of small programs)."""
    graphdefs, states = zip(*(nnx.split(m) for m in models))
    run = jax.jit(lambda states, tokens: [nnx.merge(d, s)(tokens)[0] for d, s in zip(graphdefs, states)])
    return [np.asarray(x) for x in run(states, tokens)]


def fake_quantized_experts(model, cfg, rule="ceil"):
    """A model of ``cfg`` with ``model``'s weights, every routed-expert weight replaced by its MXFP4
    values (from the NumPy codec)."""
    clone = with_state(cfg, jax.tree.map(lambda x: x, nnx.state(model)))
    for _, var in nnx.iter_graph(clone):
        if isinstance(var, nnx.Variable) and is_routed_expert(var):
            w = np.asarray(var.get_raw_value())
            q = np.swapaxes(mxfp4.quantize_dequantize(np.swapaxes(w, -1, -2), rule=rule), -1, -2)
            var.set_raw_value(jnp.asarray(q))
    return clone


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)


def test_quant_section_alias_and_validation():
    cfg = load_config("tiny", ["quant.experts=mxfp4_qat", "quant.activations=mxfp8"])
    assert cfg.model.quant.experts == "mxfp4_qat" and cfg.model.quant.activations == "mxfp8"
    assert cfg.model.quant.scale_rule == "ceil" and cfg.model.quant.activation_scale_rule == "ceil"
    assert load_config("tiny", ["model.quant.scale_rule=ocp"]).model.quant.scale_rule == "ocp"
    with pytest.raises(ConfigError, match="model.quant.experts"):
        load_config("tiny", ["quant.experts=int3"])
    with pytest.raises(ConfigError, match="did you mean model.quant.experts"):
        load_config("tiny", ["quant.expert=mxfp4"])
    with pytest.raises(ConfigError, match="moe.expert_dim: must be a multiple of 32"):
        load_config("tiny", ["quant.experts=mxfp4_qat", "model.moe.expert_dim=48"])
    load_config("tiny", ["model.moe.expert_dim=48"])  # fine without quantization


def test_qat_forward_is_the_forward_of_the_quantized_weights(tokens):
    qat = create_model(config("quant.experts=mxfp4_qat").model, seed=3)
    dense_cfg = config()
    ref = fake_quantized_experts(qat, dense_cfg)
    got, want, plain = logits_of(tokens, qat, ref, with_state(dense_cfg, nnx.state(qat)))
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - plain).max() > 1e-4  # the quantization is visible
    # the master weights are untouched (high precision, off the grid)
    w = routed_expert(qat, "w_gate")[1].get_raw_value()
    assert float(jnp.mean(fake_quantize_mxfp4(w, axis=-2) != w)) > 0.9


def test_qat_gradients_are_straight_through(tokens):
    qat = create_model(config("quant.experts=mxfp4_qat").model, seed=4)
    ref = fake_quantized_experts(qat, config())

    def grads(graphdef, params, rest):
        def loss(p):
            logits, _ = nnx.merge(graphdef, p, rest)(tokens)
            return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].reshape(-1, logits.shape[-1])[
                jnp.arange(tokens[:, 1:].size), tokens[:, 1:].reshape(-1)])

        return jax.grad(loss)(params)

    # both gradients in one jitted program (op by op, the two backward passes compiled hundreds of
    # small programs)
    (qat_def, *qat_state), (ref_def, *ref_state) = (nnx.split(m, nnx.Param, ...) for m in (qat, ref))
    both = jax.jit(lambda a, b: (grads(qat_def, *a), grads(ref_def, *b)))
    g_qat, g_ref = map(nnx.to_flat_state, both(qat_state, ref_state))
    experts = 0
    for (path, a), (path_b, b) in zip(g_qat, g_ref):
        assert path == path_b
        a, b = np.asarray(a.get_raw_value()), np.asarray(b.get_raw_value())
        # the gradient reaching the master weight is the gradient at the quantized weight
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8, err_msg=str(path))
        experts += path[-1] in ("w_gate", "w_up", "w_down") and a.ndim >= 3
        assert np.isfinite(a).all()
    assert experts == 3 * (qat.cfg.num_layers - qat.cfg.first_dense_layers)
    assert any(np.abs(np.asarray(v.get_raw_value())).max() > 0 for p, v in g_qat if p[-1] == "w_down")


def test_mxfp8_inputs_of_both_expert_matmuls():
    rng = np.random.default_rng(5)
    e, m, d, f = 4, 40, 32, 64
    xs = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    sizes = jnp.asarray([10, 0, 17, 13], jnp.int32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((e, d, f)) * 0.2, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((e, f, d)) * 0.2, jnp.float32)
    glu = dict(activation="situ_glu", beta=4.0, linear_beta=25.0)
    from k3jax.ops.activations import glu as glu_fn

    @jax.jit  # one program (op by op, the quantizers compiled dozens of small programs)
    def run(xs, sizes, w_gate, w_up, w_down):
        got = ragged_glu(xs, sizes, w_gate, w_up, w_down, act_quant=fake_quantize_mxfp8, **glu)
        # by hand: quantized xs through w_gate / w_up, quantized GLU output through w_down
        xq = fake_quantize_mxfp8(xs)
        h = glu_fn(jax.lax.ragged_dot(xq, w_gate, sizes), jax.lax.ragged_dot(xq, w_up, sizes), "situ_glu", 4.0, 25.0)
        want = jax.lax.ragged_dot(fake_quantize_mxfp8(h), w_down, sizes)
        return got, want, ragged_glu(xs, sizes, w_gate, w_up, w_down, **glu)

    got, want, plain = map(np.asarray, run(xs, sizes, w_gate, w_up, w_down))
    np.testing.assert_array_equal(got, want)
    assert 0 < float(np.abs(got - plain).max()) < 0.1 * float(np.abs(plain).max())


def test_mxfp8_model_forward_and_gradient(tokens):
    cfg = config("quant.experts=mxfp4_qat", "quant.activations=mxfp8")
    model = create_model(cfg.model, seed=6)
    weights_only_def = nnx.graphdef(abstract_model(config("quant.experts=mxfp4_qat").model))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit  # one program (op by op, each pass compiles hundreds of small programs)
    def run(params, rest):
        logits = lambda p: nnx.merge(graphdef, p, rest)(tokens)[0]  # noqa: E731
        weights_only = nnx.merge(weights_only_def, params, rest)(tokens)[0]
        return weights_only, logits(params), jax.grad(lambda p: jnp.sum(logits(p)[:, -1, :4]))(params)

    weights_only, got, g = run(params, rest)
    weights_only, got = np.asarray(weights_only), np.asarray(got)
    assert 0 < np.abs(got - weights_only).max() < 0.05 * np.abs(weights_only).max()
    # activation STE: the layers below the experts (the latent down-projection) still get gradients
    downs = [np.asarray(v.get_raw_value()) for p, v in nnx.to_flat_state(g) if p[-1] == "down"]
    assert downs and all(np.abs(d).max() > 0 for d in downs)


def test_qat_train_step():
    from k3jax.data.pipeline import make_train_dataset
    from k3jax.optim import make_optimizer
    from k3jax.training.step import TrainState, make_train_step

    cfg = config("quant.experts=mxfp4_qat", "quant.activations=mxfp8", "train.steps=2")
    model = create_model(cfg.model, seed=0)
    with nnx.use_eager_sharding(False):
        ts = TrainState(model, make_optimizer(cfg.train.optim, model, cfg.train.steps))
    graphdef, state = nnx.split(ts)
    step = make_train_step(graphdef, cfg)
    batches = iter(make_train_dataset(cfg.train))
    path, var = routed_expert(model, "w_up")
    before = np.asarray(var.get_raw_value())
    for _ in range(2):
        state, metrics = step(state, next(batches))
        assert bool(metrics["finite"]) and np.isfinite(float(metrics["loss"]))
    after = dict((tuple(p), v) for p, v in nnx.iter_graph(nnx.merge(graphdef, state).model))
    w = after[path].get_raw_value()
    assert not np.array_equal(np.asarray(w), before)  # the master weight moved
    assert float(jnp.mean(fake_quantize_mxfp4(w, axis=-2) != w)) > 0.9  # and stays high precision


def test_qat_brings_a_moe_layer_towards_its_unquantized_outputs():
    """QAT through the straight-through estimator: a K3 LatentMoE layer whose routed experts are
    fake-quantized is trained to reproduce the same layer unquantized; its error falls well below
    what rounding the weights to nearest gives (the quantized starting point)."""
    import optax

    from k3jax.layers.latent_moe import LatentMoE

    base = ["model.moe.num_shared_experts=0"]  # the routed experts are the layer's whole output
    with nnx.use_eager_sharding(False):
        teacher = LatentMoE(load_config("tiny", base).model, rngs=nnx.Rngs(0))
        shaped = LatentMoE(load_config("tiny", base + ["quant.experts=mxfp4_qat"]).model, rngs=nnx.Rngs(0))
    student = nnx.merge(nnx.graphdef(shaped), jax.tree.map(jnp.copy, nnx.state(teacher)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64, 64)), jnp.float32)
    target = teacher(x)[0]

    def rel_error(m):
        return jnp.mean((m(x)[0] - target) ** 2) / jnp.mean(target**2)

    before = float(rel_error(student))
    opt = nnx.Optimizer(student, optax.adam(3e-5), wrt=nnx.Param)

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(rel_error)(m)
        opt.update(m, grads)
        return loss

    for _ in range(60):
        step(student, opt)
    after = float(rel_error(student))
    print(f"MoE layer, routed experts MXFP4 (relative squared error vs unquantized): {before:.4f} -> {after:.4f}")
    assert 0.01 < before and after < 0.75 * before


@pytest.mark.slow
def test_qat_fine_tuning_closes_the_quantization_gap():
    """The tiny model (5 layers, routed experts only) memorises two batches in high precision; then
    30 more steps either plain or with MXFP4 QAT (the real train step). The quantized model's loss
    gap to the unquantized loss shrinks under QAT, and QAT's quantized loss beats quantizing the
    plainly fine-tuned model (PTQ)."""
    from k3jax.data.pipeline import make_train_dataset
    from k3jax.optim import make_optimizer
    from k3jax.training.step import TrainState, make_train_step, next_token_loss

    base = ["model.num_layers=5", "model.moe.num_shared_experts=0", "model.first_dense_layers=0"]
    pre = config(*base, "train.steps=80")
    tune = [*base, "train.steps=30", "train.optim.schedule=constant", "train.optim.warmup_steps=0",
            "train.optim.learning_rate=1.0e-3"]
    it = iter(make_train_dataset(pre.train))
    fixed = [next(it), next(it)]

    def train(cfg, model, steps):
        with nnx.use_eager_sharding(False):
            ts = TrainState(model, make_optimizer(cfg.train.optim, model, cfg.train.steps))
        graphdef, state = nnx.split(ts)
        step = make_train_step(graphdef, cfg)
        for i in range(steps):
            state, _ = step(state, fixed[i % len(fixed)])
        return nnx.merge(graphdef, state).model

    def nll_fn(cfg):
        graphdef = nnx.graphdef(abstract_model(cfg.model))

        @jax.jit
        def nll(s, b):
            logits, _ = nnx.merge(graphdef, s)(b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"])
            return next_token_loss(logits, b["targets"], b["loss_mask"])[1:]

        return nll

    # One compile per forward (unquantized, MXFP4), applied to the three models' states.
    nll_fns = {"fp": nll_fn(config(*base)), "q": nll_fn(config(*base, "quant.experts=mxfp4_qat"))}

    def losses(model):
        out = {}
        for name, nll in nll_fns.items():
            sums = [nll(nnx.state(model), b) for b in fixed]
            out[name] = sum(float(n) for _, n in sums) / sum(float(c) for c, _ in sums)
        return out

    def copy(model, cfg):
        return with_state(cfg, jax.tree.map(jnp.copy, nnx.state(model)))

    w0 = train(pre, create_model(pre.model, seed=0), 80)
    fp_cfg, qat_cfg = config(*tune), config(*tune, "quant.experts=mxfp4_qat")
    fine = train(fp_cfg, copy(w0, fp_cfg), 30)
    qat = train(qat_cfg, copy(w0, qat_cfg), 30)
    l0, lf, lq = losses(w0), losses(fine), losses(qat)
    print(f"\nbefore fine-tuning: unquantized {l0['fp']:.5f}, MXFP4 {l0['q']:.5f} (gap {l0['q'] - l0['fp']:+.5f})"
          f"\nplain fine-tuning:  unquantized {lf['fp']:.5f}, MXFP4 {lf['q']:.5f} (gap {lf['q'] - lf['fp']:+.5f})"
          f"\nQAT fine-tuning:    unquantized {lq['fp']:.5f}, MXFP4 {lq['q']:.5f} (gap {lq['q'] - lq['fp']:+.5f})")
    assert l0["q"] > l0["fp"]  # quantization costs something before QAT
    assert lq["q"] - lq["fp"] < l0["q"] - l0["fp"]  # QAT shrinks the gap
    assert lq["q"] < lf["q"]  # and beats quantizing the plainly fine-tuned model


def test_qat_fine_tuning_starts_from_another_run(tmp_path):
    """``train.init_from``: a QAT run takes its initial weights from an unquantized run's checkpoint."""
    from k3jax.training import checkpoint
    from k3jax.training.trainer import init_weights_from

    dense = config()
    source = create_model(dense.model, seed=7)
    checkpoint.save_model(tmp_path / "base" / "checkpoints", source, dense)
    qat = create_model(config("quant.experts=mxfp4_qat").model, seed=8)
    init_weights_from(qat, str(tmp_path / "base"))
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(qat)), nnx.to_flat_state(nnx.state(source))):
        np.testing.assert_array_equal(np.asarray(a.get_raw_value()), np.asarray(b.get_raw_value()), err_msg=str(p))
    other = create_model(config("model.num_layers=2").model, seed=0)
    with pytest.raises(checkpoint.CheckpointError, match="another architecture"):
        init_weights_from(other, str(tmp_path / "base"))

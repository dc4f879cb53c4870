"""LoRA fine-tuning (k3jax/layers/lora.py, docs/design.md "LoRA"): the low-rank path against plain
einsums and the merged weight (values and gradients), a zero B changing nothing, a train step that moves
only the adapters (base bit-identical, optimizer state only for adapters), adapters trained here and
exported in PEFT's format loaded by ``peft`` onto transformers' Kimi Linear and DeepSeek-V3 (logits, and
the merged export's), the abstract K3 LoRA state, and a Ctrl-C'd LoRA run resuming bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.training import checkpoint
from k3jax.config import Config, ConfigError, LoRAConfig, OptimConfig, TrainConfig, load_config
from k3jax.layers import lora
from k3jax.layers.lora import LoRAParam
from k3jax.model import abstract_model, create_model
from k3jax.training.step import abstract_train_state, make_train_step, new_train_state

pytestmark = pytest.mark.usefixtures("fast_xla")

# A two-layer tiny K3: KDA with the dense FFN, MLA with a latent MoE and a shared expert, float32.
TWO_LAYERS = ["model.num_layers=2", "model.attn_res.block_size=1"]


def _randomize(model, scale=0.05, seed=0):
    """Every adapter factor random (B too: a zero B hides the low-rank path)."""
    state = nnx.state(model, LoRAParam)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]))


def _batch(rng, b, t, vocab):
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    return {"tokens": tokens, "segment_ids": np.ones((b, t), np.int32),
            "positions": np.tile(np.arange(t, dtype=np.int32), (b, 1)), "targets": np.roll(tokens, -1, 1),
            "loss_mask": np.ones((b, t), np.int32)}


# ---------------------------------------------------------------------------------------------
# The op


@pytest.mark.parametrize("spec, w_shape, n_in", [
    ("btd,dhk->bthk", (5, 3, 4), 1),  # q/k/v projections
    ("btd,dh->bth", (5, 3), 1),  # KDA beta
    ("bthk,hkd->btd", (3, 4, 5), 2),  # o_proj: two input axes
    ("nd,dl->nl", (5, 7), 1),
])
def test_low_rank_path_is_the_merged_weight(spec, w_shape, n_in):
    """``x W + s (x A) B`` on the activation side equals ``x (W + s A B)``, for odd shapes."""
    rng = np.random.default_rng(0)
    x_shape = {"btd": (2, 3, 5), "bthk": (2, 3, 3, 4), "nd": (6, 5)}[spec.split(",")[0]]
    r = 2
    a = rng.standard_normal((*w_shape[:n_in], r)).astype(np.float32)
    b = rng.standard_normal((r, *w_shape[n_in:])).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    ad = lora.Adapter(LoRAParam(jnp.asarray(a)), LoRAParam(jnp.asarray(b)), scale=0.75, dropout=0.0, num_in=n_in)
    delta = np.asarray(ad.delta(jnp.asarray(x), spec, jnp.float32, None), np.float64)
    ab = np.tensordot(a.astype(np.float64), b.astype(np.float64), axes=1)
    np.testing.assert_allclose(delta, 0.75 * np.einsum(spec, x.astype(np.float64), ab), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ad.product()), 0.75 * ab, rtol=1e-5, atol=1e-6)


def test_low_rank_specs_and_dropout():
    assert lora.low_rank_specs("btd,dhk->bthk") == ("btd,da->bta", "bta,ahk->bthk")
    assert lora.low_rank_specs("bthv,hvd->btd") == ("bthv,hva->bta", "bta,ad->btd")
    with pytest.raises(ValueError, match="contracted dims must come first"):
        lora.low_rank_specs("btd,hd->bth")
    x = jnp.ones((4, 64, 8))
    ad = lora.Adapter(LoRAParam(jnp.eye(8, 8)), LoRAParam(jnp.eye(8, 8)), scale=1.0, dropout=0.5, num_in=1)
    kept = np.asarray(ad.delta(x, "btd,de->bte", jnp.float32, jax.random.key(0)))
    assert set(np.unique(kept)) == {0.0, 2.0}  # dropped, or kept and scaled by 1 / (1 - p)
    np.testing.assert_array_equal(np.asarray(ad.delta(x, "btd,de->bte", jnp.float32, None)), np.asarray(x))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"train.lora.targets: unknown target 'mla.qb' \(did you mean 'mla.q_b'"):
        load_config("tiny", ["train.lora.rank=4", "train.lora.targets=[mla.qb]"])
    with pytest.raises(ConfigError, match="train.lora.targets: unknown target 'router'"):
        load_config("tiny", ["train.lora.rank=4", "train.lora.targets=[router]"])
    with pytest.raises(ConfigError, match="train.lora.dropout"):
        load_config("tiny", ["train.lora.rank=4", "train.lora.dropout=1"])
    with pytest.raises(ConfigError, match="train.optim.qk_clip_tau"):
        load_config("tiny", ["train.lora.rank=4", "train.optim.qk_clip_tau=100"])
    assert LoRAConfig(rank=4, alpha=8, use_rslora=True).scale == 4.0
    assert LoRAConfig(rank=4, targets=("mla.q_b", "kda")).sites("mla") == {"q_b"}


# ---------------------------------------------------------------------------------------------
# The model


@pytest.fixture(scope="module")
def two_layer():
    cfg = load_config("tiny", TWO_LAYERS + ["train.lora.rank=3", "train.lora.alpha=6"])
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (2, 13)), jnp.int32)
    return cfg, tokens


def test_adapters_mirror_the_weights_and_zero_b_is_the_base(two_layer):
    cfg, tokens = two_layer
    model = create_model(cfg.model, seed=3)
    base = np.asarray(model(tokens)[0])
    before = jax.tree.map(np.asarray, nnx.state(model))
    model.add_lora(cfg.train.lora, nnx.Rngs(0))
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(LoRAParam)))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    sites = {(p[:-2], p[-2]) for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    names = {s for _, s in sites}
    assert names == {"q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "o_proj", "q_a", "q_b", "kv_a", "kv_b",
                     "w_gate", "w_up", "w_down"}
    assert not any("router" in str(p) or "experts" in str(p) for p in sites)
    variables = dict(nnx.iter_graph(model))
    for path, name in sites:
        w = variables[path[:-1] + (name,)]
        ad = variables[path + (name,)]
        n_in = ad.num_in
        assert ad.a.shape == (*w.shape[:n_in], 3) and ad.b.shape == (3, *w.shape[n_in:])
        assert not np.any(np.asarray(ad.b[...])) and np.any(np.asarray(ad.a[...]))
    np.testing.assert_array_equal(np.asarray(model(tokens)[0]), base)  # B = 0: exactly the base


@pytest.mark.slow
def test_merge_and_unroll_keep_the_logits(two_layer):
    cfg, tokens = two_layer
    model = create_model(cfg.model, seed=3)
    model.add_lora(cfg.train.lora, nnx.Rngs(0))
    _randomize(model)
    out = np.asarray(model(tokens)[0])
    from k3jax.model import unroll_layers

    np.testing.assert_allclose(np.asarray(unroll_layers(model)(tokens)[0]), out, rtol=1e-5, atol=1e-5)
    model.merge_lora()
    assert model.lora_config is None and not jax.tree.leaves(nnx.state(model, LoRAParam))
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), out, rtol=1e-5, atol=1e-5)


def test_adapter_gradients_match_the_merged_weight_formula(two_layer):
    """jax.grad through the activation-side path equals jax.grad of ``x (W + s A B)``."""
    cfg, tokens = two_layer
    model = create_model(cfg.model, seed=3)
    model.add_lora(cfg.train.lora, nnx.Rngs(0))
    _randomize(model)
    graphdef, adapters, rest = nnx.split(model, LoRAParam, ...)
    targets = jnp.roll(tokens, -1, 1)

    def loss(m):
        logits = m(tokens)[0]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    def ours(ad, rest):
        return loss(nnx.merge(graphdef, ad, rest))

    def merged(ad, rest):
        m = nnx.merge(graphdef, ad, rest)
        m.merge_lora()  # W + s A B formed on the weight side, differentiable in A and B
        return loss(m)

    g1 = jax.jit(jax.grad(ours))(adapters, rest)
    g2 = jax.jit(jax.grad(merged, argnums=(0, 1)))(adapters, rest)[0]  # the merge writes W: same trace level
    for (p, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves_with_path(g2)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.any(a), p
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6 * np.abs(b).max(), err_msg=str(p))


def test_train_step_moves_only_the_adapters(two_layer):
    cfg, _ = two_layer
    cfg = load_config("tiny", TWO_LAYERS + ["train.lora.rank=3", "train.lora.dropout=0.1", "train.seq_len=16",
                                            "train.batch_size=4", "train.grad_accum=2", "train.optim.warmup_steps=1"])
    model = create_model(cfg.model, seed=3)
    model.add_lora(cfg.train.lora, nnx.Rngs(0))
    with nnx.use_eager_sharding(False):
        ts = new_train_state(cfg, model)
    base = jax.tree.map(np.array, nnx.state(ts.model, nnx.Not(LoRAParam)))
    adapter_shapes = {x.shape for x in jax.tree.leaves(nnx.state(ts.model, LoRAParam))}
    for x in jax.tree.leaves(nnx.state(ts.optimizer)):  # adam mu / nu of the adapters, counters
        assert x.shape in adapter_shapes or x.ndim == 0, x.shape
    graphdef, state = nnx.split(ts)
    step = make_train_step(graphdef, cfg)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(3):
        state, metrics = step(state, _batch(rng, 4, 16, cfg.model.vocab_size))
        losses.append(float(metrics["loss"]))
        assert bool(metrics["finite"])
    ts = nnx.merge(graphdef, state)
    for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(base),
                         jax.tree.leaves(nnx.state(ts.model, nnx.Not(LoRAParam)))):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=str(p))  # router bias included: QB is off
    bs = [np.asarray(v.get_raw_value()) for p, v in nnx.to_flat_state(nnx.state(ts.model, LoRAParam)) if p[-1] == "b"]
    assert all(np.any(b) for b in bs)
    assert np.all(np.isfinite(losses))


def test_lora_state_is_small_on_the_abstract_k3():
    """Full K3 with frozen MXFP4-packed routed experts: the LoRA train state is built without allocating,
    and the optimizer holds adapters only (the AOT row's state)."""
    cfg = load_config("k3", ["train.lora.rank=16", "model.quant.experts=mxfp4"])
    graphdef, state = abstract_train_state(cfg)
    opt = jax.tree.leaves(state["optimizer"])
    adapters = jax.tree.leaves(nnx.state(nnx.merge(graphdef, state).model, LoRAParam))
    size = lambda xs: sum(int(np.prod(x.shape)) for x in xs)  # noqa: E731
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in opt + adapters)
    assert size(opt) == 2 * size(adapters) + len(opt) - 2 * len(adapters)  # mu, nu + scalar counters
    assert size(adapters) < 1e-2 * size(jax.tree.leaves(state["model"]))


# ---------------------------------------------------------------------------------------------
# PEFT and transformers

torch = pytest.importorskip("torch")
from test_hf_interop import deepseek_ckpt, kimi_linear_ckpt, tokens  # noqa: E402,F401 (fixtures)


def _train_adapters(model, targets, steps=2):
    """A few real train steps of adapters on ``model`` (B leaves zero)."""
    cfg = Config(model=model.cfg, train=TrainConfig(
        batch_size=2, seq_len=20, steps=10, lora=LoRAConfig(rank=4, alpha=8.0, targets=targets),
        optim=OptimConfig(learning_rate=3e-2, warmup_steps=1)))
    cfg.validate()
    model.add_lora(cfg.train.lora, nnx.Rngs(0))
    with nnx.use_eager_sharding(False):
        ts = new_train_state(cfg, model)
    graphdef, state = nnx.split(ts)
    step = make_train_step(graphdef, cfg)
    rng = np.random.default_rng(5)
    for _ in range(steps):
        state, _ = step(state, _batch(rng, 2, 20, model.cfg.vocab_size))
    model = nnx.merge(graphdef, state).model
    assert all(np.any(np.asarray(v.get_raw_value())) for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam)))
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v3"])
def test_trained_adapter_loads_in_peft(family, request, tmp_path, tokens):  # noqa: F811
    peft = pytest.importorskip("peft")  # here, not at the top: the module's other tests do not need it
    from k3jax.interop import from_hf, to_hf
    from k3jax.interop.peft import load_peft, save_peft

    path, base_ref = request.getfixturevalue({"kimi_linear": "kimi_linear_ckpt", "deepseek_v3": "deepseek_ckpt"}[family])
    overrides = ["kda.chunk_size=8"] if family == "kimi_linear" else []
    # PEFT retargets DeepSeek-V3's gate/up/down_proj to its fused routed experts (k3jax.interop.peft)
    targets = ("mla", "kda", "ffn", "shared") if family == "kimi_linear" else ("mla",)
    model = _train_adapters(from_hf(path, overrides=overrides), targets)
    ours = np.asarray(model(jnp.asarray(tokens))[0])
    base = from_hf(path, overrides=overrides)
    base_err = np.abs(np.asarray(base(jnp.asarray(tokens))[0]) - base_ref).max()
    config = save_peft(model, tmp_path / "adapter", model_type=family)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["target_modules"] == config["target_modules"]

    cls = getattr(__import__("transformers"), "KimiLinearForCausalLM" if family == "kimi_linear"
                  else "DeepseekV3ForCausalLM")
    hf = peft.PeftModel.from_pretrained(cls.from_pretrained(path).eval(), tmp_path / "adapter").eval()
    from k3jax.interop.safetensors_io import SafetensorsFile

    with SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors") as f:
        exported = {k[len("base_model.model."): -len(".lora_A.weight")] for k in f.keys() if "lora_A" in k}
    assert {n[len("base_model.model."): -len(".lora_A")] for n, _ in hf.named_modules()
            if n.endswith(".lora_A")} == exported  # peft adapted exactly the exported modules
    ref = _hf_logits(hf, tokens)
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    print(f"\n{family}: LoRA vs peft max abs {err:.2e} (base vs transformers {base_err:.2e}), |logits| {scale:.2f}")
    assert np.abs(ref - base_ref).max() > 1e-2 * scale  # the adapter moved the logits
    assert err <= max(1e-5 * scale, 1.5 * base_err)  # the base model's own parity bounds it

    reloaded = from_hf(path, overrides=overrides)
    load_peft(reloaded, tmp_path / "adapter")
    np.testing.assert_array_equal(np.asarray(reloaded(jnp.asarray(tokens))[0]), ours)

    model.merge_lora()  # merged weights exported as a plain HF checkpoint give the same logits
    to_hf(model, tmp_path / "merged", model_type=family)
    merged = _hf_logits(cls.from_pretrained(tmp_path / "merged").eval(), tokens)
    assert np.abs(merged - ref).max() <= 1e-5 * scale


# ---------------------------------------------------------------------------------------------
# Runs


@pytest.mark.slow
def test_lora_run_resumes_bit_exact_and_converts(tmp_path):
    """A LoRA run from ``train.init_from`` stopped by Ctrl-C and resumed logs the uninterrupted run's losses
    bit for bit; its checkpoints hold the adapters and name the base; convert merges and exports them."""
    from test_train import SMALL, STEPS, train_env, logged_steps, train_cmd

    from k3jax.training.run_log import read_metrics

    base_cfg = load_config("tiny", SMALL)
    checkpoint.save_model(tmp_path / "base" / "checkpoints", create_model(base_cfg.model, seed=4), base_cfg, step=7)
    lora_args = ["train.lora.rank=4", "train.lora.dropout=0.1", f"train.init_from={tmp_path / 'base'}"]
    env = train_env()
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run(train_cmd(straight, *lora_args), env=env, check=True, capture_output=True, timeout=900)
    proc = subprocess.Popen(train_cmd(stopped, *lora_args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while logged_steps(stopped) < 5 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 130, output
    stop_step = logged_steps(stopped)
    assert 5 <= stop_step < STEPS, output
    subprocess.run(train_cmd(stopped, *lora_args), env=env, check=True, capture_output=True, timeout=900)
    want, got = read_metrics(straight), read_metrics(stopped)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "lr", "eval_loss"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))

    ckpts = stopped / "checkpoints"
    with checkpoint.manager(ckpts, item_names=checkpoint.LORA_TRAIN_ITEMS) as mngr:
        base = checkpoint.restore_base(mngr, STEPS)
    assert base == {"kind": "orbax", "path": str((tmp_path / "base" / "checkpoints").absolute()), "step": 7}
    model, saved = checkpoint.restore_model(ckpts)
    assert saved.train.lora.rank == 4 and model.lora_config == saved.train.lora
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (1, 9)), jnp.int32)
    out = np.asarray(model(tokens)[0])
    from k3jax.convert import main as convert

    assert convert(["--from-orbax", str(stopped), "--to-orbax", str(tmp_path / "merged"), "--no-progress"]) == 0
    merged, merged_cfg = checkpoint.restore_model(tmp_path / "merged")
    assert merged.lora_config is None and not merged_cfg.train.lora.enabled
    np.testing.assert_allclose(np.asarray(merged(tokens)[0]), out, rtol=1e-5, atol=1e-5)
    assert convert(["--from-orbax", str(stopped), "--to-peft", str(tmp_path / "peft"), "--no-progress"]) == 0
    plain, _ = checkpoint.restore_model(tmp_path / "base" / "checkpoints")
    checkpoint.restore_adapters(plain, tmp_path / "peft")
    np.testing.assert_array_equal(np.asarray(plain(tokens)[0]), out)

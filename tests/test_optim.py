"""k3jax.optim: per-head Muon blocks, parameter groups of the tiny model, schedules, weight decay,
QK-clip, and a short training run that lowers the loss."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from k3jax import optim
from k3jax.optim import muon, newton_schulz, qk_clip
from k3jax.config import ConfigError, OptimConfig, load_config
from k3jax.model import abstract_model, create_model

from cpu_devices import run_child

MDN = optim.MDN


def _cfg(**kw) -> OptimConfig:
    """lr = 1, no schedule, no clipping, no decay: ``tx.update`` returns minus the Muon update."""
    base = dict(learning_rate=1.0, schedule="constant", warmup_steps=0, weight_decay=0.0, grad_clip=0.0)
    base.update(kw)
    return OptimConfig(**base)


class Toy(nnx.Module):
    """Per-head projections, an output projection, routed experts, a norm and an embedding."""

    def __init__(self, d=64, h=4, dh=16, e=4, din=32, dout=16):
        r = np.random.default_rng(0)

        def p(shape, axes):
            return nnx.Param(jnp.asarray(0.02 * r.standard_normal(shape), jnp.float32), out_sharding=axes)

        with nnx.use_eager_sharding(False):
            self.embed = p((32, d), ("vocab", "embed"))
            self.q_proj = p((d, h, dh), ("embed", "heads", "head_dim"))
            self.o_proj = p((h, dh, d), ("heads", "head_dim", "embed"))
            self.w_up = p((e, din, dout), ("expert", "expert_in", "expert_mlp"))
            self.norm_weight = nnx.Param(jnp.ones((d,)), out_sharding=("norm",))


def _muon_update(model, grads, **kw):
    tx = optim.make_optimizer(_cfg(**kw), model, total_steps=10)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    return jax.tree.map(lambda u: -np.asarray(u, np.float64), updates)


def _scaled_grads(model, head_scales, expert_scales, seed=0):
    r = np.random.default_rng(seed)
    g = jax.tree.map(lambda x: np.asarray(r.standard_normal(x.shape), np.float32),
                     nnx.as_pure(nnx.state(model, nnx.Param)))
    g["q_proj"] = g["q_proj"] * np.asarray(head_scales, np.float32)[None, :, None]
    g["o_proj"] = g["o_proj"] * np.asarray(head_scales, np.float32)[:, None, None]
    g["w_up"] = g["w_up"] * np.asarray(expert_scales, np.float32)[:, None, None]
    return jax.tree.map(jnp.asarray, g)


def _sv_ratio(m):
    s = np.linalg.svd(m, compute_uv=False)
    return s.max() / s.min()


def _rms(m):
    return float(np.sqrt(np.mean(np.square(m))))


HEAD_SCALES = [1e-3, 1e-2, 1e-1, 1.0]
EXPERT_SCALES = [1e-3, 1e-1, 1.0, 10.0]


@pytest.fixture(scope="module")
def toy_updates():
    """Muon updates (lr = 1) of a toy model whose heads / experts have very different gradient
    scales: per-head (the default) and whole-matrix (the ablation)."""
    model = Toy()
    grads = _scaled_grads(model, HEAD_SCALES, EXPERT_SCALES)
    return _muon_update(model, grads), _muon_update(model, grads, per_head_muon=False)


def test_per_head_blocks_are_orthogonal_and_full_matrix_is_not(toy_updates):
    per_head, whole = toy_updates
    d, h, dh = per_head["q_proj"].shape
    expected_rms = 0.2  # 0.2 * sqrt(max(d, dh)) * ||O||_F / sqrt(d * dh) with an orthogonal O
    for i in range(h):
        block = per_head["q_proj"][:, i, :]
        assert _sv_ratio(block) < 3.0, (i, _sv_ratio(block))
        assert 0.6 * expected_rms < _rms(block) < 1.2 * expected_rms, (i, _rms(block))
        oblock = per_head["o_proj"][i]  # (dh, d): split on the input side
        assert _sv_ratio(oblock) < 3.0
        assert 0.6 * expected_rms < _rms(oblock) < 1.2 * expected_rms
    # Every head moves by the same amount whatever its gradient scale.
    rms = [_rms(per_head["q_proj"][:, i, :]) for i in range(h)]
    assert max(rms) / min(rms) < 1.3, rms
    # The (d, H*dh) matrix as a whole is not orthogonal: its singular values spread widely (the head
    # blocks' column spaces are not mutually orthogonal). Measured: blocks ~1.65, full ~230.
    full_per_head = per_head["q_proj"].reshape(d, h * dh)
    assert _sv_ratio(full_per_head) > 5.0, _sv_ratio(full_per_head)
    # Whole-matrix Muon (the ablation) cannot orthogonalise it either in 5 steps when the head
    # gradient scales differ by 1000x (measured ~750).
    full_whole = whole["q_proj"].reshape(d, h * dh)
    assert _sv_ratio(full_whole) > 30.0, _sv_ratio(full_whole)
    # Whole-matrix Muon starves the small-gradient heads; per-head Muon does not.
    whole_rms = [_rms(whole["q_proj"][:, i, :]) for i in range(h)]
    assert whole_rms[0] / whole_rms[-1] < 0.2, whole_rms
    assert _sv_ratio(full_whole) > 10 * max(_sv_ratio(per_head["q_proj"][:, i, :]) for i in range(h))


def test_experts_are_orthogonalised_one_by_one(toy_updates):
    for up in (toy_updates[0]["w_up"], toy_updates[1]["w_up"]):  # (E, 32, 16), per expert in both modes
        for e in range(up.shape[0]):
            assert _sv_ratio(up[e]) < 3.0
            assert 0.6 * 0.2 < _rms(up[e]) < 1.2 * 0.2  # 0.2 * sqrt(32) * sqrt(16 / 512)


@pytest.mark.parametrize("shape", [(5, 8, 12), (3, 16, 16), (2, 4, 7, 9)])
def test_cpu_block_by_block_newton_schulz_equals_the_batch(monkeypatch, shape):
    """Small blocks run Newton-Schulz one block at a time on XLA:CPU (a loop of 2-D dots); the values are
    the batched iteration's, and the loop is really in the compiled program (a while loop, gone when the
    threshold is 0)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    dn = optim.MDN(reduction_axis=(-2,), output_axis=(-1,))

    def run():
        f = jax.jit(lambda x: newton_schulz.orthogonalize_blocks([x], [dn])[0])
        return f(x), f.lower(x).compile().as_text().count(" while(")

    got, got_loops = run()
    monkeypatch.setattr(newton_schulz, "CPU_BLOCK_LOOP_ELEMENTS", 0)
    want, want_loops = run()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert got_loops > want_loops
    assert _sv_ratio(np.asarray(got).reshape(-1, *shape[-2:])[0]) < 3.0


def test_newton_schulz_is_split_over_the_devices_not_repeated():
    """4 fake CPU devices holding FSDP shards of stacked blocks: each device orthogonalises its share
    of the blocks (the same values as one device), not every block."""
    run_child("newton_schulz_split", n=4)


def _v5p_mesh(slice_name: str, **axes):
    """A mesh over a v5p topology from libtpu (no TPU needed), or the test is skipped."""
    pytest.importorskip("libtpu")
    from k3jax import aot
    from k3jax.config import MeshConfig
    from k3jax.sharding import make_mesh

    try:
        devices = aot.TpuSlice.v5p(slice_name).devices()
    except Exception as e:  # libtpu present but unusable on this host
        pytest.skip(f"no TPU topology from libtpu: {e}")
    return make_mesh(MeshConfig(data=1, **axes), devices)


def _compile_muon_update(tx, params, mesh, sharding):
    """``tx.update`` compiled for abstract ``params`` on ``mesh``: the momentum stored like the parameters
    (``sharding``), the step count replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding if x.ndim else NamedSharding(mesh, P())), state)
        return jax.jit(tx.update).lower(params, state).compile()


@pytest.mark.tpu_aot
def test_newton_schulz_of_fsdp_sharded_experts_is_not_replicated_on_tpu():
    """Compiled for v5p-8 (libtpu, no TPU): stacked experts' blocks stored over expert x fsdp and
    orthogonalised together. XLA:TPU gathers the blocks to concatenate and orthogonalise them; without
    the spread the fsdp devices repeat each other's work (1.33x the analytic share here, 8.5x for full
    K3 on v5p-2048)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers
    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-8", fsdp=2, expert=2)
    layers, e, r = 4, 16, 128  # three stacked [r, r] expert weights, batched together (one block shape)
    x = jax.ShapeDtypeStruct((layers, e, r, r), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "expert", "fsdp", None)))
    dn = MuonDimensionNumbers(reduction_axis=2, output_axis=3)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda *xs: newton_schulz.orthogonalize_blocks(xs, [dn] * 3)).lower(x, x, x).compile()
    per_device = breakdown.breakdown(hlo.as_text()).part_flops("newton_schulz")
    analytic = 3 * layers * e * 5 * 2 * 3 * r ** 3 / mesh.size
    assert per_device <= 1.2 * analytic, per_device / analytic


@pytest.mark.tpu_aot
def test_newton_schulz_spread_keeps_blocks_in_their_expert_group_on_tpu():
    """Compiled for v5p-512 (K2's mesh, fsdp 2 x expert 64 x sequence 2): 384 stacked experts' blocks,
    stored over expert x (fsdp, sequence). Spreading the blocks over the mesh axes in mesh order moved
    every block to another expert group, which XLA:TPU did by gathering the whole batch on every device
    (all-reduce bytes = the whole batch); with ``expert`` as the spread's major axis each device
    exchanges a few times its share inside its group (measured 4.7% of the batch)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers
    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-512", fsdp=2, expert=64, sequence=2)
    layers, e, r = 4, 384, 256
    x = jax.ShapeDtypeStruct((layers, e, r, r), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "expert", ("fsdp", "sequence"), None)))
    dn = MuonDimensionNumbers(reduction_axis=2, output_axis=3)
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda *xs: newton_schulz.orthogonalize_blocks(xs, [dn] * 3)).lower(x, x, x).compile()
    moved = sum(breakdown.breakdown(hlo.as_text()).collective_bytes.values())
    whole = 3 * layers * e * r * r * 2
    assert moved < 0.1 * whole, moved / whole


@pytest.mark.tpu_aot
def test_stack_of_single_blocks_is_orthogonalised_once_over_the_mesh_on_tpu():
    """Compiled for v5p-16 (libtpu, no TPU), 8 devices: three stacked weights of one block per layer (a
    shared expert, a latent projection), 2 layers, whose 2 x 3 blocks fit on the mesh, are updated
    whole (no per-layer loop), their blocks concatenated and spread one per device: each device
    orthogonalises at most one block. (Full K3, one layer at a time: each layer's single block was
    padded to the 1024 devices or its matmuls split along a 7-row shard; the shared experts'
    Newton-Schulz was 61% of the optimizer's FLOPs, which were 4.2x their analytic count.)"""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-16", fsdp=8)
    layers, r, o = 2, 256, 512
    sharded = NamedSharding(mesh, P(None, "fsdp", None))
    g = jax.ShapeDtypeStruct((layers, r, o), jnp.bfloat16, sharding=sharded)
    params = {name: g for name in ("gate", "up", "down")}
    dn = optim.MDN(reduction_axis=(1,), output_axis=(2,))
    tx = muon.scale_by_grouped_muon(lambda u: {k: dn for k in u}, stacked=lambda u: {k: True for k in u},
                                     group_max_size=1 << 16, mu_dtype=jnp.bfloat16)
    hlo = _compile_muon_update(tx, params, mesh, sharded).as_text()
    per_device = breakdown.breakdown(hlo).part_flops("newton_schulz")
    one_block = 5 * (2 * r * r * o * 2 + 2 * r ** 3)  # five iterations of X X^T, (X X^T)^2, (.) X
    assert 0.9 * one_block <= per_device <= 1.1 * one_block, per_device / one_block
    assert " while(" not in hlo  # the stacks are not walked layer by layer


def test_bfloat16_muon_keeps_bf16_momentum_and_close_updates():
    model = Toy()
    grads = _scaled_grads(model, HEAD_SCALES, EXPERT_SCALES)
    tx = optim.make_optimizer(_cfg(muon_dtype="bfloat16"), model, total_steps=10)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    state = tx.init(params)
    momenta = [x for x in jax.tree.leaves(state) if getattr(x, "ndim", 0) == 3]
    assert momenta and all(x.dtype == jnp.bfloat16 for x in momenta if x.shape == params["q_proj"].shape)
    got = jax.tree.map(lambda u: -np.asarray(u, np.float64), jax.jit(tx.update)(grads, state, params)[0])
    want = _muon_update(model, grads)
    for name in ("q_proj", "o_proj", "w_up"):
        # bf16 rounding through 5 Newton-Schulz steps (measured up to 5.5%; the float32 NS output itself
        # only approximates the orthogonal factor, singular values 0.7-1.2), not float32.s ~1e-7
        err = np.linalg.norm(got[name] - want[name]) / np.linalg.norm(want[name])
        assert 1e-4 < err < 0.1, (name, err)
    for i in range(got["q_proj"].shape[1]):  # still one orthogonalised block per head
        assert _sv_ratio(got["q_proj"][:, i, :]) < 3.0


def test_adamw_params_get_adam_updates(toy_updates):
    # First Adam step: m_hat / sqrt(v_hat) = sign(g) (up to eps) for every element.
    for name in ("embed", "norm_weight"):
        np.testing.assert_allclose(np.abs(toy_updates[0][name]), 1.0, rtol=1e-3)


def test_adamw_only_optimizer_gives_every_parameter_adams_first_step():
    """``optimizer=adamw``: every parameter, the matrices and experts included, takes AdamW's first step,
    ``-lr * (g / (|g| + eps) + wd * W)``, with weight decay where Muon would decay; no Muon state."""
    model = Toy()
    lr, wd, eps = 0.5, 0.1, 1e-8
    cfg = _cfg(optimizer="adamw", adam_learning_rate=lr, weight_decay=wd, adam_eps=eps)
    tx = optim.make_optimizer(cfg, model, total_steps=10)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    grads = _scaled_grads(model, [1.0, 3.0, 0.1, 2.0], [1.0, 5.0, 0.2, 1.0])
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    decayed = {path[-1] for path, (_, _, decay) in optim.group_table(model).items() if decay}
    assert decayed == {"embed", "q_proj", "o_proj", "w_up"}
    for name, g in grads.items():
        want = -lr * (g / (np.abs(g) + eps) + (wd * np.asarray(params[name]) if name in decayed else 0.0))
        np.testing.assert_allclose(updates[name], want, rtol=1e-5, atol=1e-7, err_msg=name)
    assert not any(isinstance(x, muon.GroupedMuonState)
                   for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, muon.GroupedMuonState)))
    # The default differs exactly on the Muon group (same settings otherwise).
    muon_tx = optim.make_optimizer(dataclasses.replace(cfg, optimizer="muon"), model, total_steps=10)
    muon_updates, _ = jax.jit(muon_tx.update)(grads, muon_tx.init(params), params)
    for name in grads:
        same = np.allclose(muon_updates[name], updates[name], rtol=1e-5, atol=1e-7)
        assert same == (name in ("embed", "norm_weight")), name


def test_adamw_only_optimizer_has_no_newton_schulz_flops():
    from k3jax.aot import analytic

    cfg = load_config("tiny")
    assert analytic.newton_schulz_flops(cfg) > 0
    assert analytic.newton_schulz_flops(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, optim=dataclasses.replace(cfg.train.optim, optimizer="adamw")))) == 0
    with pytest.raises(ConfigError, match="optimizer"):
        load_config("tiny", ["train.optim.optimizer=sgd"])


def test_dimension_numbers_with_and_without_heads():
    model = Toy()
    dn = optim.muon_dimension_numbers(model)
    assert dn["q_proj"] == MDN(0, 2)  # heads (axis 1) is a batch axis
    assert dn["o_proj"] == MDN(1, 2)
    assert dn["w_up"] == MDN(1, 2)
    assert dn["embed"] is None and dn["norm_weight"] is None
    whole = optim.muon_dimension_numbers(model, per_head=False)
    assert whole["q_proj"] == MDN(0, (1, 2))
    assert whole["o_proj"] == MDN((0, 1), 2)
    assert whole["w_up"] == MDN(1, 2)  # experts stay separate


# ----------------------------------------------------------------------------------------------
# The tiny model's parameter groups (the table in k3jax/optim/grouping.py)

# (path, group, dimension numbers) -- scanned group layers carry a leading ``layers`` axis (0).
EXPECTED_TINY = [
    (("embed",), "adamw", None),
    (("lm_head",), "adamw", None),
    (("final_norm", "weight"), "adamw", None),
    (("final_res_mix", "query"), "adamw", None),
    (("final_res_mix", "norm"), "adamw", None),
    # layer 0: KDA + dense FFN (unscanned)
    (("prefix", 0, "attn_norm", "weight"), "adamw", None),
    (("prefix", 0, "attn_res_mix", "query"), "adamw", None),
    (("prefix", 0, "mixer", "q_proj"), "muon", MDN(0, 2)),
    (("prefix", 0, "mixer", "k_proj"), "muon", MDN(0, 2)),
    (("prefix", 0, "mixer", "v_proj"), "muon", MDN(0, 2)),
    (("prefix", 0, "mixer", "g_proj"), "muon", MDN(0, 2)),
    (("prefix", 0, "mixer", "f_b"), "muon", MDN(0, 2)),
    (("prefix", 0, "mixer", "o_proj"), "muon", MDN(1, 2)),
    (("prefix", 0, "mixer", "f_a"), "muon", MDN(0, 1)),
    (("prefix", 0, "mixer", "b_proj"), "muon", MDN(0, 1)),
    (("prefix", 0, "mixer", "q_conv"), "adamw", None),
    (("prefix", 0, "mixer", "A_log"), "adamw", None),
    (("prefix", 0, "mixer", "dt_bias"), "adamw", None),
    (("prefix", 0, "mixer", "o_norm"), "adamw", None),
    (("prefix", 0, "ffn", "w_gate"), "muon", MDN(0, 1)),
    (("prefix", 0, "ffn", "w_down"), "muon", MDN(0, 1)),
    # a scanned KDA + LatentMoE layer
    (("groups", "layers", 0, "mixer", "q_proj"), "muon", MDN(1, 3)),
    (("groups", "layers", 0, "mixer", "o_proj"), "muon", MDN(2, 3)),
    (("groups", "layers", 0, "mixer", "dt_bias"), "adamw", None),
    (("groups", "layers", 0, "mixer", "A_log"), "adamw", None),
    (("groups", "layers", 0, "attn_norm", "weight"), "adamw", None),
    (("groups", "layers", 0, "ffn_res_mix", "query"), "adamw", None),
    (("groups", "layers", 0, "ffn", "router"), "muon", MDN(1, 2)),
    (("groups", "layers", 0, "ffn", "down"), "muon", MDN(1, 2)),
    (("groups", "layers", 0, "ffn", "up"), "muon", MDN(1, 2)),
    (("groups", "layers", 0, "ffn", "latent_norm", "weight"), "adamw", None),
    (("groups", "layers", 0, "ffn", "w_gate"), "muon", MDN(2, 3)),
    (("groups", "layers", 0, "ffn", "w_down"), "muon", MDN(2, 3)),
    (("groups", "layers", 0, "ffn", "shared", "w_up"), "muon", MDN(1, 2)),
    # an unscanned gated MLA layer
    (("suffix", 3, "mixer", "q_a"), "muon", MDN(0, 1)),
    (("suffix", 3, "mixer", "kv_a"), "muon", MDN(0, 1)),
    (("suffix", 3, "mixer", "q_a_norm", "weight"), "adamw", None),
    (("suffix", 3, "mixer", "kv_a_norm", "weight"), "adamw", None),
    (("suffix", 3, "mixer", "q_b"), "muon", MDN(0, 2)),
    (("suffix", 3, "mixer", "kv_b"), "muon", MDN(0, 2)),
    (("suffix", 3, "mixer", "g_proj"), "muon", MDN(0, 2)),
    (("suffix", 3, "mixer", "o_proj"), "muon", MDN(1, 2)),
    (("suffix", 3, "ffn", "w_up"), "muon", MDN(1, 2)),
]


@pytest.fixture(scope="module")
def tiny_abstract():
    return abstract_model(load_config("tiny").model)


def test_tiny_model_groups_match_the_spec(tiny_abstract):
    table = optim.group_table(tiny_abstract)
    for path, group, dn in EXPECTED_TINY:
        assert path in table, path
        got_group, got_dn, _ = table[path]
        assert (got_group, got_dn) == (group, dn), (path, got_group, got_dn)
        assert optim.param_group(path) == group, path  # name-only rule agrees
        assert optim.param_group("/".join(map(str, path))) == group
    # Global rules: every 1-D (per layer) param is AdamW; every routed-expert tensor is per expert.
    for path, var in nnx.to_flat_state(nnx.state(tiny_abstract, nnx.Param)):
        path = tuple(path)
        axes = var.get_metadata()["out_sharding"]
        non_layer = [a for a in axes if a != "layers"]
        group, dn, _ = table[path]
        assert optim.param_group(path) == group, path
        if len(non_layer) < 2 or {"vocab", "conv", "norm"} & set(axes):
            assert group == "adamw", path
        if "expert_in" in axes:
            assert axes.index("expert") not in (np.atleast_1d(dn.reduction_axis).tolist()
                                                 + np.atleast_1d(dn.output_axis).tolist())
        if "head_dim" in axes and "heads" in axes and group == "muon":
            h = axes.index("heads")
            assert h not in np.atleast_1d(dn.reduction_axis).tolist() + np.atleast_1d(dn.output_axis).tolist()


def test_dimension_numbers_tree_matches_param_state(tiny_abstract):
    dn = optim.muon_dimension_numbers(tiny_abstract)
    state = nnx.state(tiny_abstract, nnx.Param)
    is_leaf = lambda x: x is None or isinstance(x, MDN)  # noqa: E731
    flat_dn = jax.tree_util.tree_flatten_with_path(dn, is_leaf=is_leaf)[0]
    flat_p = jax.tree_util.tree_flatten_with_path(nnx.as_pure(state))[0]
    assert [optim.normalize_path(p) for p, _ in flat_dn] == [optim.normalize_path(p) for p, _ in flat_p]


def test_weight_decay_mask(tiny_abstract):
    mask = optim.group_table(tiny_abstract)
    for path, (group, _, decay) in mask.items():
        if group == "muon" or path[-1] in ("embed", "lm_head"):
            assert decay, path
        else:
            assert not decay, path


def test_weight_decay_is_applied_only_where_masked():
    """With zero gradients the update is exactly ``-lr * wd * W`` on decayed params, 0 elsewhere."""
    model = Toy()
    lr, wd = 0.5, 0.1
    tx = optim.make_optimizer(_cfg(learning_rate=lr, weight_decay=wd), model, total_steps=10)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    for name in ("embed", "q_proj", "o_proj", "w_up"):
        np.testing.assert_allclose(updates[name], -lr * wd * params[name], rtol=1e-5, atol=1e-9)
    np.testing.assert_array_equal(updates["norm_weight"], 0.0)


def test_works_with_nnx_optimizer_and_variable_trees():
    model = Toy()
    tx = optim.make_optimizer(_cfg(learning_rate=0.01), model, total_steps=10)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)  # init sees Variables, update sees pure arrays
    before = np.asarray(model.q_proj[...])
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    nnx.jit(lambda o, m, g: o.update(m, g))(opt, model, grads)
    assert not np.allclose(before, np.asarray(model.q_proj[...]))


# ----------------------------------------------------------------------------------------------
# Schedules


def test_cosine_schedule_values():
    cfg = OptimConfig(learning_rate=1.0, schedule="cosine", warmup_steps=10, end_lr_fraction=0.1)
    f = optim.learning_rate_schedule(cfg, total_steps=110)
    np.testing.assert_allclose(f(0), 0.1, rtol=1e-6)  # (0 + 1) / 10
    np.testing.assert_allclose(f(4), 0.5, rtol=1e-6)
    np.testing.assert_allclose(f(9), 1.0, rtol=1e-6)
    np.testing.assert_allclose(f(10), 1.0, rtol=1e-6)
    np.testing.assert_allclose(f(60), 0.55, rtol=1e-5)  # halfway: (1 + 0.1) / 2
    np.testing.assert_allclose(f(110), 0.1, rtol=1e-5)
    np.testing.assert_allclose(f(500), 0.1, rtol=1e-5)
    assert float(f(109)) > 0.1


def test_cosine_with_explicit_decay_steps():
    cfg = OptimConfig(learning_rate=2.0, schedule="cosine", warmup_steps=0, decay_steps=50, end_lr_fraction=0.0)
    f = optim.learning_rate_schedule(cfg, total_steps=200)
    np.testing.assert_allclose(f(0), 2.0, rtol=1e-6)
    np.testing.assert_allclose(f(25), 1.0, rtol=1e-5)
    np.testing.assert_allclose(f(50), 0.0, atol=1e-6)
    np.testing.assert_allclose(f(150), 0.0, atol=1e-6)


def test_wsd_schedule_values():
    cfg = OptimConfig(learning_rate=1.0, schedule="wsd", warmup_steps=10, decay_steps=20, end_lr_fraction=0.0)
    f = optim.learning_rate_schedule(cfg, total_steps=100)
    np.testing.assert_allclose(f(9), 1.0)
    np.testing.assert_allclose(f(50), 1.0)
    np.testing.assert_allclose(f(80), 1.0)
    np.testing.assert_allclose(f(90), 0.5, rtol=1e-6)
    np.testing.assert_allclose(f(100), 0.0, atol=1e-7)
    # decay_steps = 0: the last 20% of the run
    g = optim.learning_rate_schedule(dataclasses.replace(cfg, decay_steps=0, end_lr_fraction=0.1), total_steps=100)
    np.testing.assert_allclose(g(80), 1.0)
    np.testing.assert_allclose(g(90), 0.55, rtol=1e-6)


def test_constant_schedule_and_adam_lr():
    cfg = OptimConfig(learning_rate=0.5, schedule="constant", warmup_steps=4)
    f = optim.learning_rate_schedule(cfg, total_steps=10)
    np.testing.assert_allclose([float(f(s)) for s in (0, 1, 3, 7)], [0.125, 0.25, 0.5, 0.5])
    g = optim.learning_rate_schedule(cfg, total_steps=10, peak=0.1)
    np.testing.assert_allclose(float(g(1)), 0.05, rtol=1e-6)
    # Under jit with a traced step.
    np.testing.assert_allclose(jax.jit(f)(jnp.int32(2)), 0.375, rtol=1e-6)


def test_adam_learning_rate_is_separate():
    model = Toy()
    grads = _scaled_grads(model, [1.0] * 4, [1.0] * 4)
    u = _muon_update(model, grads, adam_learning_rate=0.25)
    np.testing.assert_allclose(np.abs(u["embed"]), 0.25, rtol=1e-3)
    assert 0.1 < _rms(u["q_proj"][:, 0, :]) < 0.25  # Muon keeps lr = 1


# ----------------------------------------------------------------------------------------------
# QK-clip


def test_qk_clip_matches_direct_formula():
    r = np.random.default_rng(0)
    L, rq, rkv, H, nope, rope, v = 2, 8, 6, 3, 4, 2, 5
    q_b = r.standard_normal((L, rq, H, nope + rope)).astype(np.float32)
    kv_b = r.standard_normal((L, rkv, H, nope + v)).astype(np.float32)
    logits = np.array([[50.0, 150.0, 400.0], [99.0, 100.0, 101.0]], np.float32)
    tau = 100.0
    q_new, kv_new = qk_clip.qk_clip_mla(jnp.asarray(q_b), jnp.asarray(kv_b), jnp.asarray(logits), tau,
                                      qk_nope_head_dim=nope)
    q_ref, kv_ref = q_b.copy(), kv_b.copy()
    for layer in range(L):
        for h in range(H):
            gamma = min(1.0, tau / logits[layer, h])
            q_ref[layer, :, h, :nope] *= np.sqrt(gamma)
            q_ref[layer, :, h, nope:] *= gamma
            kv_ref[layer, :, h, :nope] *= np.sqrt(gamma)
    np.testing.assert_allclose(q_new, q_ref, rtol=1e-6)
    np.testing.assert_allclose(kv_new, kv_ref, rtol=1e-6)
    # The clipped head's max logit q.k scales by exactly gamma: nope part sqrt*sqrt, rope part gamma.
    np.testing.assert_allclose(qk_clip.qk_clip_gamma(jnp.asarray(logits), tau),
                               np.minimum(1.0, tau / logits), rtol=1e-6)


def test_qk_clip_in_place_on_model():
    cfg = load_config("tiny", ["model.num_layers=4", "model.scan_layers=false"]).model
    model = create_model(cfg)
    mla = model.prefix[3].mixer
    q0, kv0 = np.asarray(mla.q_b[...]), np.asarray(mla.kv_b[...])
    logits = jnp.asarray([10.0, 200.0, 50.0, 400.0])
    qk_clip.qk_clip(model, {3: logits}, tau=100.0)
    q_ref, kv_ref = qk_clip.qk_clip_mla(jnp.asarray(q0), jnp.asarray(kv0), logits, 100.0,
                                      qk_nope_head_dim=cfg.mla.qk_nope_head_dim)
    np.testing.assert_allclose(mla.q_b[...], q_ref)
    np.testing.assert_allclose(mla.kv_b[...], kv_ref)
    np.testing.assert_array_equal(np.asarray(mla.q_b[...])[:, 0], q0[:, 0])  # head 0 below tau
    with pytest.raises(KeyError):
        qk_clip.qk_clip(model, {0: logits}, tau=100.0)  # a KDA layer


# A 4-layer tiny (MLA layers 1 and 3, layer 3 in the suffix) on one packed batch: QK-clip in the train step.
QK_CLIP = ["model.num_layers=4", "model.mla_period=2", "train.batch_size=2", "train.seq_len=32",
           "train.optim.schedule=constant", "train.optim.warmup_steps=0", "train.optim.learning_rate=1e-6"]


def _qk_clip_batch(cfg):
    from k3jax.model import segment_positions

    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.model.vocab_size)
    seg = jnp.asarray([[1] * 20 + [2] * 12, [1] * 32])
    targets = jnp.concatenate([tokens[:, 1:], jnp.full((2, 1), -1, tokens.dtype)], axis=1)
    return {"tokens": tokens, "segment_ids": seg, "positions": segment_positions(seg), "targets": targets,
            "loss_mask": seg > 0}


@functools.cache
def _max_logits_fn(graphdef):
    """One compile for the models before and after the step (same graph, same shapes)."""
    return jax.jit(lambda s, tokens, seg: nnx.merge(graphdef, s).forward(tokens, segment_ids=seg,
                                                                         max_logits=True)[2].max_logits)


def _max_logits(model, batch):
    graphdef, state = nnx.split(model)
    fwd = _max_logits_fn(graphdef)
    return {i: np.asarray(v) for i, v in fwd(state, batch["tokens"], batch["segment_ids"]).items()}


@functools.cache
def _qk_clip_step(tau):
    """(graphdef, initial state, jitted train step, batch) of the QK_CLIP config with ``qk_clip_tau =
    tau``: one compile per tau for the module (the capping test and the unreached-tau test share one)."""
    from k3jax.training.step import TrainState, make_train_step

    cfg = load_config("tiny", QK_CLIP + [f"train.optim.qk_clip_tau={tau}"])
    model = create_model(cfg.model, seed=0)
    with nnx.use_eager_sharding(False):
        ts = TrainState(model, optim.make_optimizer(cfg.train.optim, model, cfg.train.steps))
    graphdef, state = nnx.split(ts)
    return graphdef, state, make_train_step(graphdef, cfg), _qk_clip_batch(cfg)


@functools.cache
def _clip_tau():
    """Half the smallest per-head max logit of the initial model on the batch: every head is clipped."""
    cfg = load_config("tiny", QK_CLIP)
    before = _max_logits(create_model(cfg.model, seed=0), _qk_clip_batch(cfg))
    assert sorted(before) == [1, 3]
    return 0.5 * min(float(v.min()) for v in before.values()), before


def _scaled_queries(graphdef, state, scale):
    """``state`` with every MLA query up-projection (``q_b``) of the model multiplied by ``scale``: every
    attention logit (q . k, the RoPE part included) is multiplied by ``scale``."""
    ts = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    if scale != 1.0:
        scaled = 0
        for path, var in nnx.iter_graph(ts.model):
            if isinstance(var, nnx.Param) and path[-1] == "q_b":
                var[...] = var[...] * scale
                scaled += 1
        assert scaled > 0
    return nnx.state(ts)


def _one_step(tau, q_scale=1.0):
    """The model after one train step with ``qk_clip_tau = tau`` (and a learning rate of 1e-6, so the
    optimizer barely moves the weights and the clip is what changes them), from the seed-0 model whose
    query projections are scaled by ``q_scale``."""
    graphdef, state, step, batch = _qk_clip_step(tau)
    state = _scaled_queries(graphdef, state, q_scale)  # a copy: the step donates its input
    state, metrics = step(state, batch)
    assert bool(metrics["finite"])
    return nnx.merge(graphdef, state).model, batch


@pytest.mark.usefixtures("fast_xla_test")
def test_qk_clip_in_the_train_step_caps_the_max_logit():
    """K2's MuonClip: after the update, every MLA head whose max logit in the step's forward exceeded
    tau is rescaled, so the recomputed max logit is at most tau (up to the tiny update and the
    changed inputs of later layers)."""
    tau, _ = _clip_tau()  # every head is clipped
    model, batch = _one_step(tau)
    after = _max_logits(model, batch)
    for i, v in after.items():
        assert np.all(v <= tau * 1.01), (i, v, tau)
        assert np.all(v >= tau * 0.95), (i, v, tau)  # scaled to tau, not further


@pytest.mark.usefixtures("fast_xla_test")
def test_qk_clip_off_or_never_reached_changes_nothing():
    """tau = 0 (off: no statistic, no clip) and a tau no head reaches give the same model bit for bit.

    The tau is the capping test's (its train step is compiled once for both tests); no head reaches it
    because this model's query projections are scaled down so that its largest logit is a quarter of
    tau (checked below on the model the step starts from)."""
    tau, before = _clip_tau()
    scale = 0.25 * tau / max(float(v.max()) for v in before.values())
    graphdef, state, _, batch = _qk_clip_step(tau)
    start = _max_logits(nnx.merge(graphdef, _scaled_queries(graphdef, state, scale)).model, batch)
    assert sorted(start) == [1, 3] and max(float(v.max()) for v in start.values()) < 0.3 * tau, (start, tau)
    off, _ = _one_step(0.0, scale)
    unreached, _ = _one_step(tau, scale)
    for a, b in zip(jax.tree.leaves(nnx.state(off)), jax.tree.leaves(nnx.state(unreached))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.usefixtures("fast_xla_test")
def test_bf16_gradients_of_the_matrices():
    """train.grad_dtype=bfloat16: the Muon group's matrices are differentiated in bf16, so their
    gradients come out in bf16 (within bf16 rounding of the float32 ones); the router and the AdamW
    leaves stay float32; the forward and the train step's loss are unchanged (the layers compute in
    bf16 either way) and its gradient norm agrees to bf16 rounding."""
    from k3jax.training.step import TrainState, make_train_step

    # Two layers: KDA with the dense FFN, MLA with the latent MoE (every kind of matrix, router included).
    overrides = QK_CLIP[:-1] + ["model.dtype=bfloat16", "model.num_layers=2"]
    with pytest.raises(ValueError, match="grad_dtype"):
        load_config("tiny", QK_CLIP + ["train.grad_dtype=bfloat16"])  # float32 compute
    cfg = load_config("tiny", overrides)
    model = create_model(cfg.model, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = _qk_clip_batch(cfg)

    def loss(p):
        logits = nnx.merge(graphdef, p, rest)(batch["tokens"], segment_ids=batch["segment_ids"])[0]
        return jnp.mean(jnp.square(logits))

    grad = jax.jit(jax.grad(loss))
    table = optim.group_table(params)
    g32 = dict(nnx.to_flat_state(grad(params)))
    g16 = dict(nnx.to_flat_state(grad(optim.cast_muon_group(params, jnp.bfloat16))))
    bf16 = 0
    for path, g in g16.items():
        name = optim.normalize_path(path)
        a, b = g.get_raw_value(), g32[path].get_raw_value()
        is_bf16 = table[name][0] == optim.MUON and name[-1] != "router"
        assert a.dtype == (jnp.bfloat16 if is_bf16 else jnp.float32), name
        bf16 += is_bf16
        if np.any(b):
            err = np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b)
            assert err < (1e-2 if is_bf16 else 1e-5), (name, err)
    assert bf16 > 20

    metrics = {}
    for grad_dtype in ("float32", "bfloat16"):
        cfg = load_config("tiny", overrides + [f"train.grad_dtype={grad_dtype}"])
        model = create_model(cfg.model, seed=0)
        with nnx.use_eager_sharding(False):
            ts = TrainState(model, optim.make_optimizer(cfg.train.optim, model, cfg.train.steps))
        graphdef, state = nnx.split(ts)
        metrics[grad_dtype] = make_train_step(graphdef, cfg)(state, batch)[1]
    assert bool(metrics["bfloat16"]["finite"])
    assert float(metrics["bfloat16"]["loss"]) == float(metrics["float32"]["loss"])
    assert float(metrics["bfloat16"]["grad_norm"]) == pytest.approx(float(metrics["float32"]["grad_norm"]), rel=1e-2)


# ----------------------------------------------------------------------------------------------
# End to end


def _train(model, steps, cfg, tokens):
    tx = optim.make_optimizer(cfg, model, total_steps=steps)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    def loss_fn(p):
        logits, _ = nnx.merge(graphdef, p, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


@pytest.mark.usefixtures("fast_xla_test")
@pytest.mark.slow
def test_twenty_steps_reduce_the_tiny_model_loss():
    """Muon + AdamW on the tiny K3 at 6 layers: the dense-FFN prefix layer, two scanned [MLA, KDA]
    groups (stacked weights: Muon per layer and head) and an unrolled MLA suffix layer; every kind of
    parameter of the 13-layer tiny at less than half its compile time."""
    cfg = load_config("tiny", ["model.num_layers=6", "model.mla_period=2"])
    model = create_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (4, 65), 0, cfg.model.vocab_size)
    losses = _train(model, 20, dataclasses.replace(cfg.train.optim, warmup_steps=2, learning_rate=1e-2), tokens)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses


class ToyLM(Toy):
    """Embedding -> per-head projection -> output projection -> norm -> lm_head (quick to compile)."""

    def __init__(self):
        super().__init__(d=32, h=4, dh=8)
        r = np.random.default_rng(1)
        with nnx.use_eager_sharding(False):
            self.lm_head = nnx.Param(jnp.asarray(0.02 * r.standard_normal((32, 32)), jnp.float32),
                                     out_sharding=("embed", "vocab"))

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        h = jnp.tanh(jnp.einsum("btd,dhk->bthk", x, self.q_proj[...]))
        x = x + jnp.einsum("bthk,hkd->btd", h, self.o_proj[...])
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.norm_weight[...]
        return x @ self.lm_head[...], None


def test_twenty_steps_reduce_a_toy_lm_loss():
    model = ToyLM()
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 32)
    cfg = OptimConfig(learning_rate=2e-2, warmup_steps=2, schedule="cosine")
    losses = _train(model, 20, cfg, tokens)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses


def test_layer_by_layer_muon_equals_the_batched_update():
    """Stacked (scanned-layer) weights above the size threshold run momentum + Newton-Schulz one layer
    at a time under lax.map: the same updates and momenta as the whole-stack computation."""
    rng = np.random.default_rng(1)
    params = {"experts": jnp.asarray(rng.standard_normal((3, 4, 16, 12)), jnp.float32),  # [layers, E, in, out]
              "dense": jnp.asarray(rng.standard_normal((3, 24, 8)), jnp.float32)}  # [layers, in, out]
    dns = {"experts": optim.MDN(reduction_axis=(-2,), output_axis=(-1,)),
           "dense": optim.MDN(reduction_axis=(1,), output_axis=(2,))}
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params) for _ in range(2)]

    def run(**kw):
        tx = muon.scale_by_grouped_muon(lambda u: dns, **kw)
        state, outs = tx.init(params), []
        for g in grads:  # two steps: the second uses the first's momentum
            upd, state = jax.jit(tx.update)(g, state)
            outs.append(upd)
        return outs, state.mu

    stacked = lambda u: {"experts": True, "dense": True}  # noqa: E731
    (want, want_mu), (got, got_mu) = run(group_max_size=16), run(stacked=stacked, group_max_size=16)
    for a, b in zip(jax.tree.leaves((want, want_mu)), jax.tree.leaves((got, got_mu))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the per-layer path really ran: one layer loop per stacked leaf (the batched path maps only the
    # Newton-Schulz of the 4-D expert stack); both have the CPU's block-by-block Newton-Schulz loops
    def loops(**kw):
        tx = muon.scale_by_grouped_muon(lambda u: dns, group_max_size=16, **kw)
        return str(jax.make_jaxpr(tx.update)(grads[0], tx.init(params))).count("scan[")

    assert loops(stacked=stacked) == loops() + 1


def test_layer_by_layer_muon_writes_the_stacks_in_place():
    """Compiled on XLA:CPU with the gradient and momentum donated, an 8-layer stacked update needs less
    than one stack of temporaries (measured 0.63: a few layers' slices and Newton-Schulz work): the loop
    writes each layer back in place. ``lax.map`` needed 2.34 stacks; reading the slices at the top of
    each step made XLA:CPU copy both stacks every step (2.25)."""
    x = jax.ShapeDtypeStruct((8, 4, 64, 128), jnp.float32)  # [layers, E, in, out]
    dn = optim.MDN(reduction_axis=(-2,), output_axis=(-1,))
    tx = muon.scale_by_grouped_muon(lambda u: {"w": dn}, stacked=lambda u: {"w": True},
                                     expert_stacks=lambda u: {"w": True}, group_max_size=1 << 10)
    compiled = jax.jit(tx.update, donate_argnums=(0, 1)).lower({"w": x}, jax.eval_shape(tx.init, {"w": x})).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < x.size * 4


@pytest.mark.tpu_aot
@pytest.mark.parametrize("per_step,bound", [(None, 0.6), (3, 1.0)])
def test_layer_by_layer_muon_writes_the_stacks_in_place_on_tpu(monkeypatch, per_step, bound):
    """The per-layer loop carries the gradient and momentum stacks and writes each layer's update and
    momentum back into them. Compiled for v5p-16 (fsdp 2 x expert 4) with both donated, two stacked expert
    weights need about a third of one stack in temporaries; ``lax.map`` returned new whole stacks (1.05
    of a stack here; full K3's optimizer on v5p-1024: 21.4 GiB of temporaries, 4.0 now). With 3 layers per
    step, 2 layers are left over: their shorter step is a loop of its own and writes in place too
    (measured 0.61 of a stack, most of it the 3-layer steps' work; written after the loop, 1.30)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if per_step is not None:
        monkeypatch.setattr(newton_schulz, "layers_per_step", lambda x, dn: per_step)

    mesh = _v5p_mesh("v5p-16", fsdp=2, expert=4)
    sharded = NamedSharding(mesh, P(None, "expert", None, "fsdp"))
    x = jax.ShapeDtypeStruct((8, 24, 256, 512), jnp.float32, sharding=sharded)  # [layers, E, in, out]
    dn = optim.MDN(reduction_axis=(2,), output_axis=(3,))
    both = lambda u: {"w": True, "v": True}  # noqa: E731
    tx = muon.scale_by_grouped_muon(lambda u: {"w": dn, "v": dn}, stacked=both, expert_stacks=both,
                                     mu_dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, {"w": x, "v": x})
        state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=sharded if s.ndim else NamedSharding(mesh, P())), state)
        compiled = jax.jit(tx.update, donate_argnums=(0, 1)).lower({"w": x, "v": x}, state).compile()
    local_stack = x.size * 4 / 8
    assert compiled.memory_analysis().temp_size_in_bytes < bound * local_stack  # measured 0.36, 0.61


def test_layers_per_step_pads_least():
    # full K3 on v5p-2048: 14 experts per group of 16 devices, 22 layers -> 11 (20 blocks per device, not 22)
    assert newton_schulz.best_layers_per_step(22, 14, 16) == 11
    # K2 on v5p-512: 6 experts per group of 4 devices, 60 layers -> 2 (90 blocks, not 120)
    assert newton_schulz.best_layers_per_step(60, 6, 4) == 2
    assert newton_schulz.best_layers_per_step(8, 4, 4) == 1  # no padding at one layer: the smallest wins the tie
    # full K3 on v5p-1024: 14 experts per group of 8 devices; no divisor of 22 pads less than one layer at a
    # time (44 blocks per device for 38.5): 4 layers per step and a last step of 2, 5 x 7 + 4 = 39
    assert newton_schulz.best_layers_per_step(22, 14, 8) == 4
    # a prime layer count: 2 layers per step and a last one, 30 x 3 + 2 = 92 blocks (one at a time: 122)
    assert newton_schulz.best_layers_per_step(61, 6, 4) == 2
    # all 61 at once, also 92 blocks, is a divisor (no last step): it wins the tie
    assert newton_schulz.best_layers_per_step(61, 6, 4, max_blocks_per_step=100) == 61


@pytest.mark.parametrize("layers,per_step", [(4, 2), (5, 2), (5, 3)])
def test_several_layers_per_step_equal_the_batched_update(monkeypatch, layers, per_step):
    """Stacked experts updated several layers at a time (blocks regrouped expert-major and merged into one
    batch, then back), with a last, shorter step when the steps do not divide the stack: the same updates
    and momenta as the whole-stack computation."""
    rng = np.random.default_rng(2)
    params = {"experts": jnp.asarray(rng.standard_normal((layers, 3, 16, 12)), jnp.float32),  # [layers, E, in, out]
              "down": jnp.asarray(rng.standard_normal((layers, 3, 12, 16)), jnp.float32)}
    dns = {"experts": optim.MDN(reduction_axis=(-2,), output_axis=(-1,)),
           "down": optim.MDN(reduction_axis=(2,), output_axis=(3,))}
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params) for _ in range(2)]

    def run(**kw):
        tx = muon.scale_by_grouped_muon(lambda u: dns, group_max_size=16, **kw)
        state, outs = tx.init(params), []
        for g in grads:
            upd, state = jax.jit(tx.update)(g, state)
            outs.append(upd)
        return outs, state.mu

    want = run()
    monkeypatch.setattr(newton_schulz, "layers_per_step", lambda x, dn: per_step)
    both = lambda u: {"experts": True, "down": True}  # noqa: E731
    got = run(stacked=both, expert_stacks=both)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.tpu_aot
def test_stacked_experts_are_orthogonalised_several_layers_at_a_time_on_tpu():
    """Compiled for v5p-16 (expert 4 x fsdp 2): 12 experts per layer are 3 blocks per expert group of 2
    devices, padded to 4 one layer at a time (8 blocks per device over 4 layers); two layers at a time
    are 6 blocks, padded to 6."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-16", fsdp=2, expert=4)
    layers, e, r, o = 4, 12, 256, 512
    sharded = NamedSharding(mesh, P(None, "expert", "fsdp", None))
    params = {"w": jax.ShapeDtypeStruct((layers, e, r, o), jnp.bfloat16, sharding=sharded)}
    dn = optim.MDN(reduction_axis=(2,), output_axis=(3,))
    tx = muon.scale_by_grouped_muon(lambda u: {"w": dn}, stacked=lambda u: {"w": True},
                                     expert_stacks=lambda u: {"w": True}, group_max_size=1 << 16, mu_dtype=jnp.bfloat16)
    hlo = _compile_muon_update(tx, params, mesh, sharded).as_text()
    per_device = breakdown.breakdown(hlo).part_flops("newton_schulz")
    one_block = 5 * (2 * r * r * o * 2 + 2 * r ** 3)
    assert 0.9 * 6 * one_block <= per_device <= 1.1 * 6 * one_block, per_device / one_block


@pytest.mark.tpu_aot
def test_single_block_weights_are_spread_with_their_shape_on_tpu(monkeypatch):
    """Compiled for v5p-16 (fsdp 2 x expert 4): six unstacked one-block weights stored over ``fsdp`` only
    (replicated over ``expert``, as K3's shared experts and latent projections outside the scanned groups
    are over most of the mesh) join the spread of their block shape: at most one whole block per device.
    In their storage sharding each device did part of every weight's iteration, 1.75 blocks' work (K3's
    shared experts: 17x their share of the analytic count)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers
    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-16", fsdp=2, expert=4)
    r, o = 1024, 4096
    x = jax.ShapeDtypeStruct((r, o), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    dn = MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    def per_device():
        with jax.set_mesh(mesh):
            hlo = jax.jit(lambda *xs: newton_schulz.orthogonalize_blocks(xs, [dn] * 6, group_max_size=1 << 16)).lower(
                *[x] * 6).compile().as_text()
        return breakdown.breakdown(hlo).part_flops("newton_schulz")

    one_block = 5 * (4 * r * r * o + 2 * r ** 3)
    assert per_device() <= 1.05 * one_block
    monkeypatch.setattr(newton_schulz, "LARGE_BLOCK_ELEMENTS", 0)  # every weight in its storage sharding: the old way
    assert per_device() > 1.5 * one_block  # measured 1.75 blocks


@pytest.mark.tpu_aot
def test_several_layers_per_step_keep_the_experts_split_on_tpu():
    """Compiled for v5p-512 (K2's mesh): a K2-sized expert stack, 4 layers of 384 [2048, 7168] blocks,
    runs 2 layers per step (6 blocks per device in all, where one layer at a time pads 1.5 to 2 per layer)
    and keeps the merged batch split over ``expert``: without the constraint XLA:TPU held whole batches
    of blocks on every device (169 GiB of temporaries)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.aot import breakdown

    mesh = _v5p_mesh("v5p-512", fsdp=2, expert=64, sequence=2)
    layers, e, r, o = 4, 384, 2048, 7168
    sharded = NamedSharding(mesh, P(None, "expert", None, ("fsdp", "sequence")))
    x = jax.ShapeDtypeStruct((layers, e, r, o), jnp.float32, sharding=sharded)
    dn = optim.MDN(reduction_axis=(2,), output_axis=(3,))
    tx = muon.scale_by_grouped_muon(lambda u: {"w": dn}, stacked=lambda u: {"w": True},
                                     expert_stacks=lambda u: {"w": True}, mu_dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        assert newton_schulz.layers_per_step(x, dn) == 2
    compiled = _compile_muon_update(tx, {"w": x}, mesh, sharded)
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * 2**30
    one_block = 5 * (4 * r * r * o + 2 * r ** 3)
    per_device = breakdown.breakdown(compiled.as_text()).part_flops("newton_schulz")
    assert per_device == pytest.approx(6 * one_block, rel=0.05), per_device / one_block

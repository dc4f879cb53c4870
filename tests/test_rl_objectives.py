"""k3jax/rl/objectives.py: the GRPO-family losses against

- a float64 NumPy reference written from the papers' formulas (GRPO arXiv 2402.03300, Dr.GRPO 2503.20783,
  DAPO 2503.14476, GSPO 2507.18071) with analytic gradients (themselves checked by finite differences),
- TRL's own ``GRPOTrainer._compute_loss`` (trl 1.16.0) run on the same per-token log-probabilities through a
  stand-in trainer (no model): loss, gradient with respect to the log-probabilities, and TRL's logged metrics,
- TRL's advantage formula (its ``nanstd``) and its soft overlong punishment.

No model; the TRL import (torch, transformers) is most of the file's time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.rl import objectives as obj

B, T = 6, 7
LENGTHS = (7, 1, 4, 0, 6, 3)  # ragged, one single-token row, one empty row
MAX_LEN = 9  # Dr.GRPO's constant: the max completion length (> T so it is not confused with T)
PRESETS = ("grpo", "dr_grpo", "dapo", "gspo")
KL_BETA = 0.07
TIS = 2.0
TOL64 = dict(rtol=1e-6, atol=1e-6)
TOL32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def x64():
    """float64 JAX inside this test only (jax.enable_x64 is a context manager: nothing leaks)."""
    with jax.enable_x64(True):
        assert jnp.zeros(1).dtype == jnp.float64
        yield


# --------------------------------------------------------------------------------------------- inputs


def _mask(lengths=LENGTHS, hole=True):
    m = (np.arange(T)[None, :] < np.asarray(lengths)[:, None]).astype(np.float64)
    if hole:
        m[0, 2] = 0.0  # a hole inside a row (a tool-output token), not only right padding
    return m


def _inputs(preset: str, seed: int = 0):
    """Float64 inputs whose ratios land on both sides of the preset's clip range, with both signs of A."""
    rng = np.random.default_rng(seed)
    p = obj.LOSSES[preset]
    mask = _mask()
    on = mask > 0
    adv = np.array([1.3, -0.7, 0.9, 0.4, -1.6, -0.5]) * rng.uniform(0.5, 1.5, B)
    logp = np.log(rng.uniform(0.05, 0.95, (B, T)))
    if p.ratio_level == "token":
        log_ratio = rng.uniform(-0.5, 0.5, (B, T))
    else:
        # each row's masked mean log-ratio set to a target around the narrow GSPO range: below / inside / above,
        # for positive and negative A (rows 1 and 3: single-token and empty)
        target = np.array([6e-4, -9e-4, -7e-4, 0.0, 9e-4, 1e-4])
        log_ratio = rng.uniform(-2e-3, 2e-3, (B, T))
        n = np.maximum(mask.sum(1), 1)
        log_ratio += (target - (log_ratio * mask).sum(1) / n)[:, None]
    old = logp - log_ratio
    # padding holds garbage, as a real batch may: -inf log-probabilities
    logp, old = np.where(on, logp, -np.inf), np.where(on, old, -np.inf)
    ref = np.where(on, logp + rng.uniform(-0.6, 0.6, (B, T)), -np.inf)
    roll = np.where(on, old - rng.uniform(-1.0, 1.3, (B, T)), np.nan)  # exp(old - roll) up to 3.7 > TIS
    return dict(logp=logp, old=old, adv=adv, mask=mask, ref=ref, roll=roll)


def _check_coverage(preset, x):
    """The inputs exercise every branch: clipped low, clipped high, and unclipped, TIS truncated and not."""
    p = obj.LOSSES[preset]
    on = x["mask"] > 0
    with np.errstate(invalid="ignore"):  # -inf - -inf at padding
        lr = np.where(on, x["logp"] - x["old"], 0)
    if p.ratio_level == "token":
        r = np.exp(lr)
    else:
        r = np.repeat(np.exp(lr.sum(1) / np.maximum(x["mask"].sum(1), 1))[:, None], T, 1)
    a = x["adv"][:, None]
    low = on & (r < 1 - p.clip_low) & (a < 0)
    high = on & (r > 1 + p.clip_high) & (a > 0)
    inside = on & (r > 1 - p.clip_low) & (r < 1 + p.clip_high)
    out_unclipped = on & (((r < 1 - p.clip_low) & (a > 0)) | ((r > 1 + p.clip_high) & (a < 0)))
    with np.errstate(invalid="ignore"):
        w = np.exp(np.where(on, x["old"] - x["roll"], 0))
    assert low.any() and high.any() and inside.any() and out_unclipped.any(), preset
    assert (on & (w > TIS)).any() and (on & (w < TIS)).any()
    # no ratio within 1e-5 of a boundary: finite differences and float32 stay on one side
    for b in (1 - p.clip_low, 1 + p.clip_high):
        assert np.abs(r[on] - b).min() > 1e-5 * b


# --------------------------------------------------------------------------------------------- the reference


def reference(logp, old, adv, mask, *, ratio_level, aggregation, clip_low, clip_high, max_len=None, ref=None,
              beta=0.0, roll=None, tis=0.0):
    """float64 NumPy, from the papers: returns (loss, dloss/dlogp [B, T], masked-mean metrics)."""
    with np.errstate(invalid="ignore"):  # -inf - -inf at padding, discarded by the where()s
        return _reference(logp, old, adv, mask, ratio_level=ratio_level, aggregation=aggregation, clip_low=clip_low,
                          clip_high=clip_high, max_len=max_len, ref=ref, beta=beta, roll=roll, tis=tis)


def _reference(logp, old, adv, mask, *, ratio_level, aggregation, clip_low, clip_high, max_len, ref, beta, roll, tis):
    on = mask > 0
    m = mask.astype(np.float64)
    b, t = m.shape
    n = np.maximum(m.sum(1), 1)
    if aggregation == "sequence":  # GRPO eq. 3: (1/G) sum_i 1/|o_i| sum_t
        weight = m / n[:, None] / b
    elif aggregation == "token":  # DAPO eq. 8: 1 / sum_i |o_i|
        weight = m / max(m.sum(), 1)
    else:  # Dr.GRPO: 1 / (G * max_len)
        weight = m / (b * max_len)
    log_ratio = np.where(on, logp - old, 0.0)
    a = adv[:, None]
    if ratio_level == "token":
        r = np.exp(log_ratio)
    else:  # GSPO eq. 7: s_i = (pi / pi_old)^(1/|y_i|)
        r = np.repeat(np.exp(log_ratio.sum(1) / n)[:, None], t, 1)
    lo, hi = 1 - clip_low, 1 + clip_high
    surrogate = np.minimum(r * a, np.clip(r, lo, hi) * a)  # PPO / GRPO eq. 3's min(r A, clip(r) A)
    tis_w = np.minimum(np.exp(np.where(on, old - roll, 0.0)), tis) if tis > 0 else np.ones_like(r)
    if ref is not None:
        dref = np.where(on, ref - logp, 0.0)
        kl = np.exp(dref) - dref - 1  # GRPO eq. 4
    else:
        kl = np.zeros_like(r)
    tok = np.where(on, -surrogate * tis_w + beta * kl, 0.0)
    loss = (tok * weight).sum()

    # d(-min(rA, clip(r)A))/dr: the clipped branch is constant in r; it is the min exactly where it took effect
    took = ((r < lo) & (a < 0)) | ((r > hi) & (a > 0))
    dpol_dr = np.where(took, 0.0, -a)
    if ratio_level == "token":  # dr/dlogp = r
        grad = weight * tis_w * dpol_dr * r
    else:  # every token of row i carries the same s_i: d s_i / d logp_t = s_i m_t / n_i
        row_w = (weight * tis_w).sum(1)
        grad = (row_w * dpol_dr[:, 0] * r[:, 0] / n)[:, None] * m
    if ref is not None:
        grad = grad + weight * beta * (1 - np.exp(dref))
    grad = np.where(on, grad, 0.0)

    count = max(m.sum(), 1)
    metrics = dict(clipped_low=((r < lo) & (a < 0)), clipped_high=((r > hi) & (a > 0)), kl=kl, ratio=r,
                   tis_weight=tis_w, tis_truncated=(np.exp(np.where(on, old - roll, 0.0)) > tis) if tis > 0
                   else np.zeros_like(r, bool))
    metrics = {k: float((np.where(on, v, 0) * m).sum() / count) for k, v in metrics.items()}
    return loss, grad, metrics


def _ref_kwargs(preset, kl, tis):
    p = obj.LOSSES[preset]
    return dict(ratio_level=p.ratio_level, aggregation=p.aggregation, clip_low=p.clip_low, clip_high=p.clip_high,
                max_len=MAX_LEN if p.aggregation == "fixed" else None, beta=KL_BETA if kl else 0.0,
                tis=TIS if tis else 0.0)


def _ref(x, preset, kl, tis):
    kw = _ref_kwargs(preset, kl, tis)
    return reference(x["logp"], x["old"], x["adv"], x["mask"], ref=x["ref"] if kl else None,
                     roll=x["roll"] if tis else None, **kw)


@functools.lru_cache(maxsize=None)
def _ours(preset: str, kl: bool, tis: bool):
    """jit(value_and_grad) of policy_loss with the preset's static switches; the arrays are arguments."""
    p = obj.LOSSES[preset]
    static = dict(p.loss_kwargs(), max_len=MAX_LEN if p.aggregation == "fixed" else None,
                  beta=KL_BETA if kl else 0.0, tis_threshold=TIS if tis else 0.0)

    def f(logp, old, adv, mask, ref, roll):
        return obj.policy_loss(logp, old, adv, mask, ref_logp=ref if kl else None, rollout_logp=roll if tis else None,
                               **static)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def _run_ours(x, preset, kl, tis, dtype):
    args = [jnp.asarray(x[k], dtype) for k in ("logp", "old", "adv", "mask", "ref", "roll")]
    (loss, metrics), grad = _ours(preset, kl, tis)(*args)
    assert loss.dtype == dtype and grad.dtype == dtype
    return float(loss), np.asarray(grad, np.float64), {k: float(v) for k, v in metrics.items()}


CASES = [(p, kl, tis) for p in PRESETS for kl in (False, True) for tis in (False, True)]


@pytest.mark.parametrize("preset", PRESETS)
def test_reference_gradient_matches_finite_differences(preset):
    """The reference's analytic gradient is right (central differences of its own loss, float64)."""
    x = _inputs(preset)
    _check_coverage(preset, x)
    kw = _ref_kwargs(preset, kl=True, tis=True)
    _, grad, _ = reference(x["logp"], x["old"], x["adv"], x["mask"], ref=x["ref"], roll=x["roll"], **kw)
    h = 1e-7 if preset == "gspo" else 1e-6  # GSPO's ratios sit within ~1e-4 of its clip bounds
    fd = np.zeros_like(grad)
    for i, j in zip(*np.nonzero(x["mask"])):
        plus, minus = x["logp"].copy(), x["logp"].copy()
        plus[i, j] += h
        minus[i, j] -= h
        fp = reference(plus, x["old"], x["adv"], x["mask"], ref=x["ref"], roll=x["roll"], **kw)[0]
        fm = reference(minus, x["old"], x["adv"], x["mask"], ref=x["ref"], roll=x["roll"], **kw)[0]
        fd[i, j] = (fp - fm) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
    assert np.abs(grad).max() > 1e-3


@pytest.mark.parametrize("preset,kl,tis", CASES)
def test_against_reference_float64(x64, preset, kl, tis):
    x = _inputs(preset)
    _check_coverage(preset, x)
    loss_r, grad_r, met_r = _ref(x, preset, kl, tis)
    loss, grad, met = _run_ours(x, preset, kl, tis, jnp.float64)
    np.testing.assert_allclose(loss, loss_r, **TOL64)
    np.testing.assert_allclose(grad, grad_r, **TOL64)
    assert np.isfinite(grad).all() and (grad[x["mask"] == 0] == 0).all()
    for k in met_r:
        np.testing.assert_allclose(met[k], met_r[k], err_msg=k, **TOL64)
    assert met["clipped_low"] > 0 and met["clipped_high"] > 0
    assert (met["kl"] > 0) == kl and (met["tis_truncated"] > 0) == tis


@pytest.mark.parametrize("preset,kl,tis", CASES)
def test_against_reference_float32(preset, kl, tis):
    x = _inputs(preset, seed=1)
    _check_coverage(preset, x)
    loss_r, grad_r, met_r = _ref(x, preset, kl, tis)
    loss, grad, met = _run_ours(x, preset, kl, tis, jnp.float32)
    np.testing.assert_allclose(loss, loss_r, **TOL32)
    np.testing.assert_allclose(grad, grad_r, **TOL32)
    for k in met_r:
        np.testing.assert_allclose(met[k], met_r[k], err_msg=k, **TOL32)


def test_gspo_token_form_same_gradient_without_tis(x64):
    """The docstring's claim: GSPO-token's sg(s_i) * exp(logp - sg(logp)) has our values and gradients when the
    token weights are uniform within a row (no TIS)."""
    x = _inputs("gspo")
    p = obj.LOSSES["gspo"]
    logp, old, adv, mask = (jnp.asarray(x[k]) for k in ("logp", "old", "adv", "mask"))

    def gspo_token(lp):
        on = mask > 0
        lr = jnp.where(on, lp - old, 0)
        s = jnp.exp(lr.sum(1) / jnp.maximum(mask.sum(1), 1))[:, None]
        lp0 = jnp.where(on, lp, 0)
        st = jax.lax.stop_gradient(s) * jnp.exp(lp0 - jax.lax.stop_gradient(lp0))
        a = adv[:, None]
        tok = -jnp.minimum(st * a, jnp.clip(st, 1 - p.clip_low, 1 + p.clip_high) * a)
        return jnp.sum(jnp.where(on, tok, 0) * obj.token_weights(mask, "sequence").astype(lp.dtype))

    def ours(lp):
        return obj.policy_loss(lp, old, adv, mask, **p.loss_kwargs())[0]

    np.testing.assert_allclose(jax.jit(jax.grad(gspo_token))(logp), jax.jit(jax.grad(ours))(logp), **TOL64)
    np.testing.assert_allclose(gspo_token(logp), ours(logp), **TOL64)


# --------------------------------------------------------------------------------------------- TRL parity


@pytest.fixture(scope="module")
def trl_mod():
    import torch
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanstd
    return types.SimpleNamespace(torch=torch, GRPOConfig=GRPOConfig, GRPOTrainer=GRPOTrainer, nanstd=nanstd)


class _Accelerator:
    """What _compute_loss asks of accelerate, for one process."""
    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _trl_loss(trl, x, preset, kl, tis, dtype_name, tmp_path):
    """TRL 1.16.0's GRPOTrainer._compute_loss on our per-token log-probabilities: returns loss, d loss / d logp
    and TRL's logged metrics. The trainer is a stand-in (object.__new__) holding what GRPOTrainer.__init__ sets
    from a real GRPOConfig; its per-token-logp method returns a leaf tensor instead of running a model."""
    torch = trl.torch
    dt = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    p = obj.LOSSES[preset]
    loss_type = {"grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "dapo", "gspo": "grpo"}[preset]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, loss_type=loss_type,
        importance_sampling_level=p.ratio_level, epsilon=p.clip_low, epsilon_high=p.clip_high,
        beta=KL_BETA if kl else 0.0, use_bias_correction_kl=False, max_completion_length=MAX_LEN,
        vllm_importance_sampling_correction=tis, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=TIS)
    tr = object.__new__(trl.GRPOTrainer)
    # the attributes GRPOTrainer.__init__ derives from args (trl 1.16.0, grpo_trainer.py ~L811-950)
    tr.args = args
    tr.use_vllm = tis  # TRL applies its IS correction only with vLLM generation
    tr.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    tr.loss_type = args.loss_type
    tr.importance_sampling_level = args.importance_sampling_level
    tr.off_policy_mask_threshold = args.off_policy_mask_threshold
    tr.top_entropy_quantile = args.top_entropy_quantile
    tr.entropy_coef = args.entropy_coef
    tr.use_adaptive_entropy = args.use_adaptive_entropy
    tr._entropy_bonus_enabled = tr.entropy_coef != 0.0 or tr.use_adaptive_entropy
    tr.aux_loss_enabled = False
    tr.beta = args.beta
    tr.epsilon_low = args.epsilon
    tr.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    tr.max_completion_length = args.max_completion_length
    tr.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    tr.accelerator = _Accelerator()
    tr.model = types.SimpleNamespace(training=True)
    tr._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    assert args.steps_per_generation == 1 and tr.current_gradient_accumulation_steps == 1

    mask = torch.tensor(x["mask"], dtype=torch.long)
    logp = torch.tensor(np.where(x["mask"] > 0, x["logp"], 0.0), dtype=dt, requires_grad=True)
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, torch.zeros_like(logp), None)
    inputs = {
        "prompt_ids": torch.zeros((B, 2), dtype=torch.long), "prompt_mask": torch.ones((B, 2), dtype=torch.long),
        "completion_ids": torch.zeros((B, T), dtype=torch.long), "completion_mask": mask,
        "advantages": torch.tensor(x["adv"], dtype=dt),
        "old_per_token_logps": torch.tensor(np.where(x["mask"] > 0, x["old"], 0.0), dtype=dt),
        "num_items_in_batch": mask.sum(),
    }
    if kl:
        inputs["ref_per_token_logps"] = torch.tensor(np.where(x["mask"] > 0, x["ref"], 0.0), dtype=dt)
    if tis:
        # _generate_and_score_completions' token_truncate ratio (trl 1.16.0 grpo_trainer.py ~L2660-2685)
        sampling = torch.tensor(x["roll"], dtype=dt)
        diff = torch.nan_to_num((inputs["old_per_token_logps"] - sampling) * mask, nan=0.0)
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff), min=args.vllm_importance_sampling_clip_min,
                                                          max=args.vllm_importance_sampling_clip_max)
    loss = tr._compute_loss(None, inputs)
    loss.backward()
    return float(loss.detach()), logp.grad.double().numpy(), {k: v[0] for k, v in tr._metrics["train"].items()}


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("preset,kl,tis", CASES)
def test_trl_parity(trl_mod, tmp_path, preset, kl, tis, dtype_name):
    x = _inputs(preset, seed=2)
    _check_coverage(preset, x)
    loss_t, grad_t, met_t = _trl_loss(trl_mod, x, preset, kl, tis, dtype_name, tmp_path)
    with jax.enable_x64(dtype_name == "float64"):
        loss, grad, met = _run_ours(x, preset, kl, tis, jnp.dtype(dtype_name))
    tol = TOL64 if dtype_name == "float64" else TOL32
    np.testing.assert_allclose(loss, loss_t, **tol)
    np.testing.assert_allclose(grad, grad_t, **tol)
    assert np.abs(grad_t).max() > 1e-3 and abs(loss_t) > 1e-3
    if kl:
        np.testing.assert_allclose(met["kl"], met_t["kl"], **tol)
    if obj.LOSSES[preset].ratio_level == "token":  # TRL averages sequence-level clip flags over sequences instead
        np.testing.assert_allclose(met["clipped_low"], met_t["clip_ratio/low_mean"], **tol)
        np.testing.assert_allclose(met["clipped_high"], met_t["clip_ratio/high_mean"], **tol)
        assert met["clipped_low"] > 0 and met["clipped_high"] > 0


def test_group_advantages_trl_formula(trl_mod, x64):
    """TRL's scale_rewards="group" / "none" advantages (grpo_trainer.py ~L2763-2787, its nanstd: ddof=1)."""
    torch = trl_mod.torch
    g = 4
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3, -2.0, 5.0, 0.25, 1.5])  # the middle group is constant
    rt = torch.tensor(r, dtype=torch.float64)
    mean = torch.nanmean(rt.view(-1, g), dim=1).repeat_interleave(g)
    std = trl_mod.nanstd(rt.view(-1, g), dim=1).repeat_interleave(g)
    trl_scaled = ((rt - mean) / (std + 1e-4)).numpy()
    trl_plain = (rt - mean).numpy()
    ours_scaled = np.asarray(obj.group_advantages(jnp.asarray(r), g, scale=True))
    np.testing.assert_allclose(ours_scaled, trl_scaled, **TOL64)
    np.testing.assert_allclose(obj.group_advantages(jnp.asarray(r), g, scale=False), trl_plain, **TOL64)
    np.testing.assert_array_equal(ours_scaled[4:8], 0.0)
    # the sample std (ddof=1): the first group's std is sqrt(1/3), not 1/2
    np.testing.assert_allclose(ours_scaled[0], 0.5 / (np.sqrt(1 / 3) + 1e-4), rtol=1e-12)
    # eps is added to the std
    np.testing.assert_allclose(obj.group_advantages(jnp.asarray(r), g, scale=True, eps=0.5)[0],
                               0.5 / (np.sqrt(1 / 3) + 0.5), rtol=1e-12)
    # a group of one (TRL: std 0) and integer rewards
    np.testing.assert_array_equal(obj.group_advantages(jnp.arange(3), 1, scale=True), 0.0)
    with pytest.raises(ValueError):
        obj.group_advantages(jnp.zeros(10), 4, scale=True)


def test_nonzero_variance_groups():
    r = jnp.array([1.0, 1, 1, 0, 0, 0, 0, 1, 0, 0.5, 0.5, 0.5 + 1e-6])
    np.testing.assert_array_equal(obj.nonzero_variance_groups(r, 3), [False, False, True, True])
    np.testing.assert_array_equal(obj.nonzero_variance_groups(r, 6), [True, True])
    assert obj.nonzero_variance_groups(r, 3).dtype == jnp.bool_
    np.testing.assert_array_equal(jax.jit(obj.nonzero_variance_groups, static_argnums=1)(r, 3),
                                  [False, False, True, True])


@pytest.mark.parametrize("max_len,buffer", [(10, 4), (10, 0), (8, 8), (5, 1)])
def test_overlong_penalty_matches_trl(trl_mod, max_len, buffer):
    from trl.rewards import get_soft_overlong_punishment
    lengths = np.arange(0, max_len + 4)
    want = get_soft_overlong_punishment(max_len, buffer)([[0] * n for n in lengths])
    np.testing.assert_allclose(obj.overlong_penalty(jnp.asarray(lengths), max_len, buffer), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(obj.overlong_penalty(jnp.asarray(lengths), max_len, buffer, penalty=0.5),
                               0.5 * np.asarray(want), rtol=1e-6, atol=1e-7)


def test_overlong_penalty_edges():
    got = np.asarray(obj.overlong_penalty(jnp.array([0, 6, 7, 8, 9, 10, 11, 100]), 10, 4, penalty=2.0))
    np.testing.assert_allclose(got, [0, 0, -0.5, -1.0, -1.5, -2.0, -2.0, -2.0], rtol=1e-7)
    assert got.dtype == np.float32 and (got <= 0).all()
    np.testing.assert_array_equal(obj.overlong_penalty(jnp.array([10, 11]), 10, 0), [0.0, -1.0])
    with pytest.raises(ValueError):
        obj.overlong_penalty(jnp.array([1]), 10, 11)


def test_token_weights():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], jnp.int32)
    seq = np.asarray(obj.token_weights(mask, "sequence"))
    assert seq.dtype == np.float32
    np.testing.assert_allclose(seq.sum(1), [0.25, 0.25, 0.0, 0.25], rtol=1e-6)  # the empty row counts in B = 4
    np.testing.assert_allclose(seq[0, :3], 1 / 12, rtol=1e-6)
    np.testing.assert_allclose(seq[3], [1 / 12, 1 / 12, 0, 1 / 12], rtol=1e-6)
    tok = np.asarray(obj.token_weights(mask, "token"))
    np.testing.assert_allclose(tok.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(tok[mask > 0], 1 / 7, rtol=1e-6)
    fixed = np.asarray(obj.token_weights(mask, "fixed", max_len=10))
    np.testing.assert_allclose(fixed[mask > 0], 1 / 40, rtol=1e-6)
    np.testing.assert_allclose(fixed.sum(), 7 / 40, rtol=1e-6)
    for w in (seq, tok, fixed):
        assert (w[np.asarray(mask) == 0] == 0).all()
    # bool masks, and an all-empty mask gives zeros, not NaN (denominators clamped at 1, as TRL)
    np.testing.assert_allclose(obj.token_weights(mask > 0, "token"), tok)
    for agg in ("sequence", "token"):
        np.testing.assert_array_equal(obj.token_weights(jnp.zeros((2, 3)), agg), 0.0)
    with pytest.raises(ValueError):
        obj.token_weights(mask, "fixed")
    with pytest.raises(ValueError):
        obj.token_weights(mask, "mean")


def test_padding_garbage_and_unscored_rollout_tokens():
    """-inf / NaN log-probabilities at untrained positions reach neither the loss nor the gradient, and a NaN
    rollout log-probability of a trained token gives TIS weight 1 (TRL)."""
    x = _inputs("dapo")
    on = x["mask"] > 0
    bad = {k: np.where(on, x[k], np.nan) for k in ("logp", "old", "ref", "roll")}
    roll = bad["roll"].copy()
    roll[0, 0] = np.nan
    p = obj.LOSSES["dapo"]

    def f(lp):
        return obj.policy_loss(lp, bad["old"], x["adv"], x["mask"], ref_logp=bad["ref"], beta=KL_BETA,
                               rollout_logp=roll, tis_threshold=TIS, **p.loss_kwargs())

    (loss, _), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(bad["logp"], jnp.float32))
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
    assert (np.asarray(grad)[~on] == 0).all()
    _, met = obj.per_token_loss(bad["logp"], bad["old"], x["adv"], x["mask"], rollout_logp=roll,
                                tis_threshold=TIS)
    assert float(met["tis_weight"][0, 0]) == 1.0 and float(met["tis_truncated"][0, 0]) == 0.0
    assert np.isfinite(np.asarray(met["ratio"])).all() and (np.asarray(met["ratio"])[~on] == 0).all()


def test_jit_with_static_switches_and_errors():
    x = _inputs("gspo")
    p = obj.LOSSES["gspo"]
    args = [jnp.asarray(x[k], jnp.float32) for k in ("logp", "old", "adv", "mask")]
    f = jax.jit(obj.policy_loss, static_argnames=("aggregation", "ratio_level", "clip_low", "clip_high", "max_len"))
    loss, met = f(*args, **p.loss_kwargs())
    want, _ = obj.policy_loss(*args, **p.loss_kwargs())
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert set(met) == {"clipped_low", "clipped_high", "kl", "ratio", "tis_weight", "tis_truncated"}
    # a traced beta works when ref_logp is given
    g = jax.jit(lambda beta: obj.policy_loss(*args, aggregation="token", ref_logp=args[0] + 0.1, beta=beta)[0])
    assert float(g(0.5)) != float(g(0.0))
    with pytest.raises(ValueError, match="ref_logp"):
        obj.per_token_loss(*args, beta=0.1)
    with pytest.raises(ValueError, match="rollout_logp"):
        obj.per_token_loss(*args, tis_threshold=2.0)
    with pytest.raises(ValueError, match="ratio_level"):
        obj.per_token_loss(*args, ratio_level="seq")
    with pytest.raises(ValueError, match="aggregation"):
        obj.policy_loss(*args, aggregation="seq")
    with pytest.raises(ValueError, match="advantages"):
        obj.per_token_loss(args[0], args[1], args[0], args[3])


def test_presets():
    assert set(obj.LOSSES) == {"grpo", "dr_grpo", "dapo", "gspo"}
    got = {k: (v.ratio_level, v.aggregation, v.scale_advantages, v.clip_low, v.clip_high) for k, v in obj.LOSSES.items()}
    assert got == {"grpo": ("token", "sequence", True, 0.2, 0.2), "dr_grpo": ("token", "fixed", False, 0.2, 0.2),
                   "dapo": ("token", "token", True, 0.2, 0.28), "gspo": ("sequence", "sequence", True, 3e-4, 4e-4)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.LOSSES["grpo"].clip_low = 0.3

"""The GRPO-family policy-gradient objectives as pure JAX functions.

One clipped-surrogate loss with the switches that tell the family apart:

- GRPO (DeepSeekMath, arXiv 2402.03300): group-relative advantages ``(r - mean) / std`` over the G
  completions of a prompt, the PPO clipped ratio per token, the loss averaged over each sequence's tokens
  and then over sequences, an optional k3 KL to a reference policy.
- Dr.GRPO (arXiv 2503.20783): no std scaling of the advantages and no per-sequence length normalization
  (both bias the gradient): the token losses are summed and divided by a constant, batch x max length.
- DAPO (arXiv 2503.14476): clip-higher (``clip_high > clip_low``), a token-level mean over the whole batch,
  dynamic sampling (drop groups whose rewards are all equal: :func:`nonzero_variance_groups`) and the soft
  overlong punishment (:func:`overlong_penalty`).
- GSPO (arXiv 2507.18071): one importance ratio per sequence, the geometric mean of its token ratios
  ``s_i = exp(mean_t(log pi - log pi_old))``, clipped with a much narrower range (3e-4 / 4e-4).

Plus truncated importance sampling (TIS; Yao et al., "Your efficient RL framework secretly brings you
off-policy RL training") against the rollout engine's own log-probabilities: the sampler and the trainer's
recomputation of the same tokens differ, so each token's policy term is weighted by
``min(pi_old / pi_rollout, C)``.

Conventions are those of TRL 1.16.0 (``trl/trainer/grpo_trainer.py``: ``GRPOTrainer._compute_loss`` and the
advantage computation in ``_generate_and_score_completions``), which ``tests/test_rl_objectives.py`` drives
on the same inputs:

- the std of :func:`group_advantages` is the sample std (Bessel's correction, ``ddof=1``; TRL's ``nanstd``),
  and ``eps`` is added to the std, not under the square root; a group of one has std 0 (TRL);
- empty rows (no trained token) get weight 0; TRL clamps every token-count denominator at 1, so an empty
  row still counts as one of the B sequences of the ``"sequence"`` and ``"fixed"`` means;
- TIS multiplies the policy (clipped-surrogate) term only, before the KL term is added, as TRL applies its
  ``importance_sampling_ratio`` (``vllm_importance_sampling_mode="token_truncate"``);
- the KL term is ``beta * k3`` per token, not weighted by the ratio: TRL's ``use_bias_correction_kl=False``
  (TRL 1.16's default, ``True``, multiplies the k3 by the importance ratio).

Every function is jit-able with the string switches (``aggregation``, ``ratio_level``), ``group_size``,
``max_len``, ``buffer``, ``tis_threshold`` and the clip ranges static (Python values); ``beta`` may be traced
when ``ref_logp`` is given. Arrays are ``[B, T]`` (batch x completion positions) unless said otherwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

AGGREGATIONS = ("sequence", "token", "fixed")
RATIO_LEVELS = ("token", "sequence")


def _float(x) -> jax.Array:
    """``x`` as a JAX array, integers and bools as float32 (floats keep their dtype)."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.float32)


def _groups(rewards, group_size: int) -> jax.Array:
    r = _float(rewards)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {r.shape}")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    return r.reshape(-1, group_size)  # [P, G]: prompt i's completions are rows [i*G, (i+1)*G)


def group_advantages(rewards, group_size: int, *, scale: bool, eps: float = 1e-4) -> jax.Array:
    """GRPO's group-relative advantages (arXiv 2402.03300, section 4.1.2), one per completion.

    ``rewards``: [N], N = P * G, each prompt's G completions contiguous (rows ``[i*G, (i+1)*G)``).
    Returns [N]: ``A = r - mean(group)``; with ``scale=True`` divided by ``std(group) + eps`` where std is the
    *sample* standard deviation (Bessel's correction, ``ddof=1``), as TRL's ``nanstd`` computes it, and a group
    of one has std 0. ``scale=False`` is Dr.GRPO's (arXiv 2503.20783): the std scaling weights prompts by their
    difficulty. A group whose rewards are all equal gets advantages 0 either way. Rewards must be finite.
    """
    g = _groups(rewards, group_size)
    a = g - g.mean(axis=1, keepdims=True)
    if scale:
        if group_size > 1:
            std = jnp.sqrt(jnp.sum(a * a, axis=1, keepdims=True) / (group_size - 1))
        else:  # TRL: num_generations == 1 has no spread (A is 0 anyway)
            std = jnp.zeros_like(a)
        a = a / (std + eps)
    return a.reshape(-1)


def nonzero_variance_groups(rewards, group_size: int) -> jax.Array:
    """[P] bool: the groups whose G rewards are not all equal (exact comparison).

    DAPO's dynamic sampling (arXiv 2503.14476, eq. 11: ``0 < |{correct}| < G``) keeps only these groups: a
    group with equal rewards has zero advantages and so contributes no policy gradient, only dilution.
    """
    g = _groups(rewards, group_size)
    return jnp.any(g != g[:, :1], axis=1)


def overlong_penalty(lengths, max_len: int, buffer: int, penalty: float = 1.0) -> jax.Array:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), a reward term [N] <= 0.

    ``lengths``: [N] completion lengths in tokens. 0 while ``length <= max_len - buffer``, then linear down to
    ``-penalty`` at ``length == max_len`` (``-penalty * (length - (max_len - buffer)) / buffer``) and
    ``-penalty`` beyond; ``buffer == 0`` is a step (0 up to ``max_len``, ``-penalty`` after), as TRL's
    ``get_soft_overlong_punishment``.
    """
    if not 0 <= buffer <= max_len:
        raise ValueError(f"buffer must be in [0, max_len={max_len}], got {buffer}")
    n = _float(lengths)
    if buffer == 0:
        return jnp.where(n > max_len, -penalty, 0.0).astype(n.dtype)
    return (-penalty * jnp.clip((n - (max_len - buffer)) / buffer, 0.0, 1.0)).astype(n.dtype)


def _weights(mask, aggregation: str, max_len: int | None, dtype) -> jax.Array:
    m = jnp.asarray(mask).astype(dtype)
    if m.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {m.shape}")
    batch = m.shape[0]
    if aggregation == "sequence":  # GRPO: (1/B) sum_i (1/|o_i|) sum_t
        return m / jnp.maximum(m.sum(axis=1, keepdims=True), 1) / batch
    if aggregation == "token":  # DAPO: (1 / sum_i |o_i|) sum_i sum_t
        return m / jnp.maximum(m.sum(), 1)
    if aggregation == "fixed":  # Dr.GRPO: (1 / (B * max_len)) sum_i sum_t, a constant independent of lengths
        if max_len is None or max_len < 1:
            raise ValueError(f"aggregation 'fixed' needs max_len >= 1 (the max completion length), got {max_len}")
        return m / (batch * max_len)
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def token_weights(mask, aggregation: str, max_len: int | None = None) -> jax.Array:
    """[B, T] float32 weights such that ``sum(per_token_loss * weights)`` is the batch loss.

    ``mask``: [B, T], 1 (True) where the completion token is trained (fractional values weight tokens).

    - ``"sequence"``: mean over each sequence's tokens, then mean over the B sequences (GRPO; TRL ``"grpo"``);
    - ``"token"``: sum over all tokens / total tokens (DAPO; TRL ``"dapo"`` / ``"bnpo"`` on one micro-batch);
    - ``"fixed"``: sum over all tokens / (B * max_len) (Dr.GRPO; TRL ``"dr_grpo"``); ``max_len`` is the max
      completion length (the generation budget), required.

    Empty rows get weight 0 but, as in TRL (token-count denominators clamped at 1), still count in the B of
    ``"sequence"`` and ``"fixed"``; an all-empty mask gives all-zero weights. ``"token"`` normalizes by the
    tokens of this array: a batch split into micro-batches for gradient accumulation must rescale each
    micro-batch's weights by its token count over the full batch's (TRL's ``num_items_in_batch``).
    """
    return _weights(mask, aggregation, max_len, jnp.float32)


def per_token_loss(logp, old_logp, advantages, mask, *, ratio_level: str = "token", clip_low: float = 0.2,
                   clip_high: float | None = None, ref_logp=None, beta: float = 0.0, rollout_logp=None,
                   tis_threshold: float = 0.0) -> tuple[jax.Array, dict]:
    """The clipped-surrogate loss per token, ``[B, T]``, and per-token metrics.

    Args:
      logp: [B, T] log-probabilities of the sampled tokens under the policy being trained (the only input
        that gets a gradient; its dtype is the computation's).
      old_logp: [B, T] the same under the policy that sampled (pi_old; a constant).
      advantages: [B] one per completion (a constant).
      mask: [B, T] 1 where the token is trained. Values at untrained positions (padding: -inf, NaN) never reach
        the loss, its gradient or the metrics.
      ratio_level: ``"token"``: ``r_t = exp(logp_t - old_logp_t)`` (PPO / GRPO / DAPO). ``"sequence"`` (GSPO):
        ``s_i = exp(sum_t m_t (logp_t - old_logp_t) / max(sum_t m_t, 1))`` broadcast to the row's tokens, with
        the gradient flowing through the mean to every token (``d s_i / d logp_t = s_i m_t / |y_i|``), exactly
        TRL's ``importance_sampling_level="sequence"``. GSPO-token's form ``sg(s_i) * exp(logp_t - sg(logp_t))``
        has the same values, and the same gradients wherever the token weights are uniform within a row (the
        three aggregations here without TIS); with TIS's per-token weights TRL's form (this one) spreads the
        row's total weight evenly over its tokens' gradients.
      clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]``; ``clip_high=None`` is ``clip_low``
        (symmetric PPO); ``clip_high > clip_low`` is DAPO's clip-higher.
      ref_logp: [B, T] reference-policy log-probabilities (a constant), for the KL term.
      beta: the KL coefficient: adds ``beta * k3`` per token, ``k3 = exp(ref - logp) - (ref - logp) - 1``
        (GRPO eq. 4; unbiased and non-negative). Needs ``ref_logp`` unless 0.
      rollout_logp: [B, T] the rollout engine's log-probabilities of the sampled tokens, for TIS.
      tis_threshold: > 0 turns TIS on: the policy term (not the KL term, as in TRL) is multiplied by
        ``stop_gradient(min(exp(old_logp - rollout_logp), tis_threshold))``; a NaN rollout log-probability
        (unavailable from the sampler) gives weight 1, as in TRL.

    Returns:
      ``(loss [B, T], metrics)``: the loss is ``tis_weight * -min(r A, clip(r) A) + beta * kl``, zero where
      ``mask`` is 0. ``metrics`` maps to [B, T] arrays in the loss's dtype, zero where ``mask`` is 0:
      ``"clipped_low"`` / ``"clipped_high"`` (1 where the clip took effect: ``r < 1 - clip_low`` with ``A < 0``,
      ``r > 1 + clip_high`` with ``A > 0``, TRL's definition), ``"kl"`` (k3; zeros without ``ref_logp``),
      ``"ratio"`` (r, or s_i on each of its tokens), ``"tis_weight"`` (ones when TIS is off), ``"tis_truncated"``
      (1 where the weight was cut at the threshold).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; expected one of {RATIO_LEVELS}")
    logp = _float(logp)
    dtype = logp.dtype
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got shape {logp.shape}")
    m = jnp.asarray(mask).astype(dtype)
    if m.shape != logp.shape:
        raise ValueError(f"mask shape {m.shape} != logp shape {logp.shape}")
    on = m != 0
    adv = jax.lax.stop_gradient(jnp.asarray(advantages).astype(dtype))
    if adv.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {logp.shape[:1]}, got shape {adv.shape}")
    adv = adv[:, None]
    old = jax.lax.stop_gradient(jnp.asarray(old_logp).astype(dtype))
    # 0 at untrained positions, so padding values (-inf - -inf = NaN) reach neither values nor gradients: where's
    # gradient to the branch it did not pick is exactly 0.
    log_ratio = jnp.where(on, logp - old, 0)

    if ratio_level == "token":
        ratio = jnp.exp(log_ratio)
    else:  # GSPO: the length-normalized sequence likelihood ratio (arXiv 2507.18071, eq. 7)
        seq = (log_ratio * m).sum(axis=1, keepdims=True) / jnp.maximum(m.sum(axis=1, keepdims=True), 1)
        ratio = jnp.broadcast_to(jnp.exp(seq), logp.shape)

    high = clip_low if clip_high is None else clip_high
    # PPO's pessimistic bound: the clipped ratio only ever lowers the objective (removes incentive to move r
    # further out of the trust region), so min() takes it exactly where the clip "took effect".
    policy = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_low, 1 + high) * adv)
    clipped_low = (ratio < 1 - clip_low) & (adv < 0)
    clipped_high = (ratio > 1 + high) & (adv > 0)

    tis_threshold = float(tis_threshold)
    if tis_threshold > 0:
        if rollout_logp is None:
            raise ValueError("tis_threshold > 0 needs rollout_logp")
        roll = jax.lax.stop_gradient(jnp.asarray(rollout_logp).astype(dtype))
        d = jnp.where(on, old - roll, 0)
        raw = jnp.exp(jnp.where(jnp.isnan(d), 0, d))  # TRL: unscored tokens get no correction
        tis_weight = jnp.minimum(raw, tis_threshold)
        tis_truncated = raw > tis_threshold
        policy = policy * tis_weight  # the policy term only: TRL adds the KL term after its IS correction
    else:
        tis_weight = jnp.ones_like(logp)
        tis_truncated = jnp.zeros(logp.shape, bool)

    if ref_logp is not None:
        d = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(ref_logp).astype(dtype)) - logp, 0)
        kl = jnp.exp(d) - d - 1  # k3 (Schulman's estimator of KL(pi || pi_ref)), as GRPO eq. 4
        loss = policy + beta * kl
    else:
        if not isinstance(beta, (int, float)) or beta != 0:
            raise ValueError("beta != 0 needs ref_logp")
        kl = jnp.zeros_like(logp)
        loss = policy

    def masked(x):
        return jnp.where(on, x.astype(dtype), 0)

    metrics = {"clipped_low": clipped_low, "clipped_high": clipped_high, "kl": kl, "ratio": ratio,
               "tis_weight": tis_weight, "tis_truncated": tis_truncated}
    return masked(loss), {k: masked(v) for k, v in metrics.items()}


def policy_loss(logp, old_logp, advantages, mask, *, aggregation: str, max_len: int | None = None,
                **kw) -> tuple[jax.Array, dict]:
    """The batch loss ``sum(per_token_loss * token_weights)`` (a scalar) and scalar metrics.

    ``logp``, ``old_logp``, ``mask``: [B, T]; ``advantages``: [B]; ``aggregation`` / ``max_len`` as in
    :func:`token_weights` (its weights in the loss's dtype here); ``kw`` as in :func:`per_token_loss`. Each metric
    of :func:`per_token_loss` is averaged over the masked tokens (so a sequence-level ratio counts once per token
    of its row); an all-empty mask gives zeros.
    """
    w = _weights(mask, aggregation, max_len, _float(logp).dtype)  # validates before any work
    loss_tok, metrics = per_token_loss(logp, old_logp, advantages, mask, **kw)
    m = jnp.asarray(mask).astype(loss_tok.dtype)
    count = jnp.maximum(m.sum(), 1)
    return jnp.sum(loss_tok * w), {k: jnp.sum(v * m) / count for k, v in metrics.items()}


@dataclasses.dataclass(frozen=True)
class LossPreset:
    """One member of the family: how the ratio is taken, how tokens are aggregated, whether advantages are
    std-scaled (:func:`group_advantages`'s ``scale``), and the paper's clip range."""

    ratio_level: str
    aggregation: str
    scale_advantages: bool
    clip_low: float
    clip_high: float

    def loss_kwargs(self) -> dict:
        """The keyword arguments of :func:`policy_loss` this preset fixes (``max_len`` is the caller's)."""
        return {"ratio_level": self.ratio_level, "aggregation": self.aggregation, "clip_low": self.clip_low,
                "clip_high": self.clip_high}


LOSSES = {
    # DeepSeekMath eq. 3: per-token PPO clip (0.2), mean over each sequence's tokens, then over the group
    "grpo": LossPreset(ratio_level="token", aggregation="sequence", scale_advantages=True, clip_low=0.2,
                       clip_high=0.2),
    # Dr.GRPO eq. 3: no 1/|o_i|, no std: a constant normalizer (B * max completion length)
    "dr_grpo": LossPreset(ratio_level="token", aggregation="fixed", scale_advantages=False, clip_low=0.2,
                          clip_high=0.2),
    # DAPO eq. 8 (and section 3.1's clip-higher: eps_low 0.2, eps_high 0.28): token-level mean over the batch
    "dapo": LossPreset(ratio_level="token", aggregation="token", scale_advantages=True, clip_low=0.2,
                       clip_high=0.28),
    # GSPO eq. 5-7: sequence ratio, mean over sequences, clip 3e-4 / 4e-4 (its section 5.1)
    "gspo": LossPreset(ratio_level="sequence", aggregation="sequence", scale_advantages=True, clip_low=3e-4,
                       clip_high=4e-4),
}

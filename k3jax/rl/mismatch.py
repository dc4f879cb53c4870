"""The rollout / trainer mismatch: how far the engine's sampling distribution is from the trainer's
recomputation on the same weights (kernels, batch shapes, cached vs full forward; for an MoE model also
the routing), measured on the rollout's own tokens (verl's ``rollout_corr`` metrics; research/rl.md)."""

from __future__ import annotations

import numpy as np


def logprob_mismatch(rollout_logp: np.ndarray, trainer_logp: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """rollout_logp / trainer_logp / mask ``[B, T]`` -> KL(rollout || trainer) by the k1 estimator
    (``mean(log p_roll - log p_train)``) and the k3 one (``mean(r - 1 - log r)``, ``r = p_train / p_roll``:
    unbiased and never negative), the largest ``|Δ log p|`` and the Pearson correlation of the token
    probabilities, over the masked tokens (tokens sampled by the rollout)."""
    m = np.asarray(mask) > 0
    roll, train = np.asarray(rollout_logp, np.float64)[m], np.asarray(trainer_logp, np.float64)[m]
    if roll.size == 0:
        return {}
    log_r = train - roll
    p_roll, p_train = np.exp(roll), np.exp(train)
    spread = p_roll.std() * p_train.std()
    pearson = float(np.mean((p_roll - p_roll.mean()) * (p_train - p_train.mean())) / spread) if spread > 0 else 1.0
    return {"kl_k1": float(np.mean(-log_r)), "kl_k3": float(np.mean(np.expm1(log_r) - log_r)),
            "max_abs_logp": float(np.max(np.abs(log_r))), "prob_pearson": pearson}


def routing_disagreement(recorded: np.ndarray, recomputed: np.ndarray, token_mask: np.ndarray) -> float:
    """The fraction of routing decisions that differ: of every (token, MoE layer, selected expert) of the
    recomputation, those the rollout did not select for that token and layer. recorded / recomputed
    ``[B, T, M, k]`` int, token_mask ``[B, T]`` (real tokens)."""
    m = np.asarray(token_mask) > 0
    a, b = np.asarray(recorded)[m], np.asarray(recomputed)[m]  # [N, M, k]
    if a.size == 0:
        return 0.0
    same = (b[..., :, None] == a[..., None, :]).any(axis=-1)  # [N, M, k]: each recomputed expert among the recorded
    return float(1.0 - same.mean())


__all__ = ["logprob_mismatch", "routing_disagreement"]

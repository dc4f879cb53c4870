"""The RL programs on the training state: the policy-gradient train step and the scoring forward.

Both run the same ``model.forward`` as pre-training, decoding and the rollout engine, over rows of
prompt + completion tokens (``k3jax.rl.batch``), with the rollout's experts replayed when
``train.rl.routing_replay`` is on.

A batch (numpy, ``[B, T]`` unless said): ``tokens``, ``segment_ids`` (1 = a token, 0 = padding), ``targets``
(the next token), ``mask`` (1 where the target is a model token that trains), ``weights`` (the objective's
aggregation weights, ``objectives.token_weights`` over the whole batch, so micro-batches add up),
``advantages [B]``, ``rollout_logp`` (the engine's log-probabilities of the targets), ``old_logp`` (the
scoring forward's, before the rollout's first update; used with ``updates_per_rollout > 1``), ``ref_logp``
(the KL reference's, with ``beta > 0``: ``k3jax.rl.reference``) and ``routes [B, T, M, k]`` (the experts each
token used in the rollout; with ``routing_replay``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import Config
from k3jax.layers.lora import LoRAParam
from k3jax.model import moe_layers
from k3jax.rl.objectives import LOSSES, per_token_loss
from k3jax.rl.reference import keeps_reference
from k3jax.training.step import make_step

# The per-token quantities the step sums over the trained tokens (the loop divides by ``tokens``).
# ``objectives.per_token_loss``'s per-token metrics, and the policy's entropy.
POLICY_METRICS = ("clipped_low", "clipped_high", "kl", "ratio", "tis_weight", "tis_truncated")
TOKEN_SUMS = (*POLICY_METRICS, "entropy")


def policy_logprobs(logits: jax.Array, targets: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """logits ``[B, T, V]``, targets ``[B, T]`` -> (the targets' log-probabilities under
    ``softmax(logits / temperature)``, that distribution's entropy), both ``[B, T]`` float32: the policy
    the rollout sampled from (``serving.programs.sampled_logprobs``)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    own = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return own, entropy


def objective_settings(cfg: Config) -> dict:
    """``per_token_loss``'s keyword arguments for ``train.rl`` (its preset, with the config's overrides)."""
    rl = cfg.train.rl
    preset = LOSSES[rl.loss]
    return dict(ratio_level=preset.ratio_level,
                clip_low=preset.clip_low if rl.clip_low is None else rl.clip_low,
                clip_high=preset.clip_high if rl.clip_high is None else rl.clip_high,
                beta=rl.beta, tis_threshold=rl.tis_threshold)


def aggregation(cfg: Config) -> str:
    """How the token losses add up: ``train.rl.aggregation``, or the objective's own."""
    rl = cfg.train.rl
    return LOSSES[rl.loss].aggregation if rl.aggregation == "auto" else rl.aggregation


def replays(cfg: Config) -> bool:
    """Whether the training forward replays the rollout's experts: ``routing_replay`` on a model with MoE layers."""
    return cfg.train.rl.routing_replay and bool(moe_layers(cfg.model))


def _forward_logprobs(model, batch, temperature, *, replay: bool, record: bool = False, lora_key=None):
    """-> (the targets' log-probabilities ``[B, T]``, the entropy ``[B, T]``, the forward's ForwardStats)."""
    logits, _, stats = model.forward(batch["tokens"], segment_ids=batch["segment_ids"], lora_key=lora_key,
                                     replay_routes=batch["routes"] if replay else None, record_routes=record)
    with jax.named_scope("lm_head_loss"):
        logp, entropy = policy_logprobs(logits, batch["targets"], temperature)
    return logp, entropy, stats


def make_rl_step(graphdef, cfg: Config, *, state_shardings=None):
    """``step(state, batch) -> (state, metrics)``: one optimizer step on the policy loss of a rollout batch
    (module docstring), jitted with the state donated. metrics: ``loss``, ``grad_norm``, ``tokens`` (trained
    tokens), ``finite``, ``expert_imbalance`` and the sums of :data:`TOKEN_SUMS` over the trained tokens."""
    rl = cfg.train.rl
    settings = objective_settings(cfg)
    replay = replays(cfg)

    def objective(model, mb, lora_key):
        logp, entropy, stats = _forward_logprobs(model, mb, rl.temperature, replay=replay, lora_key=lora_key)
        with jax.named_scope("lm_head_loss"):
            # one update per rollout: the old policy is this one (ratio 1, TRL's detach)
            old = mb["old_logp"] if rl.updates_per_rollout > 1 else jax.lax.stop_gradient(logp)
            loss, per_token = per_token_loss(logp, old, mb["advantages"], mb["mask"],
                                             ref_logp=mb["ref_logp"] if rl.beta > 0 else None,
                                             rollout_logp=mb["rollout_logp"] if rl.tis_threshold > 0 else None,
                                             **settings)
            mask = mb["mask"].astype(jnp.float32)
            total = jnp.sum(loss * mb["weights"])
            sums = {name: jnp.sum(per_token[name].astype(jnp.float32) * mask) for name in POLICY_METRICS}
            sums["entropy"] = jnp.sum(entropy * mask)
        return total, jnp.sum(mask), total, stats, sums

    return make_step(graphdef, cfg, objective, per_count=False, sum_names=TOKEN_SUMS, state_shardings=state_shardings)


def _reference_model(model, reference):
    """The KL reference as a model: ``model`` with the ``reference`` weights (a full fine-tune's), or without
    them a LoRA run's frozen base (its adapters at zero: no second model)."""
    if reference is not None:
        return nnx.merge(nnx.graphdef(model), reference)
    model_def, adapters, rest = nnx.split(model, LoRAParam, ...)
    return nnx.merge(model_def, jax.tree.map(jnp.zeros_like, adapters), rest)  # B = 0: no low-rank path


def make_score_fn(graphdef, cfg: Config, *, reference=None):
    """``score(state, batch) -> dict`` of ``[B, T]`` arrays, no gradient, on the weights that sampled the
    rollout: ``logp`` (the trainer's log-probabilities of the targets, experts replayed when
    ``routing_replay``), with ``measure_mismatch`` on a replaying MoE model also ``free_logp`` and
    ``free_routes [B, T, M, k]`` (its own top-k: what replay corrects), and with ``beta > 0`` ``ref_logp``
    (the KL reference's, experts replayed alike: a LoRA run's frozen base, or a full fine-tune's
    ``reference``, the model state of ``k3jax.rl.reference.reference_weights``, which that run must pass)."""
    rl = cfg.train.rl
    replay = replays(cfg)
    if keeps_reference(cfg) and reference is None:
        raise ValueError("a full fine-tune with train.rl.beta > 0 scores against its reference weights: pass "
                         "reference=k3jax.rl.reference.reference_weights(...)")
    if reference is not None and not keeps_reference(cfg):
        raise ValueError("reference weights are a full fine-tune's with train.rl.beta > 0 (a LoRA run's reference "
                         "is its frozen base; beta = 0 has none)")

    @jax.jit
    def scored(state, reference, batch):
        model = nnx.merge(graphdef, state).model
        out = {"logp": _forward_logprobs(model, batch, rl.temperature, replay=replay)[0]}
        if replay and rl.measure_mismatch:
            out["free_logp"], _, stats = _forward_logprobs(model, batch, rl.temperature, replay=False, record=True)
            out["free_routes"] = stats.routes
        if rl.beta > 0:
            out["ref_logp"] = _forward_logprobs(_reference_model(model, reference), batch, rl.temperature,
                                                replay=replay)[0]
        return out

    def score(state, batch):
        return scored(state, reference, batch)  # an argument, not a constant folded into the program

    return score


__all__ = ["TOKEN_SUMS", "aggregation", "make_rl_step", "make_score_fn", "objective_settings", "policy_logprobs", "replays"]

"""The run's optimizer: ``clip -> partition(per-head Muon, AdamW)`` (or AdamW alone), and a LoRA run's.

The AdamW side gets a weight-decay mask (``k3jax.optim.grouping``), plain AdamW (not Nesterov) and its own
epsilon; its statistics are float32 whatever the weights' dtype (``k3jax.optim.precision``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from k3jax.config import OptimConfig
from k3jax.layer_plan import LayerPlan
from k3jax.optim.grouping import ADAMW, MUON, axes_of, flat_params, group_table, normalize_path, path_lookup
from k3jax.optim.muon import CONSISTENT_RMS, STACKED_EXPERTS_AXES, scale_by_consistent_rms, scale_by_grouped_muon
from k3jax.optim.precision import decayed_weights_in_float32, float32_statistics, stochastic_weight_rounding
from k3jax.optim.schedules import learning_rate_schedule


def make_optimizer(cfg: OptimConfig, model, total_steps: int, seed: int = 0) -> optax.GradientTransformation:
    """``clip_by_global_norm -> partition(muon: per-head Muon, adamw: AdamW)`` for ``model``'s
    ``nnx.Param`` tree (a module, or an ``nnx.State`` of its Params). See ``k3jax.optim``.
    ``cfg.optimizer == "adamw"``: ``clip_by_global_norm -> AdamW`` on every parameter, with the same
    weight-decay mask (the matrices decay, as under Muon)."""
    table = group_table(model, per_head=cfg.per_head_muon)
    labels_t = {p: g for p, (g, _, _) in table.items()}
    dims_t = {p: dn for p, (_, dn, _) in table.items()}
    decay_t = {p: d for p, (_, _, d) in table.items()}
    experts_t = {p: (axes_of(var) or ())[:2] == STACKED_EXPERTS_AXES for p, var in flat_params(model)}

    def labels(params):
        return jax.tree_util.tree_map_with_path(path_lookup(labels_t, "labels"), params)

    def dim_nums(updates):  # sees the Muon-masked tree: only Muon leaves are visited
        return jax.tree_util.tree_map_with_path(path_lookup(dims_t, "dimension numbers"), updates)

    def stacked(updates):  # the scanned layer groups' weights: axis 0 is the group
        return jax.tree_util.tree_map_with_path(lambda path, _: LayerPlan.is_stacked(normalize_path(path)), updates)

    def expert_stacks(updates):  # stacked routed experts: [layers, E, ...]
        return jax.tree_util.tree_map_with_path(path_lookup(experts_t, "expert stacks"), updates)

    def adam_decay_mask(params):
        return jax.tree_util.tree_map_with_path(path_lookup(decay_t, "decay mask"), params)

    muon_lr = learning_rate_schedule(cfg, total_steps)
    adam_peak = cfg.adam_learning_rate if cfg.adam_learning_rate is not None else cfg.learning_rate
    adam_lr = learning_rate_schedule(cfg, total_steps, peak=adam_peak)
    muon_tx = optax.chain(
        scale_by_grouped_muon(dim_nums, beta=cfg.muon_beta, ns_steps=cfg.ns_steps, nesterov=True,
                              mu_dtype=jnp.dtype(cfg.muon_dtype),  # not the weights' (bf16 weights, f32 momentum)
                              stacked=stacked, expert_stacks=expert_stacks),
        scale_by_consistent_rms(dim_nums, CONSISTENT_RMS),
        decayed_weights_in_float32(cfg.weight_decay),
        optax.scale_by_learning_rate(muon_lr),
    )
    adam_tx = float32_statistics(optax.adamw(adam_lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                             weight_decay=cfg.weight_decay, mask=adam_decay_mask))
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(adam_tx if cfg.optimizer == ADAMW else optax.partition({MUON: muon_tx, ADAMW: adam_tx}, labels))
    if cfg.weight_rounding == "stochastic":
        parts.append(stochastic_weight_rounding(seed))
    return optax.chain(*parts)


def make_lora_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optimizer of a LoRA run (``train.lora.rank > 0``): ``clip_by_global_norm -> AdamW`` over the
    adapters, what PEFT users expect (HF's trainer), whatever ``cfg.optimizer``: ``adam_learning_rate``
    (else ``learning_rate``), ``adam_b1 / b2 / eps``, the schedule, and ``weight_decay`` on every adapter
    factor (HF's trainer decays all but biases and norms). Muon's settings play no part."""
    peak = cfg.adam_learning_rate if cfg.adam_learning_rate is not None else cfg.learning_rate
    adam = optax.adamw(learning_rate_schedule(cfg, total_steps, peak=peak), b1=cfg.adam_b1, b2=cfg.adam_b2,
                       eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adam) if cfg.grad_clip > 0 else adam



__all__ = ["make_lora_optimizer", "make_optimizer"]

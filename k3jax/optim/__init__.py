"""The optimizer (README "The architecture"): per-head Muon for matrices, AdamW for the rest, LR
schedules, QK-clip.

Muon update per block: Nesterov momentum 0.95, 5 Newton-Schulz steps with (3.4445, -4.7750, 2.0315),
scaled by ``0.2 * sqrt(max(rows, cols))`` of the block (``consistent_rms=0.2``), then
``W <- W - lr * (update + wd * W)``. AdamW (plain, not Nesterov; its own ``adam_eps``) uses
``adam_learning_rate`` (default: the Muon LR, which the 0.2 RMS matching allows) with the same
schedule shape. Weight decay (decoupled, multiplied by the LR as in Moonlight): every Muon matrix
and the embedding / lm_head; never norms, biases, gate constants, conv filters or AttnRes
queries/gains.

- ``grouping``: which parameters Muon updates and how each is cut into blocks (the table), the rest AdamW;
- ``muon``: the Muon transform (momentum, grouped Newton-Schulz, consistent-RMS scaling);
- ``newton_schulz``: the per-block iteration and where each block runs on a mesh;
- ``precision``: float32 weight decay / statistics and stochastic rounding for bf16 weights;
- ``schedules``: the learning-rate schedules;
- ``optimizer``: the chain a run trains with (:func:`make_optimizer`, :func:`make_lora_optimizer`);
- ``qk_clip``: K2's MuonClip, which edits MLA weights after the step (``k3jax.optim.qk_clip.qk_clip``).
"""

from k3jax.optim.grouping import (ADAMW, MDN, MUON, cast_muon_group, classify, group_table, muon_dimension_numbers,
                                  normalize_path, param_group)
from k3jax.optim.optimizer import make_lora_optimizer, make_optimizer
from k3jax.optim.schedules import learning_rate_schedule

__all__ = ["ADAMW", "MDN", "MUON", "cast_muon_group", "classify", "group_table", "learning_rate_schedule", "make_lora_optimizer",
           "make_optimizer", "muon_dimension_numbers", "normalize_path", "param_group"]

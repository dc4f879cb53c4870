"""The KL reference of an RL run (``train.rl.beta > 0``): the policy the k3 penalty keeps the trained one near,
the run's starting weights, never updated, used only in the scoring forward (``k3jax.rl.step.make_score_fn``'s
``ref_logp``).

A LoRA run's reference is its frozen base: the scoring forward sets the adapters to zero, no weights are kept.
A full fine-tune keeps a frozen copy of its starting weights, as TRL and tunix do: those ``train.init_from``
names, or the run's own seed initialisation without it (``checkpoint.resolve_base``). Its checkpoints record
that source (``base``, ``checkpoint.names_base``), so a resumed run reads the step-0 weights again, whatever
its own have become.
"""

from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import Config
from k3jax.model import abstract_model
from k3jax.training import checkpoint


def keeps_reference(cfg: Config) -> bool:
    """Whether ``cfg``'s run keeps reference weights of its own: a full fine-tune with ``train.rl.beta > 0``."""
    rl = cfg.train.rl
    return rl.enabled and rl.beta > 0 and not cfg.train.lora.enabled


def reference_weights(cfg: Config, base: dict | None, policy: nnx.State, mesh) -> nnx.State | None:
    """The reference weights of a full fine-tune (:func:`keeps_reference`; else None): the model state
    ``base`` names (``checkpoint.resolve_base``, as ``training.trainer.start_state`` returns it: recorded
    at step 0, read from the checkpoint on resume), placed in the shardings of ``policy`` (the trained
    model's state) on ``mesh``.

    Memory: a second copy of the model's weights on the mesh, as many bytes as the trained weights (their
    optimizer state aside); a LoRA run keeps none. Raises ``checkpoint.CheckpointError`` naming the source
    when it is gone or holds another model."""
    if not keeps_reference(cfg):
        return None
    if base is None:
        raise ValueError("a full fine-tune's KL reference (train.rl.beta > 0) needs its source: "
                         "base=checkpoint.resolve_base(train.init_from, train.seed)")
    model = abstract_model(cfg.model)
    try:
        checkpoint.load_base(model, base, mesh)
    except Exception as e:  # noqa: BLE001 - gone, unreadable or another model: the run cannot go on the same
        raise checkpoint.CheckpointError(
            f"the KL reference (train.rl.beta={cfg.train.rl.beta}) is the run's step-0 weights, {base}, and they "
            f"cannot be read ({type(e).__name__}: {e}). Put them back where the run found them, or start over "
            f"with --fresh or another run_dir.") from e
    return jax.device_put(nnx.state(model), jax.tree.map(lambda x: x.sharding, policy))


__all__ = ["keeps_reference", "reference_weights"]

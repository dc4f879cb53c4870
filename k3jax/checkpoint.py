"""Orbax checkpoints of k3jax models (and, from ``train.py``, of the whole training state).

Layout: ``<directory>/<step>/{config, model[, optimizer, data]}`` written by one
``orbax.checkpoint.CheckpointManager``: ``config`` is the run's config as JSON, ``model`` the NNX
state of the model (parameters and router-bias state). Any of these directories restores into a
model with :func:`restore_model`; the config travels with the weights, so nothing else is needed.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.config import Config, from_dict, to_dict
from k3jax.model import K3Model, abstract_model


def manager(directory: str | pathlib.Path, *, max_to_keep: int | None = None, save_interval_steps: int = 1,
            async_save: bool = True, item_names=("config", "model")) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                           enable_async_checkpointing=async_save, create=True)
    return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options, item_names=item_names)


def save_model(directory: str | pathlib.Path, model: K3Model, config: Config, *, step: int = 0) -> None:
    """Write ``model`` and its ``config`` as step ``step`` of a checkpoint directory."""
    with manager(directory, async_save=False) as mngr:
        mngr.save(step, args=ocp.args.Composite(config=ocp.args.JsonSave(to_dict(config)),
                                                model=ocp.args.StandardSave(nnx.state(model))), force=True)
        mngr.wait_until_finished()


def latest_step(directory: str | pathlib.Path) -> int | None:
    with manager(directory, async_save=False) as mngr:
        return mngr.latest_step()


def restore_config(directory: str | pathlib.Path, *, step: int | None = None) -> tuple[Config, int]:
    with manager(directory, async_save=False) as mngr:
        step = _resolve_step(mngr, directory, step)
        raw = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return from_dict(raw["config"]), step


def restore_model(directory: str | pathlib.Path, *, step: int | None = None, mesh=None,
                  config: Config | None = None) -> tuple[K3Model, Config]:
    """The model saved at ``step`` (default: the latest) of ``directory`` and its config.

    Pass ``config`` to check the checkpoint against an expected model config: a mismatch of any
    model field raises instead of restoring weights into the wrong architecture.
    """
    saved, step = restore_config(directory, step=step)
    if config is not None and config.model != saved.model:
        diff = _diff(to_dict(config.model), to_dict(saved.model))
        raise ValueError(f"checkpoint {directory} (step {step}) does not match the config: {diff}")
    graphdef, abstract_state = nnx.split(abstract_model(saved.model))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None else None
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), abstract_state)
    with manager(directory, async_save=False) as mngr:
        raw = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
    return nnx.merge(graphdef, raw["model"]), saved


def _resolve_step(mngr: ocp.CheckpointManager, directory, step: int | None) -> int:
    steps = mngr.all_steps()
    if not steps:
        raise FileNotFoundError(f"no checkpoint found in {directory}")
    if step is None:
        return max(steps)
    if step not in steps:
        raise FileNotFoundError(f"step {step} not in {directory} (have {sorted(steps)})")
    return step


def _diff(a: dict, b: dict, prefix: str = "model") -> str:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = _diff(va, vb, f"{prefix}.{k}")
            if sub:
                out.append(sub)
        elif va != vb:
            out.append(f"{prefix}.{k}: expected {va!r}, checkpoint has {vb!r}")
    return "; ".join(out)


__all__ = ["latest_step", "manager", "restore_config", "restore_model", "save_model"]

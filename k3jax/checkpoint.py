"""Orbax checkpoints of k3jax models (and, from ``train.py``, of the whole training state).

Layout: ``<directory>/<step>/{config, model[, optimizer, data]}`` written by one
``orbax.checkpoint.CheckpointManager``: ``config`` is the run's config as JSON, ``model`` the NNX
state of the model (parameters and router-bias state), ``optimizer`` the optimizer state (step count
included), ``data`` the grain iterator's position. Any of these directories restores into a model
with :func:`restore_model`; the config travels with the weights, so nothing else is needed.

Saves are atomic: orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it when complete, so a
run killed mid-save leaves the previous step as the latest. A checkpoint that fails to read raises
:class:`CheckpointError` naming it; nothing is deleted or overwritten.

Meshes: arrays are saved shard by shard (every process writes its own shards; multi-host runs need a
directory all hosts share) and restored into whatever sharding the target asks for, so a run saved on
one mesh resumes, or is served, on another (``mesh`` is free to change on resume).
"""

from __future__ import annotations

import pathlib
import re

import jax
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.config import Config, TrainConfig, from_dict, runtime_fields, to_dict, without_runtime_fields
from k3jax.model import K3Model, abstract_model
from k3jax.sharding import abstract_with_shardings, state_shardings

TRAIN_ITEMS = ("config", "model", "optimizer", "data")
# Train fields that may change when a run resumes (the runtime fields of k3jax.config: how long and how
# it is logged and saved). Everything else but runtime fields (model, optimizer, data, batch, seed, ...)
# must match, or the resumed run would silently differ from the one that was checkpointed.
RESUMABLE_TRAIN_FIELDS = runtime_fields(TrainConfig)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored (corrupt, partial or from an incompatible run)."""


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
        try:
            raw = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the config of checkpoint {directory}/{step} "
                                  f"({_summary(e)})") from e
    return from_dict(raw["config"]), step


def restore_model(directory: str | pathlib.Path, *, step: int | None = None, mesh=None,
                  config: Config | None = None) -> tuple[K3Model, Config]:
    """The model saved at ``step`` (default: the latest) of ``directory`` and its config.

    Pass ``config`` to check the checkpoint against an expected model config: a mismatch of any
    model field raises instead of restoring weights into the wrong architecture.
    """
    saved, step = restore_config(directory, step=step)
    if config is not None and without_runtime_fields(config.model) != without_runtime_fields(saved.model):
        diff = _diff(without_runtime_fields(config.model), without_runtime_fields(saved.model))
        raise ValueError(f"checkpoint {directory} (step {step}) does not match the config: {diff}")
    graphdef, abstract_state = nnx.split(abstract_model(saved.model))
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_state)
    else:  # each array read straight into its rule-derived sharding, whatever mesh saved it
        target = abstract_with_shardings(abstract_state, state_shardings(abstract_state, mesh))
    with manager(directory, async_save=False) as mngr:
        try:
            raw = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
        except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
            raise CheckpointError(f"checkpoint {directory}/{step} is corrupt or incomplete "
                                  f"({_summary(e)})") from e
    return nnx.merge(graphdef, raw["model"]), saved


def save_train_state(mngr: ocp.CheckpointManager, step: int, config: Config, train_state, data_iter) -> None:
    """Save model, optimizer (with its step count) and data-iterator position as ``step``
    (asynchronously if the manager is; call ``mngr.wait_until_finished()`` before exiting)."""
    import grain

    mngr.save(step, args=ocp.args.Composite(
        config=ocp.args.JsonSave(to_dict(config)), model=ocp.args.StandardSave(nnx.state(train_state.model)),
        optimizer=ocp.args.StandardSave(nnx.state(train_state.optimizer)),
        data=grain.checkpoint.CheckpointSave(data_iter)), force=True)


def restore_train_state(mngr: ocp.CheckpointManager, config: Config, train_state, data_iter) -> int | None:
    """Restore the latest checkpoint of ``mngr`` into ``train_state`` (in place) and ``data_iter``;
    returns its step, or None when there is none.

    Raises :class:`CheckpointError` if the checkpoint was written by a run whose config differs in
    anything but its runtime fields (:data:`RESUMABLE_TRAIN_FIELDS`, ``mesh``, and the model's
    compile / kernel choices: ``k3jax.config.runtime_fields``), or if it cannot be read.
    """
    import grain

    step = mngr.latest_step()
    if step is None:
        return None
    where = f"{mngr.directory}/{step}"
    hint = (f"Nothing was deleted. Delete {where} to resume from the previous checkpoint, or start over "
            f"with --fresh or another run_dir.")
    try:
        saved = from_dict(mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
    except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
        raise CheckpointError(f"cannot read the config of checkpoint {where} ({_summary(e)}). {hint}") from e
    mismatch = _config_mismatch(config, saved)
    if mismatch:
        raise CheckpointError(f"checkpoint {where} was written by a different run: {mismatch}. Resume with the "
                              f"same config, or start over with --fresh or another run_dir.")
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.state(train_state.model)),
            optimizer=ocp.args.StandardRestore(nnx.state(train_state.optimizer)),
            data=grain.checkpoint.CheckpointRestore(data_iter)))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {where} is corrupt or incomplete ({_summary(e)}). {hint}") from e
    nnx.update(train_state.model, restored["model"])
    nnx.update(train_state.optimizer, restored["optimizer"])
    return step


def _config_mismatch(current: Config, saved: Config) -> str:
    return _diff(without_runtime_fields(current), without_runtime_fields(saved), prefix="")


def _summary(error: Exception, limit: int = 240) -> str:
    """The first line of a read error, without the TensorStore specs it appends (kilobytes of JSON per
    array), its middle elided (TensorStore chains "opening X: reading Y: ..." and ends with the precise
    cause): enough to say what failed; the whole error stays the ``__cause__``."""
    text = (str(error).splitlines() or [""])[0]
    text = re.sub(r"\s*\[tensorstore_spec.*$", "", text)
    if len(text) > limit:
        text = f"{text[:limit // 3]} ... {text[-(limit - limit // 3):]}"
    return f"{type(error).__name__}: {text}"


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
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = _diff(va, vb, name)
            if sub:
                out.append(sub)
        elif va != vb:
            out.append(f"{name}: expected {va!r}, checkpoint has {vb!r}")
    return "; ".join(out)


__all__ = ["CheckpointError", "RESUMABLE_TRAIN_FIELDS", "TRAIN_ITEMS", "latest_step", "manager",
           "restore_config", "restore_model", "restore_train_state", "save_model", "save_train_state"]

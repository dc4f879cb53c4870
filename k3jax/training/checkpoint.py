"""Orbax checkpoints of k3jax models (and, from ``train.py``, of the whole training state).

Layout: ``<directory>/<step>/{config, model[, optimizer, data]}`` written by one
``orbax.checkpoint.CheckpointManager``: ``config`` is the run's config as JSON, ``model`` the NNX
state of the model (parameters and router-bias state), ``optimizer`` the optimizer state (step count
included), ``data`` the grain iterator's position. Any of these directories restores into a model
with :func:`restore_model`; the config travels with the weights, so nothing else is needed.

Saves are atomic: on a local disk orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it when
complete; on an object store (``gs://``, which has no renames) it writes ``<step>/`` and marks it complete
with ``commit_success.txt`` last, and a step without it is not listed. Either way a run killed or failing
mid-save leaves the previous step as the latest. A save that fails raises :class:`CheckpointSaveError`
naming the step and the reason; one that fails to read raises :class:`CheckpointError` naming it; nothing
is deleted or overwritten.

Directories are local paths or URLs (``gs://bucket/run/checkpoints``; ``k3jax.runtime.storage``).

Meshes: arrays are saved shard by shard (every process writes its own shards; multi-host runs need a
directory all hosts share) and restored into whatever sharding the target asks for, so a run saved on
one mesh resumes, or is served, on another (``mesh`` is free to change on resume).
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from k3jax.runtime import storage
from k3jax.config import Config, TrainConfig, from_dict, runtime_fields, to_dict, without_runtime_fields
from k3jax.layers.lora import LoRAParam
from k3jax.model import K3Model, abstract_model
from k3jax.sharding import abstract_with_shardings, state_shardings

TRAIN_ITEMS = ("config", "model", "optimizer", "data")
# The checkpoint of a run that reads its starting weights again (:func:`names_base`): ``base`` names them
# (:func:`resolve_base`). A LoRA run's ``model`` holds the adapters only (its frozen weights are the base, read
# again on resume and by :func:`restore_model`); an RL run's KL reference is the base of a full fine-tune.
LORA_TRAIN_ITEMS = TRAIN_ITEMS + ("base",)
# Train fields that may change when a run resumes (the runtime fields of k3jax.config: how long and how
# it is logged and saved). Everything else but runtime fields (model, optimizer, data, batch, seed, ...)
# must match, or the resumed run would silently differ from the one that was checkpointed.
RESUMABLE_TRAIN_FIELDS = runtime_fields(TrainConfig)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored (corrupt, partial or from an incompatible run)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (disk full, permissions, network): the step it was, the
    reason, and that the previous checkpoint is untouched."""


def directory_of(directory):
    """What orbax is given for a checkpoint directory: an absolute local path, or the URL's epath."""
    p = storage.path(directory)
    return p if storage.is_remote(directory) else p.absolute()


def manager(directory: str | pathlib.Path, *, max_to_keep: int | None = None, save_interval_steps: int = 1,
            async_save: bool = True, item_names=("config", "model")) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                           enable_async_checkpointing=async_save, create=True)
    return ocp.CheckpointManager(directory_of(directory), options=options, item_names=item_names)


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


def _restore_target(abstract_state, mesh):
    """ShapeDtypeStructs on one device, or in their rule-derived shardings on ``mesh``."""
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_state)
    # each array read straight into its rule-derived sharding, whatever mesh saved it
    return abstract_with_shardings(abstract_state, state_shardings(abstract_state, mesh))


def restore_model(directory: str | pathlib.Path, *, step: int | None = None, mesh=None,
                  config: Config | None = None) -> tuple[K3Model, Config]:
    """The model saved at ``step`` (default: the latest) of ``directory`` and its config.

    A LoRA run's checkpoint gives its base model (read from where the checkpoint's ``base`` item says)
    with the run's adapters attached (``model.merge_lora()`` folds them in).

    Pass ``config`` to check the checkpoint against an expected model config: a mismatch of any
    model field raises instead of restoring weights into the wrong architecture.
    """
    saved, step = restore_config(directory, step=step)
    if config is not None and without_runtime_fields(config.model) != without_runtime_fields(saved.model):
        diff = _diff(without_runtime_fields(config.model), without_runtime_fields(saved.model))
        raise ValueError(f"checkpoint {directory} (step {step}) does not match the config: {diff}")
    lora = saved.train.lora
    model = abstract_model(saved.model, lora=lora)
    # a LoRA checkpoint's model item holds the adapters only
    graphdef, abstract_state = nnx.split(model, LoRAParam, ...)[:2] if lora.enabled else nnx.split(model)
    args = {"model": ocp.args.StandardRestore(_restore_target(abstract_state, mesh))}
    if lora.enabled:
        args["base"] = ocp.args.JsonRestore()
    with manager(directory, async_save=False, item_names=("config", *args)) as mngr:
        try:
            raw = mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
            raise CheckpointError(f"checkpoint {directory}/{step} is corrupt or incomplete "
                                  f"({_summary(e)})") from e
    if not lora.enabled:
        return nnx.merge(graphdef, raw["model"]), saved
    nnx.update(model, raw["model"])
    load_base(model, raw["base"], mesh)
    return model, saved


def restore_adapters(model: K3Model, path: str | pathlib.Path, *, step: int | None = None, mesh=None) -> None:
    """Attach the LoRA adapters of ``path`` to ``model`` (a model without adapters, in place): a LoRA run's
    checkpoint (its run or checkpoint directory; latest step unless ``step``) or a PEFT adapter directory
    (``k3jax.interop.peft``). The run's model config must be the model's (runtime fields aside)."""
    from k3jax.interop.peft import is_peft_dir, load_peft

    if is_peft_dir(path):
        return load_peft(model, path)
    src = storage.path(path)
    directory = src / "checkpoints" if (src / "checkpoints").is_dir() else src
    saved, step = restore_config(directory, step=step)
    if not saved.train.lora.enabled:
        raise ValueError(f"{directory} (step {step}) is not a LoRA run (train.lora.rank is 0) nor a PEFT adapter "
                         f"directory")
    if without_runtime_fields(model.cfg) != without_runtime_fields(saved.model):
        diff = _diff(without_runtime_fields(model.cfg), without_runtime_fields(saved.model))
        raise ValueError(f"the LoRA run {directory} adapts another model: {diff}")
    model.add_lora(saved.train.lora, nnx.Rngs(0))
    target = _restore_target(nnx.state(model, LoRAParam), mesh)
    with manager(directory, async_save=False) as mngr:
        try:
            raw = mngr.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {directory}/{step} is corrupt or incomplete ({_summary(e)})") from e
    nnx.update(model, raw["model"])


def resolve_base(source: str | None, seed: int) -> dict:
    """Where a run's starting weights come from, pinned (what the checkpoints of a run that :func:`names_base`
    record as ``base``: a LoRA run's frozen weights, a full fine-tune's KL reference):
    ``{"kind": "orbax", "path", "step"}`` (a run or checkpoint directory's latest step),
    ``{"kind": "hf", "path"}`` (a Hugging Face directory) or, without a source, ``{"kind": "seed",
    "seed"}`` (the run's own random initialisation)."""
    if source is None:
        return {"kind": "seed", "seed": seed}
    src = storage.path(source)
    if not src.exists():
        raise FileNotFoundError(f"train.init_from={source} does not exist")
    if (src / "config.json").is_file() and any(src.glob("*.safetensors")):
        return {"kind": "hf", "path": str(directory_of(src))}
    ckpt = src / "checkpoints" if (src / "checkpoints").is_dir() else src
    step = latest_step(ckpt)
    if step is None:
        raise FileNotFoundError(f"train.init_from={source}: no checkpoint in {ckpt}")
    return {"kind": "orbax", "path": str(directory_of(ckpt)), "step": step}


def load_base(model: K3Model, base: dict, mesh=None) -> None:
    """Copy the weights (and router-bias state) that ``base`` (:func:`resolve_base`) names into
    ``model``'s non-adapter variables, in place (they may be abstract). Same architecture required; the
    quantization switches may differ (QAT fine-tuning). A LoRA checkpoint as the base is merged first."""
    placement = mesh if mesh is not None and mesh.size > 1 else None
    what = base.get("path", f"seed {base.get('seed')}")
    if base["kind"] == "orbax":
        loaded, _ = restore_model(base["path"], step=base["step"], mesh=placement)
        loaded.merge_lora()
    elif base["kind"] == "hf":
        from k3jax.interop import from_hf

        quant = model.cfg.quant.experts
        loaded = from_hf(base["path"], dtype=jnp.dtype(model.cfg.param_dtype), mesh=placement,
                         keep_quantized=quant not in ("none", "mxfp4_qat"))
    elif base["kind"] == "seed":  # the run's random initialisation (training.init_train_state's weights)
        from k3jax.training.step import init_train_state

        loaded = init_train_state(Config(model=model.cfg, train=TrainConfig(seed=base["seed"])), mesh).model
    else:
        raise CheckpointError(f"unknown LoRA base {base!r}")
    want, got = nnx.state(model, nnx.Not(LoRAParam)), nnx.state(loaded)
    layout = lambda s: [(p, x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(s)]  # noqa: E731
    if layout(want) != layout(got):
        raise CheckpointError(f"train.init_from={what}: its model has another architecture than model.*")
    nnx.update(model, got)


def names_base(config: Config) -> bool:
    """Whether ``config``'s run reads its starting weights again, so its checkpoints record where they come
    from (``base``, :func:`resolve_base`): a LoRA run (its frozen weights) and a full fine-tune's RL run
    with a KL term (``train.rl.beta > 0``: its reference, ``k3jax.rl.reference``)."""
    rl = config.train.rl
    return config.train.lora.enabled or (rl.enabled and rl.beta > 0)


def train_items(config: Config) -> tuple[str, ...]:
    """The items of a training checkpoint of ``config``'s run."""
    return LORA_TRAIN_ITEMS if names_base(config) else TRAIN_ITEMS


def _saved_model_state(config: Config, model: K3Model) -> nnx.State:
    """What a training checkpoint holds of the model: everything, or a LoRA run's adapters."""
    return nnx.state(model, LoRAParam) if config.train.lora.enabled else nnx.state(model)


def save_train_state(mngr: ocp.CheckpointManager, step: int, config: Config, train_state, data_iter,
                     base: dict | None = None) -> None:
    """Save model (a LoRA run: its adapters), optimizer (with its step count), data-iterator position and,
    for a run that :func:`names_base`, ``base`` (:func:`resolve_base`) as ``step`` (asynchronously if the
    manager is; call ``mngr.wait_until_finished()`` before exiting)."""
    import grain

    if names_base(config) and base is None:
        raise ValueError("this run's checkpoint names its base (a LoRA run's frozen weights, or an RL run's KL "
                         "reference): pass base=resolve_base(...)")
    items = dict(config=ocp.args.JsonSave(to_dict(config)),
                 model=ocp.args.StandardSave(_saved_model_state(config, train_state.model)),
                 optimizer=ocp.args.StandardSave(nnx.state(train_state.optimizer)),
                 data=grain.checkpoint.CheckpointSave(data_iter))
    if names_base(config):
        items["base"] = ocp.args.JsonSave(base)
    mngr.save(step, args=ocp.args.Composite(**items), force=True)


def restore_base(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The ``base`` checkpoint ``step`` of a run that :func:`names_base` names (:func:`resolve_base`)."""
    try:
        return mngr.restore(step, args=ocp.args.Composite(base=ocp.args.JsonRestore()))["base"]
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read the base (where the run's starting weights come from) of checkpoint "
                              f"{mngr.directory}/{step} ({_summary(e)})") from e


def restore_train_state(mngr: ocp.CheckpointManager, config: Config, train_state, data_iter, *,
                        step: int | None = None) -> int | None:
    """Restore the latest checkpoint of ``mngr`` (or ``step``) into ``train_state`` (in place) and
    ``data_iter`` (None: leave the data position alone, as a rollback past bad batches does); returns its
    step, or None when there is none.

    Raises :class:`CheckpointError` if the checkpoint was written by a run whose config differs in
    anything but its runtime fields (:data:`RESUMABLE_TRAIN_FIELDS`, ``mesh``, and the model's
    compile / kernel choices: ``k3jax.config.runtime_fields``), or if it cannot be read.
    """
    import grain

    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    where = f"{mngr.directory}/{step}"
    hint = (f"Nothing was deleted. Delete {where} to resume from the previous checkpoint, or start over "
            f"with --fresh or another run_dir.")
    try:
        saved = from_dict(mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"])
    except Exception as e:  # noqa: BLE001 - any read failure means the same thing to the user
        raise CheckpointError(f"cannot read the config of checkpoint {where} ({_summary(e)}). {hint}") from e
    mismatch = config_mismatch(config, saved)
    if mismatch:
        raise CheckpointError(f"checkpoint {where} was written by a different run: {mismatch}. Resume with the "
                              f"same config, or start over with --fresh or another run_dir.")
    items = dict(model=ocp.args.StandardRestore(_saved_model_state(config, train_state.model)),
                 optimizer=ocp.args.StandardRestore(nnx.state(train_state.optimizer)))
    if data_iter is not None:
        items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {where} is corrupt or incomplete ({_summary(e)}). {hint}") from e
    nnx.update(train_state.model, restored["model"])
    nnx.update(train_state.optimizer, restored["optimizer"])
    return step


def config_mismatch(current: Config, saved: Config) -> str:
    """The fields (dotted paths, with both values) in which ``current`` differs from the config a checkpoint
    was saved with, runtime fields aside (a run may resume with others); ``""`` when a resume may proceed."""
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


class Saver:
    """Saves of the training state through one checkpoint manager; a failed save (raised by orbax when
    it is made, or, asynchronous, when the next one starts or the run waits for it) becomes a
    :class:`CheckpointSaveError` naming the step and the reason."""

    def __init__(self, mngr, cfg: Config, graphdef, data_iter, base):
        self.mngr, self.cfg, self.graphdef, self.data_iter, self.base = mngr, cfg, graphdef, data_iter, base
        self.pending: int | None = None  # the step of the save that may still be in flight

    def save(self, step: int, state) -> None:
        try:
            save_train_state(self.mngr, step, self.cfg, nnx.merge(self.graphdef, state), self.data_iter,
                                        base=self.base)
        except Exception as e:  # noqa: BLE001 - any write failure stops the run the same way
            raise self._failed(self.pending if self.pending is not None else step, e) from e
        self.pending = step

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(self.pending, e) from e
        self.pending = None

    def _failed(self, step, error: Exception) -> CheckpointSaveError:
        with contextlib.suppress(Exception):
            self.mngr.reload()
        complete = [s for s in self.mngr.all_steps() if s != step]
        kept = (f"the latest complete checkpoint, step {max(complete)}, is intact and the same command resumes "
                f"from it" if complete else "no earlier checkpoint exists")
        return CheckpointSaveError(
            f"saving checkpoint {self.mngr.directory}/{step} failed ({_summary(error)}); {kept}. "
            f"Free space or fix the checkpoint directory's permissions, then run the same command.")


__all__ = ["CheckpointError", "CheckpointSaveError", "LORA_TRAIN_ITEMS", "RESUMABLE_TRAIN_FIELDS", "Saver",
           "TRAIN_ITEMS", "directory_of", "latest_step", "load_base", "manager", "names_base", "resolve_base", "restore_adapters",
           "restore_base", "restore_config", "restore_model", "restore_train_state", "save_model", "save_train_state",
           "train_items"]

"""A trained model and its tokenizer for inference (``infer.py``, the server, ``python -m k3jax.evaluation``): a
checkpoint directory written by ``train.py`` (``<run>/checkpoints``, the latest step unless
``step``), a run directory containing one, or a Hugging Face model directory (a ``to_hf`` /
``k3jax.convert`` export; MXFP4-packed experts stay packed). Any of them may be a URL
(``gs://bucket/run``; ``k3jax/runtime/storage.py``): orbax reads checkpoints from the bucket, a Hugging Face
directory is downloaded once into the local cache.

Weights load in the dtype the checkpoint stores (``dtype="auto"``): a HF directory's
``checkpoint_dtype`` (bfloat16 for the releases), its compressed routed experts (MXFP4, INT4, block
FP8) kept compressed and dequantized in the forward pass; a ``train.py`` checkpoint in its
``param_dtype``. ``float32`` / ``bfloat16`` load in that dtype instead (parameters and compute; the
leaves k3jax keeps in float32, such as the routers, stay float32)."""

from __future__ import annotations

import collections
import dataclasses
import pathlib

import jax
from flax import nnx

from k3jax.training import checkpoint
from k3jax.config import Config
from k3jax.interop.model_dir import checkpoint_dir, is_hf_dir
from k3jax.model import abstract_model
from k3jax.tokenizer import load_tokenizer


DTYPES = ("auto", "float32", "bfloat16")


def load_model(path: str | pathlib.Path, *, step: int | None = None, config: Config | None = None, mesh=None,
               lora: str | pathlib.Path | None = None, dtype: str = "auto"):
    """(model, config) of a checkpoint, run or HF directory laid out on ``mesh`` (None: one device).
    ``config``: refuse a checkpoint whose model differs. ``lora``: adapters to add (a LoRA run or a PEFT
    directory, ``checkpoint.restore_adapters``); those and a LoRA run's own are merged into the weights.
    ``dtype``: one of ``DTYPES`` (module docstring). Raises ``checkpoint.CheckpointError``,
    ``FileNotFoundError`` or ``ValueError`` naming the path."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    ckpt = checkpoint_dir(path)
    if not is_hf_dir(ckpt):
        model, cfg = checkpoint.restore_model(ckpt, step=step, config=config, mesh=mesh)
        if dtype != "auto" and dtype != cfg.model.param_dtype:
            model, cfg = _cast(model, cfg, dtype)
    else:
        from k3jax.interop import from_hf, load_hf_config
        from k3jax.interop.hf_load import checkpoint_dtype, compressed_experts

        _, info = load_hf_config(ckpt)
        model = from_hf(ckpt, dtype=checkpoint_dtype(ckpt) if dtype == "auto" else dtype,
                        keep_quantized=compressed_experts(info), mesh=mesh)
        cfg = Config.of_model(model.cfg, ckpt.name)
    if lora is not None:
        checkpoint.restore_adapters(model, lora, mesh=mesh)
    model.merge_lora()  # decoding reads the merged weights: no low-rank matmuls per step
    return model, cfg


def _cast(model, cfg: Config, dtype: str):
    """``model`` rebuilt with parameter and compute dtype ``dtype``: each leaf cast to the dtype the model
    of that config gives it (its float32-only leaves stay float32), sharding kept."""
    target = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype, param_dtype=dtype))
    graphdef, want = nnx.split(abstract_model(target.model, lora=cfg.train.lora))
    state = jax.tree.map(lambda have, spec: have.astype(spec.dtype), nnx.state(model), want)
    return nnx.merge(graphdef, state), target


def weight_bytes(model) -> dict:
    """``{device: bytes}`` of the model's weights held on each of this process's devices."""
    held: collections.Counter = collections.Counter()
    for leaf in jax.tree.leaves(nnx.state(model)):
        for shard in getattr(leaf, "addressable_shards", ()):
            held[shard.device] += shard.data.nbytes
    return dict(held)


def _size(n: int) -> str:
    """Bytes as GiB from 1 GiB up, else MiB (three decimals)."""
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"


def weight_bytes_line(model) -> str:
    """One line for the start of ``infer.py``: the weights' bytes per device (the most loaded device of
    this process, and the least when they differ) and the parameter dtype."""
    held = weight_bytes(model)
    most, least = max(held.values()), min(held.values())
    spread = "" if most == least else f" (least loaded: {_size(least)})"
    experts = model.cfg.quant.experts
    return (f"weights: {_size(most)} per device{spread} on {len(held)} device(s) of process "
            f"{jax.process_index()}; parameters {model.cfg.param_dtype}"
            + ("" if experts == "none" else f", routed experts {experts}"))


def load_checkpoint_tokenizer(path: str | pathlib.Path, cfg: Config):
    """The tokenizer that goes with a checkpoint: a HF directory's own files, else the run's
    ``train.data.tokenizer``."""
    ckpt = checkpoint_dir(path)
    if is_hf_dir(ckpt):
        return load_tokenizer(str(ckpt), source=f"{ckpt} (or name a tokenizer)")
    return load_tokenizer(cfg.train.data.tokenizer, source=f"train.data.tokenizer of {ckpt}")

"""A trained model and its tokenizer for inference (``infer.py``, the server, ``k3jax.eval``): a
checkpoint directory written by ``train.py`` (``<run>/checkpoints``, the latest step unless
``step``), a run directory containing one, or a Hugging Face model directory (a ``to_hf`` /
``k3jax.convert`` export; MXFP4-packed experts stay packed). Any of them may be a URL
(``gs://bucket/run``; ``k3jax/storage.py``): orbax reads checkpoints from the bucket, a Hugging Face
directory is downloaded once into the local cache."""

from __future__ import annotations

import pathlib

from k3jax import checkpoint, storage
from k3jax.config import Config
from k3jax.data.tokenizers import load_tokenizer


def checkpoint_dir(path: str | pathlib.Path):
    """The checkpoint directory of ``path`` (a run directory's ``checkpoints/``, else ``path``): a
    ``pathlib.Path``, or an ``etils.epath.Path`` for a URL."""
    p = storage.path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {p} does not exist")
    return p / "checkpoints" if (p / "checkpoints").is_dir() else p


def is_hf_dir(path) -> bool:
    """A Hugging Face model directory: config.json and safetensors weights."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_model(path: str | pathlib.Path, *, step: int | None = None, config: Config | None = None, mesh=None,
               lora: str | pathlib.Path | None = None):
    """(model, config) of a checkpoint, run or HF directory laid out on ``mesh`` (None: one device).
    ``config``: refuse a checkpoint whose model differs. ``lora``: adapters to add (a LoRA run or a PEFT
    directory, ``checkpoint.restore_adapters``); those and a LoRA run's own are merged into the weights.
    Raises ``checkpoint.CheckpointError``, ``FileNotFoundError`` or ``ValueError`` naming the path."""
    ckpt = checkpoint_dir(path)
    if not is_hf_dir(ckpt):
        model, cfg = checkpoint.restore_model(ckpt, step=step, config=config, mesh=mesh)
    else:
        from k3jax.interop import from_hf, load_hf_config

        _, info = load_hf_config(ckpt)
        model = from_hf(ckpt, keep_mxfp4=info.mxfp4, mesh=mesh)
        cfg = Config(name=ckpt.name, model=model.cfg)
    if lora is not None:
        checkpoint.restore_adapters(model, lora, mesh=mesh)
    model.merge_lora()  # decoding reads the merged weights: no low-rank matmuls per step
    return model, cfg


def load_checkpoint_tokenizer(path: str | pathlib.Path, cfg: Config):
    """The tokenizer that goes with a checkpoint: a HF directory's own files, else the run's
    ``train.data.tokenizer``."""
    ckpt = checkpoint_dir(path)
    if is_hf_dir(ckpt):
        return load_tokenizer(str(ckpt), source=f"{ckpt} (or name a tokenizer)")
    return load_tokenizer(cfg.train.data.tokenizer, source=f"train.data.tokenizer of {ckpt}")

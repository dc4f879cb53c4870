"""Model directories, whichever kind: a Hugging Face model directory (``config.json`` and safetensors) or a
k3jax run or checkpoint directory (``train.py``'s ``<run>/checkpoints/<step>/``). Where a directory's
checkpoint is (:func:`checkpoint_dir`, :func:`is_hf_dir`: ``infer.py --checkpoint`` and the server load
through them) and the run config it starts (:func:`directory_config`: ``train.py --config DIR``).

``python train.py --config DIR`` fine-tunes DIR without a config written for it:

- ``model``: DIR's own: a HF ``config.json`` of a supported family (K3, Kimi K2 / DeepSeek-V3 layout, Kimi
  Linear) read by k3jax's HF config reader (``k3jax.interop.hf_config``), parameters and compute in
  float32; a k3jax directory's saved model config (its latest checkpoint's);
- ``train.init_from``: DIR (the weights the run starts from);
- ``train.data.tokenizer``: DIR's tokenizer (a HF directory's ``tokenizer.json`` / ``tiktoken.model``;
  the k3jax run's ``train.data.tokenizer``), else the default (``byte``);
- ``name``: DIR's name (a ``checkpoints/`` directory: its run's); ``train.out_dir``: ``runs/<name>-finetune``
  (never DIR itself, which as a run directory would be resumed instead of fine-tuned);
- everything else: the defaults, not the k3jax run's (its schedule, data and LoRA were for another job),
  with ``train.seq_len`` cut to the model's context (``Config.of_model``).

``key=value`` overrides apply on top, as to a named config.
"""

from __future__ import annotations

import pathlib

from k3jax.config import Config, ConfigError, to_dict
from k3jax.interop import HFConfigError, load_hf_config
from k3jax.runtime import storage
from k3jax.training import checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")  # what k3jax.tokenizer.load_tokenizer reads in a directory


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


def directory_config(path: str | pathlib.Path) -> dict:
    """The config (as a dict, for overrides on top) of a run that fine-tunes the model directory ``path``
    (module docstring). Raises :class:`~k3jax.config.ConfigError` naming what ``path`` should hold."""
    try:
        ckpt = checkpoint_dir(path)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if is_hf_dir(ckpt):
        model = _hf_model(ckpt)
        tokenizer = str(ckpt) if any((ckpt / f).is_file() for f in TOKENIZER_FILES) else None
    elif (ckpt / "config.json").is_file():
        raise ConfigError(f"{ckpt} has a config.json but no *.safetensors weights to fine-tune")
    else:
        saved = _saved_config(ckpt)
        model, tokenizer = saved.model, saved.train.data.tokenizer
    name = ckpt.parent.name if ckpt.name == "checkpoints" else ckpt.name
    data = to_dict(Config.of_model(model, name))
    data["train"]["init_from"] = str(path)
    data["train"]["out_dir"] = f"runs/{name}-finetune"
    if tokenizer is not None:
        data["train"]["data"]["tokenizer"] = tokenizer
    return data


def _hf_model(ckpt):
    try:
        return load_hf_config(ckpt)[0]
    except HFConfigError as e:
        raise ConfigError(f"{ckpt}/config.json: {e}") from None


def _saved_config(ckpt) -> Config:
    """The config of the latest checkpoint of a k3jax checkpoint directory."""
    try:
        return checkpoint.restore_config(ckpt)[0]
    except FileNotFoundError:  # no step in it: not a checkpoint directory
        raise ConfigError(f"{ckpt} is not a model directory: expected a Hugging Face model directory "
                          f"(config.json and *.safetensors weights) or a k3jax run or checkpoint directory "
                          f"(checkpoints/<step>/ as train.py writes)") from None
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None

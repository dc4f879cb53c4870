"""Interoperability with Hugging Face checkpoints: config mapping, weight map, MXFP4 codec.

``from k3jax.interop import from_hf, to_hf``. Modules: ``hf_config`` / ``hf_config_export`` (config.json
read / written), ``hf_names`` (tensor names and orientations), ``hf_load`` / ``hf_export`` (the checkpoint
directory), ``placement`` (device arrays), ``mxfp4``, ``compressed_tensors`` (INT4 pack-quantized) and
``safetensors_io`` (file formats).
"""

from k3jax.interop.hf_config import HFConfigError, config_from_hf
from k3jax.interop.hf_config_export import config_to_hf
from k3jax.interop.hf_export import to_hf
from k3jax.interop.hf_load import from_hf, load_hf_config

__all__ = ["HFConfigError", "config_from_hf", "config_to_hf", "from_hf", "load_hf_config", "to_hf"]

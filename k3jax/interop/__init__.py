"""Interoperability with Hugging Face checkpoints: config mapping, weight map, MXFP4 codec.

``from k3jax.interop import from_hf, to_hf``; see ``hf_weights`` for the details.
"""

from k3jax.interop.hf_config import HFConfigError, config_from_hf, config_to_hf
from k3jax.interop.hf_weights import from_hf, load_hf_config, to_hf

__all__ = ["HFConfigError", "config_from_hf", "config_to_hf", "from_hf", "load_hf_config", "to_hf"]

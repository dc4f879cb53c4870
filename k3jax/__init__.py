"""k3jax: the Kimi K3 architecture (and Kimi K2, Kimi Linear) in JAX / Flax NNX."""

from k3jax.config import Config, ModelConfig, load_config
from k3jax.generate import generate
from k3jax.model import K3Model, abstract_model, create_model

__all__ = ["Config", "K3Model", "ModelConfig", "abstract_model", "create_model", "generate", "load_config"]

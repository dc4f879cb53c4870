"""k3jax: the Kimi K3 architecture (and Kimi K2, Kimi Linear) in JAX / Flax NNX."""

from k3jax.config import Config, ModelConfig, load_config
from k3jax.generate import generate
from k3jax.model import K3Model, abstract_model, create_model

__all__ = ["Config", "K3Model", "ModelConfig", "abstract_model", "create_model", "from_hf", "generate",
           "load_config", "to_hf"]


def __getattr__(name):
    # HF interop pulls in safetensors / tokenizer code: import it only when asked for.
    if name in ("from_hf", "to_hf"):
        from k3jax import interop

        return getattr(interop, name)
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")

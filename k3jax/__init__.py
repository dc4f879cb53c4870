"""k3jax: the Kimi K3 architecture (and Kimi K2, Kimi Linear) in JAX / Flax NNX."""

from k3jax.runtime import host_memory as _host_memory

# First, before anything imports jax (whose import starts threads): with K3JAX_HOST_MEMORY=keep, glibc
# keeps freed memory for reuse, so XLA:CPU's per-call temporaries are not page-faulted in afresh on every
# call (k3jax/runtime/host_memory.py).
_host_memory.apply_default()

from k3jax.config import Config, ModelConfig, load_config  # noqa: E402
from k3jax.inference.generate import generate  # noqa: E402
from k3jax.model import K3Model, abstract_model, create_model  # noqa: E402

__all__ = ["Config", "K3Model", "ModelConfig", "abstract_model", "create_model", "from_hf", "generate",
           "load_config", "to_hf"]


def __getattr__(name):
    # HF interop pulls in safetensors / tokenizer code: import it only when asked for.
    if name in ("from_hf", "to_hf"):
        from k3jax import interop

        return getattr(interop, name)
    raise AttributeError(f"module 'k3jax' has no attribute {name!r}")

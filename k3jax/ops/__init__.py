"""Pure-function building blocks (no parameters)."""

from k3jax.ops.conv import causal_conv1d
from k3jax.ops.kda import chunk_kda, kda_gate_lower_bound, kda_gate_softplus, kda_step, recurrent_kda

__all__ = [
    "causal_conv1d",
    "chunk_kda",
    "kda_gate_lower_bound",
    "kda_gate_softplus",
    "kda_step",
    "recurrent_kda",
]

"""Gated FFN activations: SiTU-GLU (K3) and SwiGLU (K2, Kimi Linear).

Both take the two branch pre-activations ``gate = x @ W_gate`` and ``up = x @ W_up`` and return the
input of the down projection, computed in float32 (SiTU's soft caps bound every element by
``beta * linear_beta``, which is what keeps MXFP8 activations outlier-free).
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.saved_names import GLU_INPUTS


def softcap(z: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(z / cap)``: identity near 0, bounded by ``cap``."""
    return cap * jnp.tanh(z / cap)


def situ(g: jax.Array, beta: float) -> jax.Array:
    """Sigmoid-Tanh Unit ``softcap(g, beta) * sigmoid(g)``."""
    return softcap(g, beta) * jax.nn.sigmoid(g)


def situ_glu(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """``SiTU(gate) * softcap(up, linear_beta)`` in float32, cast back to ``gate.dtype``."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (situ(g, beta) * softcap(u, linear_beta)).astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up`` in float32, cast back to ``gate.dtype``."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    return (jax.nn.silu(g) * u).astype(gate.dtype)


def glu(gate: jax.Array, up: jax.Array, kind: str, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """Dispatch on the config's ``activation`` switch. ``gate`` and ``up`` are named ``GLU_INPUTS``
    (kept by ``model.remat = selective``)."""
    gate, up = checkpoint_name(gate, GLU_INPUTS), checkpoint_name(up, GLU_INPUTS)
    if kind == "situ_glu":
        return situ_glu(gate, up, beta, linear_beta)
    if kind == "swiglu":
        return swiglu(gate, up)
    raise ValueError(f"unknown activation {kind!r}")

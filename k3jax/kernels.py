"""Which implementation runs the two hot ops: ``model.kda_impl`` and ``model.moe_impl``.

``xla`` / ``ragged_dot`` are the pure-JAX ops of ``k3jax.ops`` (the references); ``pallas`` are the
kernels of ``pallas_kernels/``, which take the same arguments and return the same results (Mosaic on
TPU, Triton on GPU, the Pallas interpreter elsewhere: slow, for tests). Imported lazily, so a model
that never asks for Pallas never imports it.
"""

from __future__ import annotations

from typing import Callable


def chunk_kda(impl: str) -> Callable:
    """``chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, chunk_size,
    segment_ids) -> (o, final_state)`` of the chosen implementation."""
    if impl == "xla":
        from k3jax.ops.kda import chunk_kda as fn
    elif impl == "pallas":
        from pallas_kernels.kda import chunk_kda as fn
    else:
        raise ValueError(f"model.kda_impl must be 'xla' or 'pallas', got {impl!r}")
    return fn


def grouped_glu_experts(impl: str) -> Callable:
    """``grouped_glu_experts(x, experts, w_gate, w_up, w_down, *, activation, beta, linear_beta)
    -> [N, k, D]`` of the chosen implementation."""
    if impl == "ragged_dot":
        from k3jax.ops.moe import grouped_glu_experts as fn
    elif impl == "pallas":
        from pallas_kernels.moe import grouped_glu_experts as fn
    else:
        raise ValueError(f"model.moe_impl must be 'ragged_dot' or 'pallas', got {impl!r}")
    return fn


__all__ = ["chunk_kda", "grouped_glu_experts"]

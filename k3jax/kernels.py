"""Which implementation runs the two hot ops: ``model.kda_impl`` and ``model.moe_impl``.

``xla`` / ``ragged_dot`` are the pure-JAX ops of ``k3jax.ops`` (the references); ``pallas`` are the
kernels of ``pallas_kernels/``; ``auto`` (the MoE default) is the Pallas grouped matmul when the program is
lowered for TPU (XLA:TPU runs ``ragged_dot`` forward as a kernel but lowers its weight gradient densely,
every expert over every row) and ``ragged_dot`` elsewhere (GPU: the Triton kernels have not run on a GPU yet), which take the same arguments and return the same results (Mosaic on
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


def resolve_moe_impl(impl: str, platform: str) -> str:
    """``model.moe_impl`` for a program lowered for ``platform``: ``auto`` -> ``pallas`` on TPU, else
    ``ragged_dot``."""
    if impl == "auto":
        return "pallas" if platform == "tpu" else "ragged_dot"
    return impl


def ragged_glu(impl: str) -> Callable:
    """``ragged_glu(xs, group_sizes, w_gate, w_up, w_down, *, activation, beta, linear_beta) -> [M, D]``
    (rows already grouped by expert) of the chosen implementation."""
    if impl == "ragged_dot":
        from k3jax.ops.moe import ragged_glu as fn
    elif impl == "pallas":
        from pallas_kernels.moe import ragged_glu as fn
    else:
        raise ValueError(f"model.moe_impl must be 'ragged_dot' or 'pallas', got {impl!r}")
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


__all__ = ["chunk_kda", "grouped_glu_experts", "ragged_glu", "resolve_moe_impl"]

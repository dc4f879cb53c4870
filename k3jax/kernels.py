"""Which implementation runs the two hot ops: ``model.kda_impl`` and ``model.moe_impl``.

``xla`` / ``ragged_dot`` are the pure-JAX ops of ``k3jax.ops`` (the references); ``pallas`` are the
kernels of ``pallas_kernels/`` (Mosaic on TPU, Triton on GPU, the Pallas interpreter elsewhere: slow, for
tests), which take the same arguments and return the same results. ``auto`` picks per platform the one
the measurements favour (docs/kernels.md):

- chunk KDA: ``xla`` everywhere for now. No TPU has run the Mosaic kernel; on GPU the fused Triton kernel
  measured 2-3.4x slower than XLA on an H200, and its chunk-parallel successor has not been timed on a GPU
  yet (``bench/gpu.py``).
- MoE: the Pallas grouped matmul when the program is lowered for TPU (XLA:TPU runs ``ragged_dot`` forward
  as a kernel but lowers its weight gradient densely, every expert over every row), ``ragged_dot``
  elsewhere (GPU: the Triton kernels are 5-7x faster, but their values have not been checked on a GPU).

Imported lazily, so a model that never asks for Pallas never imports it.
"""

from __future__ import annotations

from typing import Callable

from pallas_kernels.platform import platform_kind, target_platform


# What ``auto`` picks per platform (docs/kernels.md has the measurements behind each entry); any other
# platform gets the references.
AUTO_KDA = {"tpu": "xla", "gpu": "xla"}
AUTO_MOE = {"tpu": "pallas", "gpu": "ragged_dot"}


def resolve_kda_impl(impl: str, platform: str) -> str:
    """``model.kda_impl`` for a program lowered for ``platform``: ``auto`` -> ``AUTO_KDA`` (``xla`` off it)."""
    if impl == "auto":
        return AUTO_KDA.get(platform_kind(platform), "xla")
    return impl


def chunk_kda(impl: str) -> Callable:
    """``chunk_kda(q, k, v, g, beta, *, scale, initial_state, output_final_state, chunk_size,
    segment_ids) -> (o, final_state)`` of the chosen implementation (``auto``: resolved for the platform
    the program is traced for, at call time)."""
    if impl == "auto":
        return _auto_chunk_kda
    if impl == "xla":
        from k3jax.ops.kda import chunk_kda as fn
    elif impl == "pallas":
        from pallas_kernels.kda import chunk_kda as fn
    else:
        raise ValueError(f"model.kda_impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    return fn


def _auto_chunk_kda(*args, **kwargs):
    return chunk_kda(resolve_kda_impl("auto", target_platform()))(*args, **kwargs)


def resolve_moe_impl(impl: str, platform: str) -> str:
    """``model.moe_impl`` for a program lowered for ``platform``: ``auto`` -> ``AUTO_MOE`` (``pallas`` on
    TPU, else ``ragged_dot``)."""
    if impl == "auto":
        return AUTO_MOE.get(platform_kind(platform), "ragged_dot")
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


def packed_mxfp4(impl: str, platform: str) -> bool:
    """Whether MXFP4 routed experts reach the expert matmuls packed (``pallas_kernels.mxfp4.MXFP4``), each
    tile decoded in VMEM by the Pallas TPU kernel (``pallas_kernels/moe/gmm_mxfp4.py``; interpreted on a
    CPU host), rather than dequantized whole before them: for the resolved ``impl`` ``pallas`` off GPU
    (the Triton kernels take dense weights). Dequantized first, XLA:TPU streams every local expert through
    HBM as int32 intermediates each step, ~32 bytes per parameter against the 4.25 bits it is stored in."""
    return impl == "pallas" and platform_kind(platform) != "gpu"


__all__ = ["chunk_kda", "grouped_glu_experts", "packed_mxfp4", "ragged_glu", "resolve_kda_impl", "resolve_moe_impl"]

"""Latent-MoE expert compute with the Pallas grouped matmul; see ``gmm.py`` (and ``gmm_mxfp4.py`` for
weights held as MXFP4)."""

from k3jax.ops.activations import glu
from k3jax.ops.moe import grouped_by_expert, weighted_glu_output
from pallas_kernels.moe.gmm import DEFAULT_TILING, gmm, group_metadata, grouped_matmul, tgmm
from pallas_kernels.moe.gmm_mxfp4 import gmm_mxfp4, mxfp4_grouped_matmul
from pallas_kernels.mxfp4 import MXFP4


def grouped_glu_experts(x, experts, w_gate, w_up, w_down, *, activation, beta=4.0, linear_beta=25.0,
                        act_quant=None, tiling=None, interpret=None, backend=None):
    """Drop-in for ``k3jax.ops.moe.grouped_glu_experts`` with the three matmuls in Pallas.

    x ``[N, D]``, experts ``[N, k]`` int, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]`` (each an array or
    a ``pallas_kernels.mxfp4.MXFP4``: see ``ragged_glu``). Returns the
    per-pair outputs ``[N, k, D]`` (unweighted) in x's dtype. The sort by expert is the reference's
    (``k3jax.ops.moe.grouped_by_expert``); the GLU runs in XLA between the kernels (fp32, as
    ``k3jax.ops.activations.glu``).
    tiling: ``(tm, tk, tn)`` or None (the backend's default); backend ``"tpu"`` (Mosaic), ``"gpu"``
    (Triton, ``gmm_gpu.py``) or None (the target platform's).
    """
    rows_fn = lambda xs, group_sizes: ragged_glu(xs, group_sizes, w_gate, w_up, w_down, activation=activation,
                                                 beta=beta, linear_beta=linear_beta, act_quant=act_quant,
                                                 tiling=tiling, interpret=interpret, backend=backend)
    return grouped_by_expert(x, experts, w_gate.shape[0], rows_fn)


def ragged_glu(xs, group_sizes, w_gate, w_up, w_down, *, activation, beta=4.0, linear_beta=25.0, act_quant=None,
               tiling=None, interpret=None, backend=None, expected_rows=None, row_weights=None):
    """Drop-in for ``k3jax.ops.moe.ragged_glu`` (rows already grouped by expert) with the three
    matmuls in Pallas: xs ``[M, D]``, group_sizes ``[E]`` -> ``[M, D]``; rows past ``sum(group_sizes)``
    are zeros. The weight gradients are ``tgmm`` over the real rows only (the transpose of
    ``ragged_dot`` that XLA:TPU would lower as a dense matmul of every expert over every row).
    ``expected_rows``: the real rows expected in the buffer of M, for the cost estimates (``gmm``).
    ``act_quant`` (e.g. MXFP8 fake quantization) is applied to the input of each matmul stage, xs and
    the GLU output, as in the reference; ``row_weights`` ``[M]`` scale the GLU output's rows, as there.
    A weight given as ``pallas_kernels.mxfp4.MXFP4`` (frozen, TPU kernel) is decoded tile by tile inside
    its matmul (``gmm_mxfp4``) and gets no gradient."""
    quantize = act_quant or (lambda a: a)

    def mm(a, w):
        matmul = mxfp4_grouped_matmul if isinstance(w, MXFP4) else grouped_matmul
        return matmul(a, w, group_sizes, tiling=tiling, interpret=interpret, backend=backend,
                      expected_rows=expected_rows)

    xs = quantize(xs)
    h = glu(mm(xs, w_gate), mm(xs, w_up), activation, beta, linear_beta)
    return mm(weighted_glu_output(quantize(h), row_weights), w_down)


__all__ = ["DEFAULT_TILING", "MXFP4", "gmm", "gmm_mxfp4", "tgmm", "group_metadata", "grouped_matmul",
           "grouped_glu_experts", "mxfp4_grouped_matmul", "ragged_glu"]

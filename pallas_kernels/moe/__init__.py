"""Latent-MoE expert compute with the Pallas grouped matmul; see ``gmm.py``."""

import jax.numpy as jnp

from k3jax.ops.activations import glu
from pallas_kernels.moe.gmm import DEFAULT_TILING, gmm, group_metadata, grouped_matmul, tgmm


def grouped_glu_experts(x, experts, w_gate, w_up, w_down, *, activation, beta=4.0, linear_beta=25.0,
                        tiling=None, interpret=None, backend=None):
    """Drop-in for ``k3jax.ops.moe.grouped_glu_experts`` with the three matmuls in Pallas.

    x ``[N, D]``, experts ``[N, k]`` int, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]``. Returns the
    per-pair outputs ``[N, k, D]`` (unweighted) in x's dtype. Same sort-by-expert permutation as the
    reference; the GLU runs in XLA between the kernels (fp32, as ``k3jax.ops.activations.glu``).
    tiling: ``(tm, tk, tn)`` or None (the backend's default); backend ``"tpu"`` (Mosaic), ``"gpu"``
    (Triton, ``gmm_gpu.py``) or None (the target platform's).
    """
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)
    mm = lambda a, w: grouped_matmul(a, w, group_sizes, tiling=tiling, interpret=interpret, backend=backend)
    h = glu(mm(xs, w_gate), mm(xs, w_up), activation, beta, linear_beta)
    ys = mm(h, w_down)
    inverse = jnp.argsort(order)
    return jnp.take(ys, inverse, axis=0).reshape(n, k, -1)


__all__ = ["DEFAULT_TILING", "gmm", "tgmm", "group_metadata", "grouped_matmul", "grouped_glu_experts"]

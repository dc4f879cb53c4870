"""MoE routing and dropless grouped-expert compute (the reference for the Pallas dispatch kernel).

Tokens are sorted by expert and run through ``jax.lax.ragged_dot``, so on TPU and GPU the FLOPs scale
with top-k, not with the number of experts, and no token is ever dropped. (XLA:CPU has no ragged
matmul: jax lowers it to a dense masked matmul over all groups, so CPU cost grows with E.)
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.activations import glu


class Routing(NamedTuple):
    """Per-token routing decision. N = number of tokens, k = top-k, E = experts."""

    weights: jax.Array  # [N, k] float32 combine weights p_i
    experts: jax.Array  # [N, k] int32 selected expert ids
    scores: jax.Array  # [N, E] float32 raw sigmoid scores s (Quantile Balancing statistics)
    threshold: jax.Array  # [N] float32 (k+1)-th largest biased score alpha (QB), -inf if k == E


def sigmoid_topk_route(logits: jax.Array, bias: jax.Array | None, top_k: int, *, renormalize: bool = True,
                       scaling_factor: float = 1.0) -> Routing:
    """Sigmoid router with a selection-only bias (SPEC §5).

    logits ``[N, E]`` (computed in float32 from the full-width x). Selection uses ``s + bias``; the
    combine weights use the raw scores ``s``, renormalised over the selected experts and scaled.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    num_experts = scores.shape[-1]
    kk = min(top_k + 1, num_experts)
    top_vals, top_idx = jax.lax.top_k(biased, kk)
    experts = top_idx[:, :top_k]
    threshold = top_vals[:, top_k] if kk > top_k else jnp.full(scores.shape[:1], -jnp.inf, jnp.float32)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights * scaling_factor, experts.astype(jnp.int32), scores, threshold)


def grouped_glu_experts(x: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                        *, activation: str, beta: float = 4.0, linear_beta: float = 25.0,
                        act_quant: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """Run every (token, selected expert) pair through its expert; dropless.

    x ``[N, D]``, experts ``[N, k]`` int, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]``.
    Returns the per-pair outputs ``[N, k, D]`` (unweighted) in x's dtype.
    """
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair ids grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = jnp.take(x, order // k, axis=0)  # [N*k, D]
    ys = ragged_glu(xs, group_sizes, w_gate, w_up, w_down, activation=activation, beta=beta,
                    linear_beta=linear_beta, act_quant=act_quant)  # [N*k, D], sorted by expert
    inverse = jnp.argsort(order)  # sorted position of each pair (a permutation's inverse)
    return jnp.take(ys, inverse, axis=0).reshape(n, k, -1)


def ragged_glu(xs: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               *, activation: str, beta: float = 4.0, linear_beta: float = 25.0,
               act_quant: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """The GLU experts over rows already grouped by expert: rows ``[0, group_sizes[0])`` go through
    expert 0, the next ``group_sizes[1]`` through expert 1, ...

    xs ``[M, D]``, group_sizes ``[E]`` int32, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]`` ->
    ``[M, D]`` in xs's dtype. Rows past ``sum(group_sizes)`` belong to no expert (XLA:CPU returns
    zeros there; other backends may not, so callers with such rows mask them). ``act_quant`` (e.g. MXFP8
    fake quantization) is applied to the input of each matmul stage: xs and the GLU output.
    """
    if act_quant is not None:  # quantize both matmul stages' inputs (MXFP8, k3jax/quant); per row
        xs = act_quant(xs)
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    h = glu(gate, up, activation, beta, linear_beta)
    if act_quant is not None:
        h = act_quant(h)
    return jax.lax.ragged_dot(h, w_down, group_sizes)

"""MoE routing and dropless grouped-expert compute (the reference for the Pallas dispatch kernel).

(token, expert) pairs are sorted by expert and each expert runs over its rows only, so the FLOPs
scale with top-k, not with the number of experts, and no pair is ever dropped. How, depends on the
platform the program is lowered for (``jax.lax.platform_dependent``: the compile target, e.g. TPU for
an AOT compile on a CPU host, not the host's backend):

- TPU, GPU: ``jax.lax.ragged_dot`` (a native ragged matmul on TPU).
- CPU: XLA:CPU has no ragged matmul (jax lowers ``ragged_dot`` to a dense masked matmul over all
  groups, E/k times the routed work), so each expert's rows are padded to a multiple of a small tile
  and the tiles run as one batched matmul against their expert's weights (:func:`tiled_glu`).
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from k3jax.ops.activations import glu
from k3jax.ops.saved_names import EXPERT_PAIR_OUTPUTS


class Routing(NamedTuple):
    """Per-token routing decision. N = number of tokens, k = top-k, E = experts."""

    weights: jax.Array  # [N, k] float32 combine weights p_i
    experts: jax.Array  # [N, k] int32 selected expert ids
    scores: jax.Array  # [N, E] float32 raw sigmoid scores s (Quantile Balancing statistics)
    threshold: jax.Array  # [N] float32 (k+1)-th largest biased score alpha (QB), -inf if k == E


def sigmoid_topk_route(logits: jax.Array, bias: jax.Array | None, top_k: int, *, renormalize: bool = True,
                       scaling_factor: float = 1.0, replay: jax.Array | None = None) -> Routing:
    """Sigmoid router with a selection-only bias (K3's Stable LatentMoE router).

    logits ``[N, E]`` (computed in float32 from the full-width x). Selection uses ``s + bias``; the
    combine weights use the raw scores ``s``, renormalised over the selected experts and scaled.

    ``replay`` ``[N, k]`` int (routing replay, R3: arXiv 2510.11370): the experts to use instead of the
    top-k, e.g. the ones a rollout's decode steps chose. The combine weights are still this router's scores
    at those experts, so the router keeps its gradient; the threshold (Quantile Balancing) is unchanged.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    num_experts = scores.shape[-1]
    kk = min(top_k + 1, num_experts)
    top_vals, top_idx = jax.lax.top_k(biased, kk)
    experts = top_idx[:, :top_k] if replay is None else replay.astype(top_idx.dtype)
    threshold = top_vals[:, top_k] if kk > top_k else jnp.full(scores.shape[:1], -jnp.inf, jnp.float32)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights * scaling_factor, experts.astype(jnp.int32), scores, threshold)


def combine_experts(weights: jax.Array, pair_out: jax.Array) -> jax.Array:
    """The weighted routed-expert sum ``u = sum_i p_i E_i(z)`` in float32: weights ``[N, k]``, pair_out
    ``[N, k, L]`` -> ``[N, L]``. pair_out is named ``EXPERT_PAIR_OUTPUTS`` (``model.remat = selective``)."""
    pair_out = checkpoint_name(pair_out, EXPERT_PAIR_OUTPUTS)
    return jnp.einsum("nk,nkl->nl", weights, pair_out.astype(jnp.float32))


def sum_weighted_pairs(pair_out: jax.Array) -> jax.Array:
    """The routed-expert sum ``u [N, L]`` float32 of per-pair outputs ``[N, k, L]`` that are already
    weighted (the expert-parallel paths weight a pair's GLU output: ``weighted_glu_output``)."""
    return jnp.sum(pair_out.astype(jnp.float32), axis=1)


def grouped_by_expert(x: jax.Array, experts: jax.Array, num_experts: int,
                      rows_fn: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The (token, selected expert) pairs sorted by expert, run through ``rows_fn``, and put back.

    x ``[N, D]``, experts ``[N, k]`` int; ``rows_fn(xs [N*k, D], group_sizes [E] int32) -> [N*k, D']``
    over rows grouped by expert (as :func:`ragged_glu`). Returns the per-pair outputs ``[N, k, D']``.
    The one home of the sort, count and inverse permutation for every expert implementation (this
    op's and the Pallas grouped matmul's).
    """
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pair ids grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    # Every index below is in range by construction: mode="clip" gathers without the default "fill"
    # mode's out-of-range select, a pass over every gathered value (and a buffer of their size).
    ys = rows_fn(jnp.take(x, order // k, axis=0, mode="clip"), group_sizes)  # [N*k, D'], sorted by expert
    inverse = jnp.argsort(order)  # sorted position of each pair (a permutation's inverse)
    return jnp.take(ys, inverse, axis=0, mode="clip").reshape(n, k, -1)


def grouped_glu_experts(x: jax.Array, experts: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                        *, activation: str, beta: float = 4.0, linear_beta: float = 25.0,
                        act_quant: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """Run every (token, selected expert) pair through its expert; dropless.

    x ``[N, D]``, experts ``[N, k]`` int, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]``.
    Returns the per-pair outputs ``[N, k, D]`` (unweighted) in x's dtype.
    """
    rows_fn = lambda xs, group_sizes: ragged_glu(xs, group_sizes, w_gate, w_up, w_down, activation=activation,
                                                 beta=beta, linear_beta=linear_beta, act_quant=act_quant)
    return grouped_by_expert(x, experts, w_gate.shape[0], rows_fn)


def ragged_glu(xs: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
               *, activation: str, beta: float = 4.0, linear_beta: float = 25.0,
               act_quant: Callable[[jax.Array], jax.Array] | None = None,
               row_weights: jax.Array | None = None) -> jax.Array:
    """The GLU experts over rows already grouped by expert: rows ``[0, group_sizes[0])`` go through
    expert 0, the next ``group_sizes[1]`` through expert 1, ...

    xs ``[M, D]``, group_sizes ``[E]`` int32, w_gate / w_up ``[E, D, F]``, w_down ``[E, F, D]`` ->
    ``[M, D]`` in xs's dtype. Rows past ``sum(group_sizes)`` belong to no expert (CPU returns zeros
    there; other backends may not, so callers with such rows mask them). ``act_quant`` (e.g. MXFP8
    fake quantization) is applied to the input of each matmul stage: xs and the GLU output.
    ``row_weights`` ``[M]`` (optional): each row's GLU output is scaled by it before the down projection
    (:func:`weighted_glu_output`), so the output is the row's weighted expert output; after ``act_quant``,
    which then sees what it sees unweighted (a block's scale would follow the weight and round otherwise).
    """
    if act_quant is not None:  # quantize both matmul stages' inputs (MXFP8, k3jax/quant); per row
        xs = act_quant(xs)
    kw = dict(activation=activation, beta=beta, linear_beta=linear_beta, act_quant=act_quant)
    if row_weights is None:
        return jax.lax.platform_dependent(xs, group_sizes, w_gate, w_up, w_down,
                                          cpu=functools.partial(tiled_glu, **kw),
                                          default=functools.partial(ragged_dot_glu, **kw))
    return jax.lax.platform_dependent(xs, group_sizes, w_gate, w_up, w_down, row_weights,
                                      cpu=lambda *a: tiled_glu(*a[:5], row_weights=a[5], **kw),
                                      default=lambda *a: ragged_dot_glu(*a[:5], row_weights=a[5], **kw))


def weighted_glu_output(h: jax.Array, row_weights: jax.Array | None) -> jax.Array:
    """The GLU output ``h [..., F]`` scaled by its row's routing weight ``row_weights [...]`` (None: as is),
    in h's dtype. Applied before the down projection (linear, so the row's output is scaled the same),
    the weight's gradient is ``<dh, h>``: the backward needs the GLU output, which it builds anyway,
    and not the down projection's output, which a rematerialised layer then never recomputes."""
    if row_weights is None:
        return h
    return (h.astype(jnp.float32) * row_weights[..., None].astype(jnp.float32)).astype(h.dtype)


def ragged_dot_glu(xs, group_sizes, w_gate, w_up, w_down, *, activation, beta, linear_beta, act_quant,
                    row_weights=None):
    """``ragged_glu`` by ``jax.lax.ragged_dot`` (xs already quantized)."""
    gate = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    up = jax.lax.ragged_dot(xs, w_up, group_sizes)
    h = glu(gate, up, activation, beta, linear_beta)
    if act_quant is not None:
        h = act_quant(h)
    return jax.lax.ragged_dot(weighted_glu_output(h, row_weights), w_down, group_sizes)


# Fetching one tile's expert weights costs about as much as this many rows of its matmuls (XLA:CPU;
# measured at the tiny and small configs' shapes): the tile size trades that against padding.
_TILE_FETCH_ROWS = 8
_TILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def tile_plan(rows: int, num_experts: int) -> tuple[int, int]:
    """``(tile, num_tiles)`` for :func:`tiled_glu` over ``rows`` grouped rows: the tile size minimising
    padded rows + ``_TILE_FETCH_ROWS`` x tiles in the worst case, and that worst case's tile count.

    Each non-empty group wastes less than one tile, and at most ``min(E, rows)`` groups are non-empty,
    so ``(rows + min(E, rows) * (tile - 1)) // tile`` tiles always suffice.
    """
    def tiles(t):
        return (rows + min(num_experts, rows) * (t - 1)) // t

    tile = min(_TILE_SIZES, key=lambda t: (tiles(t) * (t + _TILE_FETCH_ROWS), t))
    return tile, tiles(tile)


def tiled_glu(xs: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              *, activation: str, beta: float = 4.0, linear_beta: float = 25.0,
              act_quant: Callable[[jax.Array], jax.Array] | None = None, tile: int | None = None,
              row_weights: jax.Array | None = None) -> jax.Array:
    """``ragged_glu`` as padded tiles (xs already quantized): FLOPs ~ the routed rows, not rows x E.

    Group e's rows are cut into ``ceil(group_sizes[e] / tile)`` tiles of ``tile`` rows (the last one
    zero-padded); tile i runs ``[tile, D] @ w[expert_i]`` in one batched matmul over all tiles, whose
    count is static (the worst case of :func:`tile_plan`; unused tiles are all padding). Rows past
    ``sum(group_sizes)`` get zeros. Shapes as ``ragged_glu``; ``tile`` None = :func:`tile_plan`'s.
    """
    m = xs.shape[0]
    e = w_gate.shape[0]
    if tile is None:
        tile, num_tiles = tile_plan(m, e)
    else:
        num_tiles = (m + min(e, m) * (tile - 1)) // tile
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)  # no group runs past the rows
    sizes = ends - jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    first_row = jnp.cumsum(sizes) - sizes  # [E] first row of each group
    tiles = (sizes + tile - 1) // tile  # [E] tiles of each group
    tile_end = jnp.cumsum(tiles)
    first_tile = tile_end - tiles  # [E]
    # tile -> (expert, first row); tiles past the last group's are padding (expert = E)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_expert = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)  # [T]
    ex = jnp.minimum(tile_expert, e - 1)
    offset = (t - first_tile[ex]) * tile  # of the tile's first row within its group
    filled = jnp.where(tile_expert < e, jnp.clip(sizes[ex] - offset, 0, tile), 0)  # [T] real rows
    slot = jnp.arange(tile, dtype=jnp.int32)
    real = slot < filled[:, None]  # [T, tile]
    src = jnp.where(real, (first_row[ex] + offset)[:, None] + slot, 0)
    # in-range indices: gathers with mode="clip" (as in grouped_by_expert)
    x = jnp.where(real[..., None], jnp.take(xs, src, axis=0, mode="clip"), jnp.zeros((), xs.dtype))  # [T, tile, D]
    w_g, w_u, w_d = (jnp.take(w, ex, axis=0, mode="clip") for w in (w_gate, w_up, w_down))  # [T, D, F], [T, F, D]
    h = glu(jnp.einsum("tsd,tdf->tsf", x, w_g), jnp.einsum("tsd,tdf->tsf", x, w_u), activation, beta, linear_beta)
    if act_quant is not None:
        h = act_quant(h)
    if row_weights is not None:
        h = weighted_glu_output(h, jnp.where(real, jnp.take(row_weights, src, axis=0, mode="clip"), 0))
    y = jnp.einsum("tsf,tfd->tsd", h, w_d).reshape(num_tiles * tile, w_down.shape[-1])  # [T * tile, D]
    # row -> its padded position
    r = jnp.arange(m, dtype=jnp.int32)
    row_expert = jnp.searchsorted(ends, r, side="right").astype(jnp.int32)  # [M]
    rx = jnp.minimum(row_expert, e - 1)
    owned = row_expert < e
    pos = jnp.where(owned, first_tile[rx] * tile + r - first_row[rx], 0)
    return jnp.where(owned[:, None], jnp.take(y, pos, axis=0, mode="clip"), jnp.zeros((), y.dtype))

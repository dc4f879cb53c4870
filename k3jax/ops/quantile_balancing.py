"""Quantile Balancing (docs/design.md "Stable LatentMoE and Quantile Balancing"): the router bias is
*replaced* after every optimizer step.

With raw sigmoid scores ``s [m, n]`` (m real tokens, n experts, top-k) and the bias ``b`` the forward
pass routed with, ``alpha_i`` is the (k+1)-th largest of ``s_i + b``. The new bias is
``b_j = -quantile_{1-k/n}(s[:, j] - alpha)`` = minus the (q+1)-th largest margin of expert j, with
``q = floor(m k / n)`` (its fair share of tokens), then centred (top-k is invariant to a common
offset). No step size, no EMA, no auxiliary loss.

Statistics are gathered in the forward pass and are *mergeable* (:func:`pool`), so micro-batches of a
gradient accumulation step and data-parallel shards pool into the statistics of the global batch:

- ``exact``: every real token's margins ``[m, n]`` (merge = concatenate). Exact; memory ``m * n``.
- ``histogram``: per-expert counts of the margins in ``num_bins`` equal bins over a range fixed by
  the current bias (merge = add, i.e. one all-reduce of ``[n, num_bins]``). The quantile is
  interpolated inside its bin, so its error is below one bin width ``(2 + span(b)) / num_bins``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExactStats(NamedTuple):
    margins: jax.Array  # [m, n] s_ij - alpha_i; -inf rows for padding tokens
    num_tokens: jax.Array  # [] float32 real tokens
    load: jax.Array  # [n] float32 real tokens routed to each expert (a metric; unused by the rule)


class HistogramStats(NamedTuple):
    counts: jax.Array  # [n, num_bins] float32
    num_tokens: jax.Array  # [] float32
    low: jax.Array  # [] float32 lower edge of bin 0
    high: jax.Array  # [] float32 upper edge of the last bin
    load: jax.Array  # [n] float32 real tokens routed to each expert


def margin_range(bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Bounds of ``s - alpha`` for ``s`` in (0, 1): alpha lies in (min b, 1 + max b)."""
    return -1.0 - jnp.max(bias), 1.0 - jnp.min(bias)


def router_statistics(scores: jax.Array, threshold: jax.Array, bias: jax.Array, token_mask: jax.Array | None,
                      *, method: str = "exact", num_bins: int = 256) -> ExactStats | HistogramStats:
    """Statistics of one forward pass. scores ``[N, n]``, threshold (alpha) ``[N]``, bias ``[n]``,
    token_mask ``[N]`` (True = real token) or None."""
    mask = jnp.ones(scores.shape[:1], bool) if token_mask is None else token_mask
    margins = scores - threshold[:, None]
    num_tokens = jnp.sum(mask).astype(jnp.float32)
    # Same float32 ops as the router's selection (s + b vs alpha), so the count is exact.
    selected = scores + jax.lax.stop_gradient(bias.astype(jnp.float32)) > threshold[:, None]
    load = jnp.sum(selected & mask[:, None], axis=0).astype(jnp.float32)
    if method == "exact":
        return ExactStats(jnp.where(mask[:, None], margins, -jnp.inf), num_tokens, load)
    if method == "histogram":
        low, high = margin_range(bias.astype(jnp.float32))
        width = (high - low) / num_bins
        idx = jnp.clip(jnp.floor((margins - low) / width).astype(jnp.int32), 0, num_bins - 1)  # [N, n]
        # A scatter-add of the real tokens into [n * bins] (not a one-hot [N, n, bins], which at K3's
        # 896 experts x 256 bins is ~1 MB per token): exact, float32 counts stay integers below 2^24.
        flat = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :] * num_bins + idx  # [N, n]
        weight = jnp.broadcast_to(mask[:, None], idx.shape).astype(jnp.float32)
        counts = jax.ops.segment_sum(weight.reshape(-1), flat.reshape(-1), num_segments=scores.shape[1] * num_bins)
        return HistogramStats(counts.reshape(scores.shape[1], num_bins), num_tokens, low, high, load)
    raise ValueError(f"unknown quantile balancing method {method!r}")


def pool(stats: ExactStats | HistogramStats) -> ExactStats | HistogramStats:
    """The statistics of several micro-batches stacked along a leading axis ``A`` (same bias, hence
    the same histogram range) as those of their union: margins ``[A, m, n]`` -> ``[A*m, n]``, counts add."""
    if isinstance(stats, ExactStats):
        return ExactStats(stats.margins.reshape((-1, stats.margins.shape[-1])), jnp.sum(stats.num_tokens, 0),
                          jnp.sum(stats.load, 0))
    return HistogramStats(jnp.sum(stats.counts, 0), jnp.sum(stats.num_tokens, 0), stats.low[0], stats.high[0],
                          jnp.sum(stats.load, 0))


def new_bias(stats: ExactStats | HistogramStats, top_k: int) -> jax.Array:
    """The replacement bias ``[n]`` (centred) from pooled statistics."""
    if isinstance(stats, ExactStats):
        num_experts = stats.margins.shape[-1]
        q = jnp.floor(stats.num_tokens * top_k / num_experts).astype(jnp.int32)
        ranked = -jnp.sort(-stats.margins, axis=-2)  # descending over tokens
        quantile = jnp.take(ranked, jnp.minimum(q, ranked.shape[-2] - 1), axis=-2)
    else:
        counts = stats.counts
        num_experts, num_bins = counts.shape
        q = jnp.floor(stats.num_tokens * top_k / num_experts)
        # Bins from the top: the (q+1)-th largest lies in the first bin where the count of margins
        # at or above its lower edge reaches q + 1; interpolate linearly inside that bin.
        above = jnp.cumsum(counts[:, ::-1], axis=-1)[:, ::-1]  # [n, B] count of margins >= bin low edge
        target = q + 1.0
        bin_idx = jnp.sum(above >= target, axis=-1) - 1  # highest bin whose lower edge has >= q+1 above
        bin_idx = jnp.clip(bin_idx, 0, num_bins - 1)
        above_next = jnp.where(bin_idx + 1 < num_bins,
                               jnp.take_along_axis(jnp.pad(above, ((0, 0), (0, 1))), bin_idx[:, None] + 1, -1)[:, 0],
                               0.0)
        in_bin = jnp.take_along_axis(counts, bin_idx[:, None], -1)[:, 0]
        width = (stats.high - stats.low) / num_bins
        frac = jnp.where(in_bin > 0, (target - above_next) / jnp.maximum(in_bin, 1.0), 0.5)
        quantile = stats.low + (bin_idx + 1.0 - jnp.clip(frac, 0.0, 1.0)) * width
    b = -quantile
    return b - jnp.mean(b)


def load_imbalance(stats: ExactStats | HistogramStats) -> jax.Array:
    """Max over mean expert load (1 = perfectly balanced, ``n / k`` = every token on the same k)."""
    return jnp.max(stats.load, axis=-1) / jnp.maximum(jnp.mean(stats.load, axis=-1), 1e-9)


def update_bias(bias, stats: list, top_k: int) -> None:
    """Replace one router bias Variable in place: ``[n]`` from one layer's statistics, or ``[G, n]``
    (a stacked slot of the scanned groups) from one statistics entry per group, in group order."""
    if bias[...].ndim == 1:
        (st,) = stats
        bias[...] = new_bias(st, top_k).astype(bias[...].dtype)
        return
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
    bias[...] = jax.vmap(new_bias, in_axes=(0, None))(stacked, top_k).astype(bias[...].dtype)


def apply(model, stats: dict, top_k: int) -> None:
    """Replace every router bias of ``model`` (a ``K3Model``) in place from the statistics
    ``model.forward`` returned, ``{layer index: statistics}`` (``ForwardStats.router``)."""
    for layer, layers in model.layer_modules():
        bias = getattr(layer.ffn, "router_bias", None)
        if bias is not None and layers[0] in stats:
            update_bias(bias, [stats[i] for i in layers], top_k)

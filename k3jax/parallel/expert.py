"""Expert parallelism: the routed experts sharded over the ``expert`` mesh axis, tokens exchanged in
the latent width inside ``jax.shard_map``, dropless by default.

The router, the down-projection into the latent width and the Quantile Balancing statistics stay
outside (plain GSPMD: the statistics of a token-sharded batch are global arrays, so the histogram
sum is an all-reduce XLA inserts). :func:`expert_parallel_experts` gets the latent tokens ``z``, the
routing and the expert weights, and returns the weighted expert sum ``u = sum_i p_i E_i(z)`` of
every token, summed across devices before the caller's latent RMSNorm.

Inside the ``shard_map`` the flattened tokens are split over every mesh axis that divides their
count (each device owns distinct tokens), the experts over ``expert`` (each device holds
``E_l = E / ep`` of them). Token exchange over ``expert``, chosen by ``moe.ep_dispatch``:

- ``ragged_all_to_all`` (TPU / GPU): each device sorts its (token, expert) pairs by expert, hence by
  owning device, and sends each device one slice per local expert with
  ``jax.lax.ragged_all_to_all``, written where the receive buffer is grouped by expert (expert 0's
  pairs from every sender, then expert 1's, ...). The experts run straight over the buffer (the
  grouped matmul) and the results go back the same way, in rounds of a fixed size (below), so
  nothing is ever dropped.
- ``all_to_all``: the same exchange, with the ragged collective emulated by a dense
  ``jax.lax.all_to_all`` of per-destination blocks padded to the worst case. It runs everywhere
  (XLA:CPU has no ``ragged-all-to-all``), so CPU tests check the offsets and regrouping the ragged
  path relies on; it moves ``ep`` times the data.
- ``all_gather`` (the CPU default): every device gathers the tokens of its ``expert`` group, runs
  its own experts on the pairs routed to them and the partial sums are reduce-scattered back
  (``psum_scatter``), which is exactly the cross-device sum before the RMSNorm.
- ``auto``: ``ragged_all_to_all`` when the mesh's devices are TPUs or GPUs, else ``all_gather``.

Static shapes force the receive buffers (and the rows each device runs through its experts) to a
size fixed at trace time. Sized for the worst case (every pair of every device landing on one
device: ``ep * min(k, E_l)`` times the fair share ``n * k``, 64x for K2 on ``expert=8``) they
dominated a dropless step's memory and its counted exchange bytes. The ragged exchanges therefore
move the pairs in rounds of ``DROPLESS_ROUND_FACTOR * n * k`` rows, as many rounds as the busiest
device needs (every device reads every device's loads, so all agree): one round while the loads
are within 1.25x of balanced, which Quantile Balancing keeps them; never a dropped pair.
``moe.ep_capacity_factor = c > 0`` runs one round of ``c * n * k`` rows and drops the pairs that do
not fit (capacity, not dropless): a device over its capacity cuts its busiest experts down to a
common level (:func:`fill_capacity`), the least loaded keep all their pairs. The ``all_gather``
exchange still sizes its rows for the worst case when dropless.

When the tokens cannot be split over ``expert`` (fewer tokens than devices, e.g. one decode token),
every device of an ``expert`` group holds the same tokens: each runs its own experts and the partial
sums are ``psum``-ed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax import kernels
from k3jax.ops.moe import combine_experts, sum_weighted_pairs
from k3jax.sharding import (axis_size, current_mesh, expert_mesh_axes, logical_to_spec, spec_axes, spec_entry,
                            token_mesh_axes)
from pallas_kernels.mxfp4 import MXFP4
from pallas_kernels.platform import ACCELERATORS, target_platform

DISPATCH_MODES = ("ragged_all_to_all", "all_to_all", "all_gather")
# A dropless exchange moves pairs in rounds of this many times a device's fair share of rows (its n
# tokens' n * k pairs), as many rounds as the busiest device needs (_dropless_rounds). Quantile Balancing
# keeps the busiest expert near 1.1-1.2x the mean (a device's 48 or more experts closer still), so one
# round is the usual case, and the buffers are 1.25x the fair share instead of the worst case's
# ep * min(k, E_l) times it (64x for K2 on expert=8).
DROPLESS_ROUND_FACTOR = 1.25


def resolve_dispatch(dispatch: str, mesh) -> str:
    """``auto`` -> the backend's exchange (the mesh's platform, which AOT compiles set to TPU)."""
    if dispatch == "auto":
        return "ragged_all_to_all" if target_platform(mesh) in ACCELERATORS else "all_gather"
    if dispatch not in DISPATCH_MODES:
        raise ValueError(f"unknown expert-parallel dispatch {dispatch!r}; expected auto or one of {DISPATCH_MODES}")
    return dispatch


def expert_parallel_experts(z: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                            w_up: jax.Array, w_down: jax.Array, *, activation: str, beta: float = 4.0,
                            linear_beta: float = 25.0, dispatch: str = "auto", capacity_factor: float = 0.0,
                            mesh=None, act_quant=None, impl: str = "auto") -> jax.Array:
    """Weighted routed-expert sum over the current mesh.

    z ``[N, L]`` latent tokens, experts ``[N, k]`` int32, weights ``[N, k]`` float32, w_gate / w_up
    ``[E, L, F]``, w_down ``[E, F, L]`` -> u ``[N, L]`` float32, equal to
    ``einsum('nk,nkl->nl', weights, grouped_glu_experts(z, experts, ...))``. ``act_quant``: see
    ``ragged_glu`` (the expert matmuls' input quantizer, per row). ``capacity_factor``: 0 = dropless
    (buffers for the worst case); c > 0 = each device computes at most ``c * n * k`` pairs for its
    ``n`` tokens' fair share and drops the rest (``moe.ep_capacity_factor``). ``impl``: the expert
    matmuls over the grouped rows (``model.moe_impl``, resolved for the mesh's platform by
    ``k3jax.kernels.resolve_moe_impl``: the Pallas grouped matmul on TPU).
    """
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None:
        raise ValueError("expert_parallel_experts needs a mesh (jax.set_mesh)")
    n = z.shape[0]
    # the layouts come from the rule table (k3jax.sharding): experts as the `expert` rule stores them
    ep_axes = expert_mesh_axes(mesh)
    ep = math.prod(axis_size(mesh, a) for a in ep_axes)
    if w_gate.shape[0] % ep:
        raise ValueError(f"{w_gate.shape[0]} experts do not split over the expert rule's mesh axes {ep_axes} "
                         f"(size {ep})")
    token_axes = token_mesh_axes(mesh, n)
    if not set(ep_axes) <= set(token_axes):
        # Too few tokens to split over every expert axis (a short prefill piece under the serving layout, whose
        # experts span the whole mesh): replicated over the expert group, each of its devices applies its own
        # experts to the group's tokens (_gathered_experts).
        token_axes = tuple(a for a in token_axes if a not in ep_axes)
    tokens = P(spec_entry(token_axes), None)
    axis = spec_entry(ep_axes)  # the exchange's collective axis name(s)
    if w_down.shape[2] != w_gate.shape[1]:
        raise ValueError(f"w_down {w_down.shape} does not map the experts' hidden width back to {w_gate.shape[1]}")
    # The weights enter split as they are stored over the FSDP axes of their `expert_in` dimension (L) and
    # are gathered inside (all_gather), so their gradients leave as reduce-scatters (its transpose).
    # Entering whole, the gradient of w_down [E, F, L] was summed by an all-reduce of the local experts'
    # whole matrix before each device kept its slice (XLA:TPU, L = 7168 over 64 devices).
    layouts = tuple(_weight_layout(w, dim, mesh, axis, token_axes) for w, dim in zip((w_gate, w_up, w_down), (1, 1, 2)))
    impl = kernels.resolve_moe_impl(impl, target_platform(mesh))
    body = functools.partial(_shard_body, activation=activation, beta=beta, linear_beta=linear_beta, impl=impl,
                             dispatch=resolve_dispatch(dispatch, mesh), ep=ep, act_quant=act_quant,
                             capacity_factor=capacity_factor, axis=axis, gathers=tuple(g for _, g in layouts),
                             tokens_split=bool(ep_axes) and set(ep_axes) <= set(token_axes))
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, *(spec for spec, _ in layouts)),
                         out_specs=tokens)(z, experts, weights, w_gate, w_up, w_down)


def _weight_layout(w, dim, mesh, axis, token_axes):
    """How one expert weight enters the ``shard_map``: (PartitionSpecs, the tree of w's arrays; the
    gathers, a tuple of ``(mesh axes, dimension)`` per array). w: a dense ``[E, L, F]`` / ``[E, F, L]`` (L
    at ``dim``) or a ``pallas_kernels.mxfp4.MXFP4``, whose two arrays hold L at the other dimension (the
    release orientation swaps the last two). Experts split over ``axis``; L as stored over its FSDP axes,
    gathered inside, but only over axes the tokens split over: the output is then device-varying there
    anyway; over the others (a decode batch too small to split) the gathered weights would make a
    replicated output varying."""
    dim = 3 - dim if isinstance(w, MXFP4) else dim

    def gathered(a):
        stored = spec_axes(logical_to_spec(("expert", "expert_in"), None, mesh, (a.shape[0], a.shape[dim]))[1])
        return tuple(x for x in stored if x in token_axes)

    def spec(a):
        return P(axis, *(spec_entry(gathered(a)) if d == dim else None for d in (1, 2)))

    return jax.tree.map(spec, w), tuple((gathered(a), dim) for a in jax.tree.leaves(w))


def _gather_weight(w, gathers):
    """The FSDP all-gather of one expert weight's arrays (``_weight_layout``); its transpose, the gradients'
    reduce-scatter."""
    leaves, tree = jax.tree.flatten(w)
    return tree.unflatten([jax.lax.all_gather(a, spec_entry(axes), axis=dim, tiled=True) if axes else a
                           for a, (axes, dim) in zip(leaves, gathers)])


def _shard_body(z, experts, weights, w_gate, w_up, w_down, *, activation, beta, linear_beta, dispatch, ep,
                tokens_split, capacity_factor, impl, axis, gathers, act_quant=None):
    """One device: local tokens z ``[n, L]``, local experts ``[E_l, ...]`` (their ``L`` dimension split
    as ``gathers`` says, ``_weight_layout``) -> u ``[n, L]`` float32."""
    w_gate, w_up, w_down = (_gather_weight(w, g) for w, g in zip((w_gate, w_up, w_down), gathers))
    quant = {} if act_quant is None else {"act_quant": act_quant}
    n, k = experts.shape
    # The kernels' cost estimates count the pairs this device's experts get at a balanced load (each
    # device's n * k), not the buffer's capacity head-room: the grouped matmul visits real rows only.
    hint = {"expected_rows": n * k if tokens_split else -(-n * k // ep)} if impl == "pallas" else {}
    # the expert GLU over rows grouped by expert, the weights given: (xs, group_sizes, w_gate, w_up, w_down)
    glu_of = functools.partial(_glu_with_weights, functools.partial(
        kernels.ragged_glu(impl), activation=activation, beta=beta, linear_beta=linear_beta, **quant, **hint))
    glu = functools.partial(glu_of, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if ep == 1:  # every expert is local: the single-device computation on this device's tokens
        pair_out = kernels.grouped_glu_experts(impl)(z, experts, w_gate, w_up, w_down, activation=activation,
                                                     beta=beta, linear_beta=linear_beta, **quant)
        return combine_experts(weights, pair_out)
    if tokens_split and dispatch in ("ragged_all_to_all", "all_to_all"):
        exchange = jax.lax.ragged_all_to_all if dispatch == "ragged_all_to_all" else dense_ragged_all_to_all
        return _exchange_experts(z, experts, weights, glu_of, (w_gate, w_up, w_down), ep, exchange, capacity_factor,
                                 axis)
    return _gathered_experts(z, experts, weights, glu, w_gate.shape[0], ep, tokens_split, capacity_factor, axis)


def _glu_with_weights(glu, xs, group_sizes, w_gate, w_up, w_down, row_weights=None):
    return glu(xs, group_sizes, w_gate=w_gate, w_up=w_up, w_down=w_down, row_weights=row_weights)


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def capacity_rows(fair_share: int, worst_case: int, capacity_factor: float) -> int:
    """Rows a device reserves for the pairs it computes: the worst case (dropless) when
    ``capacity_factor`` is 0, else ``ceil(capacity_factor * fair_share)`` (at most the worst case)."""
    if capacity_factor <= 0:
        return worst_case
    return max(1, min(worst_case, math.ceil(capacity_factor * fair_share)))


def fill_capacity(loads: jax.Array, capacity) -> jax.Array:
    """Pairs each expert keeps when its device's experts share ``capacity`` rows.

    loads ``[..., E_l]`` int (pairs routed to each local expert) -> kept ``[..., E_l]``: every pair
    when they fit; else water-filling, so that only the busiest experts lose pairs: each expert keeps
    up to a common level (the least loaded keep all of theirs), and the rows left under the next level
    go one each to the first experts (by index) above it. Equals handing out rows one round at a
    time, in each round one to every expert (in index order) that has pairs left.
    """
    e = loads.shape[-1]
    s = jnp.sort(loads, axis=-1)
    prefix = jnp.cumsum(s, axis=-1)
    # total kept with every expert capped at the i-th smallest load
    level_totals = prefix + (e - 1 - jnp.arange(e)) * s
    whole = jnp.sum(level_totals <= capacity, axis=-1, keepdims=True)  # least loaded experts kept whole
    below = jnp.where(whole > 0, jnp.take_along_axis(prefix, jnp.maximum(whole - 1, 0), axis=-1), 0)
    level = (capacity - below) // jnp.maximum(e - whole, 1)  # the others' share, rounded down
    over = loads > level
    kept = jnp.minimum(loads, level)
    extra = capacity - jnp.sum(kept, axis=-1, keepdims=True)  # < the number of experts over the level
    kept = kept + (over & (jnp.cumsum(over, axis=-1) <= extra)).astype(kept.dtype)
    return jnp.where(jnp.sum(loads, axis=-1, keepdims=True) <= capacity, loads, kept)


def _keep_prefix(counts, keep):
    """Truncate runs ``counts [..., R]`` (laid out in order) to their first ``keep [...]`` rows."""
    ends = jnp.minimum(jnp.cumsum(counts, axis=-1), keep[..., None])
    return ends - jnp.concatenate([jnp.zeros_like(ends[..., :1]), ends[..., :-1]], axis=-1)


def _exchange_experts(z, experts, weights, glu, expert_weights, ep, exchange, capacity_factor, axis):
    """Send every (token, expert) pair to the device owning the expert and the result back.

    z ``[n, L]``, experts / weights ``[n, k]`` -> ``[n, L]`` float32. ``glu(xs, group_sizes, *expert_weights)``
    runs the local experts (``expert_weights``: w_gate, w_up, w_down ``[E_l, ...]``) over rows grouped by
    expert. ``exchange`` has the signature and semantics of ``jax.lax.ragged_all_to_all`` over ``axis``
    (the expert mesh axis or axes).

    Each device sends one slice per (destination, local expert), and each slice lands where the
    destination's receive buffer is already grouped by expert: expert 0's pairs from src 0, 1, ...,
    then expert 1's, ... The experts run straight over the buffer and the results go back the same
    way, so no ``[capacity, L]`` buffer is ever permuted (a sort and its inverse, forward and
    backward, were most of a dropless step's memory).

    Dropless (``capacity_factor`` 0), the pairs go in rounds of ``DROPLESS_ROUND_FACTOR`` times the fair
    share of rows (:func:`_dropless_rounds`), as many as the busiest device needs; with a capacity
    factor, one round of that size and the rest dropped.

    Each pair's routing weight travels with it and scales its GLU output before the down projection
    (``ops.moe.weighted_glu_output``): the pairs come back weighted and a token's sum needs no weights.
    The weights' gradient is then ``<dh, h>`` on the experts' side, so the backward pass needs neither
    the down projections' outputs nor the return exchange, and a rematerialised layer recomputes
    neither (weighted after the return, their gradient needed every pair's output back).
    """
    n, k = experts.shape
    num_local = expert_weights[0].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by expert, hence by owning device (experts are contiguous)
    # The gathers of this module have in-range indices by construction: mode="clip" skips the default
    # "fill" mode's out-of-range select, a pass over (and a buffer of) every gathered row.
    sent = jnp.take(z, order // k, axis=0, mode="clip")  # [n*k, L]
    sent_weights = jnp.take(weights.reshape(-1), order, axis=0, mode="clip")  # [n*k]
    counts = jnp.bincount(flat, length=num_local * ep).astype(jnp.int32)  # [E] pairs per expert
    all_counts = jax.lax.all_gather(counts, axis)  # [src, E]
    # where each global expert's pairs start in its sender's sorted pairs: [src, dst, e]
    send_starts = _exclusive_cumsum(all_counts, axis=1).reshape(ep, ep, num_local)
    pairs = all_counts.reshape(ep, ep, num_local).transpose(1, 2, 0)  # [dst, e, src] pairs sent
    # worst case: every pair of every device lands on one device (a token's k experts are distinct)
    worst = ep * n * min(k, num_local)
    if capacity_factor > 0:
        # What does not fit is not sent (dropped pairs contribute nothing): the busiest experts are cut
        # (fill_capacity), each keeping its pairs from the first senders.
        rows = capacity_rows(n * k, worst, capacity_factor)
        kept = _keep_prefix(pairs, fill_capacity(jnp.sum(pairs, axis=-1), rows))  # [dst, e, src]
        returned = _exchange_round(sent, sent_weights, *expert_weights, jnp.zeros_like(kept), kept, send_starts,
                                   jnp.zeros_like(sent), glu=glu, exchange=exchange, axis=axis, rows=rows)
    else:
        rows = capacity_rows(n * k, worst, DROPLESS_ROUND_FACTOR)
        returned = _dropless_rounds(glu, exchange, axis, rows, sent, sent_weights, *expert_weights, pairs,
                                    send_starts)
    pair_out = jnp.take(returned, jnp.argsort(order), axis=0, mode="clip").reshape(n, k, -1)
    return sum_weighted_pairs(pair_out)


def _exchange_round(sent, sent_weights, w_gate, w_up, w_down, before, count, send_starts, out, *, glu, exchange,
                    axis, rows):
    """One exchange: of each sender's pairs for each (dst, local expert), the ``count [dst, e, src]``
    after the first ``before [dst, e, src]``, sent with their weights ``sent_weights [n*k]`` to a
    ``[rows, L]`` buffer grouped by expert, run through the experts (weighted) and written back into
    ``out [n*k, L]`` (``sent``'s rows; the others keep ``out``'s values)."""
    ep = count.shape[0]
    me = jax.lax.axis_index(axis)
    # slice (src, e) starts on dst after every earlier expert's pairs and this expert's from earlier srcs
    recv_starts = _exclusive_cumsum(count.reshape(ep, -1), axis=1).reshape(count.shape)  # [dst, e, src]
    # slices in (peer, local expert) order, as ragged_all_to_all groups them per peer
    to_peers = dict(input_offsets=(send_starts[me] + before[:, :, me]).reshape(-1),
                    send_sizes=count[:, :, me].reshape(-1), output_offsets=recv_starts[:, :, me].reshape(-1),
                    recv_sizes=count[me].T.reshape(-1))
    # zeros_like keeps `sent`'s device-varying type, which the collective requires of its output too
    received = exchange(sent, jnp.zeros_like(sent, shape=(rows, sent.shape[1])), **to_peers, axis_name=axis)
    received_weights = exchange(sent_weights[:, None], jnp.zeros_like(sent_weights, shape=(rows, 1)), **to_peers,
                                axis_name=axis)[:, 0]
    # rows past sum(group_sizes) are padding: the experts may leave anything there, and nothing reads it
    results = glu(received, jnp.sum(count[me], axis=1), w_gate, w_up, w_down, received_weights)
    back = dict(input_offsets=recv_starts[me].T.reshape(-1), send_sizes=to_peers["recv_sizes"],
                output_offsets=(send_starts[:, me] + before[me].T).reshape(-1), recv_sizes=to_peers["send_sizes"])
    return exchange(results, out.astype(results.dtype), **back, axis_name=axis)


def dropless_rounds_needed(loads: jax.Array, rows: int) -> jax.Array:
    """Rounds of ``rows`` a dropless exchange runs: the busiest device's. loads ``[dst, e]`` -> int scalar."""
    return jnp.maximum(jnp.max(-(-jnp.sum(loads, axis=1) // rows)), 1)


def _sent_before(pairs, loads, rows, r):
    """Pairs ``[dst, e, src]`` sent in the rounds before round ``r``: each round takes ``rows`` more per
    device, water-filled over its experts (``fill_capacity`` is monotone in the capacity), each expert's
    from the first senders."""
    return _keep_prefix(pairs, fill_capacity(loads, r * rows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _dropless_rounds(glu, exchange, axis, rows, sent, sent_weights, w_gate, w_up, w_down, pairs, send_starts):
    """Every pair sent, computed and returned, in rounds of ``rows`` per device (:func:`_exchange_round`):
    the buffers are ``[rows, L]`` whatever the routing, and nothing is dropped. Every device of the group
    reads every device's loads (``pairs [dst, e, src]``), so all run the same number of rounds (the
    collectives need it). Round 0 always runs; the rest, a ``while_loop`` over the rounds the loads need,
    only when a device's pairs exceed ``rows``. The rounds write disjoint rows, so their sum is the
    result, and the backward pass is the sum of each round's (custom VJP: a ``while_loop`` has none).
    -> ``[n*k, L]`` in ``sent``'s rows."""
    return _dropless_rounds_fwd(glu, exchange, axis, rows, sent, sent_weights, w_gate, w_up, w_down, pairs,
                                send_starts)[0]


def _round_of(glu, exchange, axis, rows, pairs, send_starts, r):
    """Round ``r`` as a function of the differentiable inputs (sent, sent_weights, w_gate, w_up, w_down, out)."""
    loads = jnp.sum(pairs, axis=-1)
    before = _sent_before(pairs, loads, rows, r)
    count = _sent_before(pairs, loads, rows, r + 1) - before
    return functools.partial(_run_round, before, count, send_starts, glu=glu, exchange=exchange, axis=axis, rows=rows)


def _run_round(before, count, send_starts, sent, sent_weights, w_gate, w_up, w_down, out, *, glu, exchange, axis,
               rows):
    return _exchange_round(sent, sent_weights, w_gate, w_up, w_down, before, count, send_starts, out, glu=glu,
                           exchange=exchange, axis=axis, rows=rows)


def _dropless_rounds_fwd(glu, exchange, axis, rows, sent, sent_weights, w_gate, w_up, w_down, pairs, send_starts):
    rounds = dropless_rounds_needed(jnp.sum(pairs, axis=-1), rows)
    first = _round_of(glu, exchange, axis, rows, pairs, send_starts, 0)
    inputs = (sent, sent_weights, w_gate, w_up, w_down)
    out, pullback = jax.vjp(lambda *a: first(*a, jnp.zeros_like(sent)), *inputs)

    def body(carry):
        r, acc = carry
        return r + 1, _round_of(glu, exchange, axis, rows, pairs, send_starts, r)(*inputs, acc)

    _, out = jax.lax.while_loop(lambda c: c[0] < rounds, body, (jnp.int32(1), out))
    return out, (pullback, inputs, pairs, send_starts, rounds)


def _dropless_rounds_bwd(glu, exchange, axis, rows, res, ct):
    pullback, inputs, pairs, send_starts, rounds = res
    sent = inputs[0]
    grads = pullback(ct)  # round 0, from the forward's residuals

    def body(carry):
        r, acc = carry
        fn = _round_of(glu, exchange, axis, rows, pairs, send_starts, r)
        _, pull = jax.vjp(lambda *a: fn(*a, jnp.zeros_like(sent)), *inputs)
        return r + 1, jax.tree.map(_add_cotangents, acc, pull(ct))

    _, grads = jax.lax.while_loop(lambda c: c[0] < rounds, body, (jnp.int32(1), grads))
    return (*grads, None, None)


def _add_cotangents(x, y):
    """Two rounds' cotangents of one input summed; an integer input's (float0: MXFP4 weights) is no value."""
    return x if x.dtype == jax.dtypes.float0 else (x + y).astype(x.dtype)


_dropless_rounds.defvjp(_dropless_rounds_fwd, _dropless_rounds_bwd)


def _gathered_experts(z, experts, weights, glu, num_local, ep, tokens_split, capacity_factor, axis):
    """Every device of an ``expert`` group sees the group's tokens and applies its own experts; the
    partial sums are reduced (and scattered back to the tokens' owners when they were split).

    z ``[n, L]``, experts / weights ``[n, k]`` -> ``[n, L]`` float32.
    """
    if tokens_split:
        z, experts, weights = (jax.lax.all_gather(a, axis, tiled=True) for a in (z, experts, weights))
    else:
        # Replicated tokens are gathered below with indices that differ per device; typed as
        # invariant, jax 0.10.2 transposes that gather wrongly (the gradient lands on the wrong
        # rows), so they are made device-varying explicitly (the cotangent is then psum-ed); the
        # routing weights, gathered the same way, too.
        z, weights = (jax.lax.pcast(a, axis, to="varying") for a in (z, weights))
    m, k = experts.shape
    first = jax.lax.axis_index(axis) * num_local
    local = experts.reshape(-1) - first
    is_local = (local >= 0) & (local < num_local)
    local_expert = jnp.where(is_local, local, num_local)
    # only the local pairs are computed: at most min(k, E_l) per token, m * k / ep on average
    rows = capacity_rows(-(-m * k // ep), m * min(k, num_local), capacity_factor)
    loads = jnp.bincount(local_expert, length=num_local + 1).astype(jnp.int32)  # [E_l + 1]: last = not local
    group_sizes = fill_capacity(loads[:num_local], rows)  # the busiest experts' last pairs are dropped
    # the pairs kept, grouped by expert (each expert's first pairs, in token order), then the rest
    order = jnp.argsort(local_expert, stable=True)
    grouped = local_expert[order]
    within = jnp.arange(m * k) - _exclusive_cumsum(loads)[grouped]  # place in its expert's group
    kept = (grouped < num_local) & (within < jnp.append(group_sizes, 0)[grouped])
    order = order[jnp.argsort(~kept, stable=True)[:rows]]
    # weighted before the down projection, as the exchange's pairs (_exchange_experts)
    ys = glu(jnp.take(z, order // k, axis=0, mode="clip"), group_sizes,
             row_weights=jnp.take(weights.reshape(-1), order, axis=0, mode="clip"))
    ys = jnp.where((jnp.arange(rows) < jnp.sum(group_sizes))[:, None], ys, jnp.zeros((), ys.dtype))
    pair_out = jnp.zeros((m * k, z.shape[1]), ys.dtype).at[order].set(ys).reshape(m, k, -1)
    partial = sum_weighted_pairs(pair_out)
    if tokens_split:
        return jax.lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)
    return jax.lax.psum(partial, axis)


def dense_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` from a dense ``jax.lax.all_to_all``.

    The ``S`` slices of each peer (``len(input_offsets) = ep * S``, peer-major) are concatenated into
    one block padded to ``min(len(operand), len(output))`` rows (no peer's slices can add up to more),
    the blocks are exchanged, and each received row is written at its slice's offset plus its place
    in the slice. operand ``[M, ...]``, output ``[R, ...]``, offsets and sizes ``[ep * S]`` int ->
    ``[R, ...]``.
    """
    ep = jax.lax.axis_size(axis_name)
    cap = min(operand.shape[0], output.shape[0])
    rows = jnp.arange(cap, dtype=input_offsets.dtype)

    def slice_of(sizes):
        """[ep, S] slice sizes -> (slice index, row within the slice, inside any slice) of each block row."""
        ends = jnp.cumsum(sizes, axis=1)
        j = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right"))(ends)  # [ep, cap]
        j_in = jnp.minimum(j, sizes.shape[1] - 1)
        within = rows - jnp.take_along_axis(ends - sizes, j_in, axis=1)
        return j_in, within, rows < ends[:, -1:]

    j, within, sending = slice_of(send_sizes.reshape(ep, -1))
    take_rows = jnp.clip(jnp.take_along_axis(input_offsets.reshape(ep, -1), j, axis=1) + within,
                         0, operand.shape[0] - 1)  # [ep, cap]
    keep = sending.reshape(take_rows.shape + (1,) * (operand.ndim - 1))
    blocks = jnp.where(keep, jnp.take(operand, take_rows, axis=0, mode="clip"), jnp.zeros((), operand.dtype))
    received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # [ep, cap, ...]: block i from peer i
    # where peer i's slices land here
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True).reshape(ep, -1)
    j, within, receiving = slice_of(recv_sizes.reshape(ep, -1))
    # rows in no slice go past the end, where mode="drop" drops them
    put_rows = jnp.where(receiving, jnp.take_along_axis(offsets, j, axis=1) + within, output.shape[0])
    return output.at[put_rows.reshape(-1)].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")

"""The optimizer (README "The architecture"): per-head Muon for matrices, AdamW for the rest, LR schedules, QK-clip.

Parameter groups (decided from each ``nnx.Param``'s logical axis names, its ``out_sharding``
metadata, plus a few leaf names; ``layers`` is always a batch axis):

==============================================  =========  =========================================
parameter (shape without the ``layers`` axis)   group      Muon blocks (per_head=True)
==============================================  =========  =========================================
embed ``(V, d)``, lm_head ``(d, V)``            AdamW, wd  (any param with a ``vocab`` axis)
RMSNorm weights, KDA ``o_norm``                 AdamW      (1-D)
AttnRes ``query`` / ``norm``                    AdamW      (1-D)
KDA ``A_log (H)``, ``dt_bias (H, K)``           AdamW      gate constants, by name
KDA ``q_conv/k_conv/v_conv (W, H, K)``          AdamW      depthwise filters (``conv`` axis)
router bias, any ``bias``                       AdamW      (the router bias is not even a Param)
KDA ``q/k/v_proj``, ``g_proj (d, H, K)``        Muon       per head, ``(d, K)`` blocks (output side)
KDA ``f_b``, ``g_b (r, H, K)``                  Muon       per head, ``(r, K)`` blocks
MLA ``q_b (q_lora, H, P)``, ``q_proj (d,H,P)``  Muon       per head, ``(q_lora, P)`` (nope+rope)
MLA ``kv_b (kv_lora, H, nope+v)``               Muon       per head, ``(kv_lora, nope+v)``
MLA ``g_proj (d, H, v)``                        Muon       per head
``o_proj (H, dh, d)`` (KDA and MLA)             Muon       per head, ``(dh, d)`` blocks (input side)
KDA ``b_proj (d, H)``                           Muon       whole matrix (one column per head)
KDA ``f_a``, ``g_a (d, r)``                     Muon       whole matrix
MLA ``q_a (d, q_lora)``, ``kv_a (d, kv+rope)``  Muon       whole matrix
dense FFN / shared expert ``w_gate, w_up, w_down``  Muon   whole matrix
MoE ``down (d, L)``, ``up (L, d)``              Muon       whole matrix
MoE ``router (d, E)``                           Muon       whole matrix (Moonlight/K2: every 2-D
                                                           hidden weight; ``expert`` is an output
                                                           axis here, not a batch axis)
routed experts ``(E, in, out)``                 Muon       per expert
==============================================  =========  =========================================

The rule behind the table: ``heads`` is a batch axis (one Newton-Schulz per head) when the param
also has a ``head_dim`` axis; ``expert`` is a batch axis when the param also has ``expert_in`` /
``expert_mlp`` axes. Of the remaining axes, a leading ``heads, head_dim`` pair is the reduction
(input) side (output projections), otherwise the first axis is; the rest is the output side. With
``per_head=False`` (the ablation) the head axes join the output side (q/k/v-like) or the reduction
side (``o_proj``): ``MuonDimensionNumbers`` takes tuples of axes, so the whole ``d x H*dh`` matrix is
orthogonalised at once and scaled by ``0.2 * sqrt(max(d, H*dh))``.

Muon update per block: Nesterov momentum 0.95, 5 Newton-Schulz steps with (3.4445, -4.7750, 2.0315),
scaled by ``0.2 * sqrt(max(rows, cols))`` of the block (``consistent_rms=0.2``), then
``W <- W - lr * (update + wd * W)``. AdamW (plain, not Nesterov; its own ``adam_eps``) uses
``adam_learning_rate`` (default: the Muon LR, which the 0.2 RMS matching allows) with the same
schedule shape. Weight decay (decoupled, multiplied by the LR as in Moonlight): every Muon matrix
and the embedding / lm_head; never norms, biases, gate constants, conv filters or AttnRes
queries/gains.

The transform has the structure of ``optax.contrib.muon`` (a ``partition`` into a Muon chain and
AdamW) and uses optax's ``MuonDimensionNumbers``; the consistent-RMS scaling is optax's
``scale_by_shape`` rule, written here on public API (:func:`scale_by_consistent_rms`). Two parts are our own:
the AdamW side gets a weight-decay mask, plain AdamW and its own epsilon; and Newton-Schulz runs
*grouped* (:func:`scale_by_grouped_muon`, same maths as ``optax.contrib.scale_by_muon``; the iteration
and where each block runs are ``k3jax/newton_schulz.py``): blocks of
equal shape from different parameters are iterated as one batch (one batched NS per block shape, not
per parameter), which cut the XLA:CPU compile time of the tiny model's optimizer update by a third
(42 s instead of 62 s of CPU time, measured on a busy 2-core machine). Labels and dimension numbers are looked up by
parameter path, so the transform works on ``nnx.state(model, nnx.Param)`` (Variables),
``nnx.as_pure`` states and ``nnx.to_pure_dict`` trees alike (what ``nnx.Optimizer`` passes).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from k3jax import newton_schulz
from k3jax.config import OptimConfig
from k3jax.layer_plan import LayerPlan
from k3jax.layers.latent_moe import FLOAT32_WEIGHTS

MDN = MuonDimensionNumbers
CONSISTENT_RMS = 0.2
MUON, ADAMW = "muon", "adamw"

# Leaf names that always go to AdamW whatever their shape.
_ADAMW_LEAVES = frozenset({"embed", "lm_head", "A_log", "dt_bias", "router_bias", "bias",
                           "pos_emb"})  # pos_emb: the vision tower's learned position table (a lookup)
# Logical axes whose presence sends a param to AdamW.
_ADAMW_AXES = frozenset({"vocab", "conv", "norm"})

Path = tuple[str | int, ...]


# ---------------------------------------------------------------------------------------------
# Paths


def normalize_path(path: Any) -> Path:
    """A parameter path as a tuple of names/ints from a jax key path, ``"a/b/0/c"`` or a tuple.

    A trailing ``.value`` attribute (how ``nnx.Variable`` nodes flatten) is dropped.
    """
    if isinstance(path, str):
        return tuple(int(p) if p.isdigit() else p for p in path.split("/") if p)
    out: list = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(k.key)
        else:
            out.append(k)
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        out.pop()
    return tuple(out)


def _is_norm_or_attn_res(names: Path) -> bool:
    strs = [n for n in names if isinstance(n, str)]
    return any(n.endswith("norm") or n.endswith("_res_mix") for n in strs)


def _is_adamw_by_name(names: Path) -> bool:
    leaf = names[-1] if names else ""
    if leaf in _ADAMW_LEAVES or (isinstance(leaf, str) and (leaf.endswith("_conv") or leaf.endswith("_bias"))):
        return True
    return _is_norm_or_attn_res(names)


# ---------------------------------------------------------------------------------------------
# Group assignment and dimension numbers


def classify(path: Any, axes: Sequence[str | None] | None, ndim: int | None = None, *,
             per_head: bool = True) -> MDN | None:
    """Muon dimension numbers for one parameter, or None for AdamW.

    path: the parameter path (names); axes: its logical axis names (``out_sharding``) or None if
    unknown (then only the name rules apply and a >=2-D leaf is whole-matrix Muon over its last two
    axes); ndim: needed only when ``axes`` is None.
    """
    names = normalize_path(path)
    if _is_adamw_by_name(names):
        return None
    if axes is None:
        if ndim is None or ndim < 2:
            return None
        return MDN(reduction_axis=ndim - 2, output_axis=ndim - 1)
    axes = tuple(axes)
    if _ADAMW_AXES & set(a for a in axes if a is not None):
        return None
    batch = {i for i, a in enumerate(axes) if a == "layers"}
    if "expert" in axes and ({"expert_in", "expert_mlp"} & set(axes)):
        batch.add(axes.index("expert"))
    if per_head and "heads" in axes and "head_dim" in axes:
        batch.add(axes.index("heads"))
    rest = [i for i in range(len(axes)) if i not in batch]
    if len(rest) < 2:
        return None  # a vector (or a per-block vector): AdamW
    if len(rest) >= 3 and axes[rest[0]] == "heads":
        split = 2  # (heads, head_dim, out...): the heads live on the input side (o_proj)
    else:
        split = 1
    red, out = tuple(rest[:split]), tuple(rest[split:])
    return MDN(reduction_axis=red[0] if len(red) == 1 else red,
               output_axis=out[0] if len(out) == 1 else out)


def param_group(path: Any, axes: Sequence[str | None] | None = None, ndim: int | None = None) -> Literal["muon", "adamw"]:
    """``"muon"`` or ``"adamw"`` for a parameter path (tuple, ``"a/b/c"`` string or jax key path).

    Without ``axes`` only the name rules are used (any other leaf counts as a matrix): exact for
    every k3jax parameter except hypothetical new 1-D ones; pass ``axes`` to be exact.
    """
    if axes is None and ndim is None:
        return ADAMW if _is_adamw_by_name(normalize_path(path)) else MUON
    return ADAMW if classify(path, axes, ndim) is None else MUON


def _flat_params(model_or_state) -> list[tuple[Path, nnx.Variable]]:
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    else:
        state = model_or_state
    out = []
    for path, var in nnx.to_flat_state(state):
        out.append((normalize_path(path), var))
    return out


def _axes_of(var) -> tuple | None:
    if isinstance(var, nnx.Variable):
        axes = var.get_metadata().get("out_sharding")
        return tuple(axes) if axes is not None else None
    return None


def _shape_of(var) -> tuple[int, ...]:
    value = var.get_raw_value() if isinstance(var, nnx.Variable) else var
    return tuple(value.shape)


def _unflatten(items: list[tuple[Path, Any]]) -> nnx.State:
    nested: dict = {}
    for path, value in items:
        node = nested
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return nnx.State(nested)


def muon_dimension_numbers(model_or_state, *, per_head: bool = True) -> nnx.State:
    """A tree matching ``nnx.state(model, nnx.Param)`` with a ``MuonDimensionNumbers`` (Muon) or
    ``None`` (AdamW) at every parameter. Accepts a module or an ``nnx.State`` of Variables (the
    ``out_sharding`` axis names are read from the Variables; an abstract model works too)."""
    items = []
    for path, var in _flat_params(model_or_state):
        shape = _shape_of(var)
        items.append((path, classify(path, _axes_of(var), len(shape), per_head=per_head)))
    return _unflatten(items)


def _decays(path: Path, dim_num: MDN | None) -> bool:
    """Decoupled weight decay: every Muon matrix, and the embedding / lm_head in the AdamW group."""
    return dim_num is not None or (bool(path) and path[-1] in ("embed", "lm_head"))


def group_table(model_or_state, *, per_head: bool = True) -> dict[Path, tuple[str, MDN | None, bool]]:
    """``{path: (group, dimension numbers, decayed)}`` for logging and tests."""
    out = {}
    for path, var in _flat_params(model_or_state):
        dn = classify(path, _axes_of(var), len(_shape_of(var)), per_head=per_head)
        out[path] = (ADAMW if dn is None else MUON, dn, _decays(path, dn))
    return out


# ---------------------------------------------------------------------------------------------
# Schedules


def learning_rate_schedule(cfg: OptimConfig, total_steps: int, peak: float | None = None) -> optax.Schedule:
    """LR at (0-based) optimizer step ``s``; a jittable function of ``s``.

    - warmup (all schedules): ``peak * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (the first
      step already moves; the peak is reached at step ``warmup_steps - 1``).
    - ``cosine``: from ``peak`` at step ``warmup`` to ``end = end_lr_fraction * peak`` at step
      ``warmup + D`` along a half cosine, then ``end``; ``D = decay_steps`` or, when 0, the rest of
      the run (``total_steps - warmup``).
    - ``wsd`` (warmup-stable-decay): ``peak`` until ``total_steps - D``, then linear to ``end`` at
      ``total_steps``; ``D = decay_steps`` or, when 0, 20% of ``total_steps``.
    - ``constant``: ``peak`` after warmup.
    """
    peak = cfg.learning_rate if peak is None else peak
    end = cfg.end_lr_fraction * peak
    warmup = cfg.warmup_steps
    kind = cfg.schedule
    if kind == "cosine":
        decay = cfg.decay_steps or max(total_steps - warmup, 1)
        decay_start = warmup
    elif kind == "wsd":
        decay = cfg.decay_steps or max(int(round(0.2 * total_steps)), 1)
        decay_start = max(total_steps - decay, warmup)
    elif kind == "constant":
        decay, decay_start = 1, None
    else:
        raise ValueError(f"train.optim.schedule: unknown schedule {kind!r} (cosine, wsd, constant)")

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum((s + 1.0) / max(warmup, 1), 1.0) if warmup > 0 else jnp.asarray(peak, jnp.float32)
        if decay_start is None:
            return warm
        p = jnp.clip((s - decay_start) / decay, 0.0, 1.0)
        if kind == "cosine":
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        else:
            after = peak + (end - peak) * p
        return jnp.where(s < warmup, warm, after)

    return schedule


# ---------------------------------------------------------------------------------------------
# The optimizer


class GroupedMuonState(NamedTuple):
    count: jax.Array  # int32 scalar
    mu: Any  # momentum, like the params


# The leading logical axes (``out_sharding``) of the scanned groups' routed experts, [layers, E, ...]: the
# stacks that run several layers per optimizer step (newton_schulz.layers_per_step).
STACKED_EXPERTS_AXES = ("layers", "expert")


def scale_by_consistent_rms(dim_nums: Callable[[Any], Any], rms: float) -> optax.GradientTransformation:
    """Scale each orthogonalised update by ``rms * sqrt(max(fan_in, fan_out))`` of its blocks (fan_in =
    the reduction axes' size, fan_out = the output axes'): an update RMS of ``rms`` whatever the
    shape, as ``optax.contrib.scale_by_shape(consistent_rms=rms)``. ``dim_nums(updates)`` as in
    :func:`scale_by_grouped_muon`."""

    def scale(u, dn):
        red, out = newton_schulz.normalized_axes(u.ndim, dn)
        fan_in, fan_out = math.prod(u.shape[i] for i in red), math.prod(u.shape[i] for i in out)
        return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * rms * u

    def update_fn(updates, state, params=None):
        del params
        return jax.tree.map(scale, updates, dim_nums(updates), is_leaf=lambda x: isinstance(x, MDN)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scale_by_grouped_muon(dim_nums: Callable[[Any], Any], *, beta: float = 0.95, ns_steps: int = 5,
                          ns_coeffs=newton_schulz.NS_COEFFS, eps: float = 1e-8, nesterov: bool = True,
                          mu_dtype=None,
                          stacked: Callable[[Any], Any] | None = None,
                          expert_stacks: Callable[[Any], Any] | None = None,
                          group_max_size: int = 1 << 22) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` (same momentum, bias correction and Nesterov form) with the
    Newton-Schulz step of :func:`k3jax.newton_schulz.orthogonalize_blocks`. ``dim_nums(updates)`` returns a tree of
    ``MuonDimensionNumbers`` matching ``updates``.

    ``stacked(updates)`` (optional) marks the leaves whose axis 0 stacks scanned layers: those larger
    than ``group_max_size`` run their whole update (momentum, Nesterov, Newton-Schulz) one layer at a
    time in a loop that writes in place, so the optimizer's temporaries are one layer's, not the whole stack's
    (for full K3's 22-group stacks of routed experts that is the difference between fitting and not),
    unless the stack's blocks fit one per device (:func:`k3jax.newton_schulz.spread_whole_stack`). ``expert_stacks(updates)``
    (optional) marks the stacked leaves whose axis 1 is the routed experts (``[layers, E, ...]``): those
    run several layers per step (:func:`k3jax.newton_schulz.layers_per_step`), their blocks regrouped expert-major.
    """

    def init_fn(params):
        return GroupedMuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params, dtype=mu_dtype))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def bias_corrected(x, n):  # optax.tree.bias_correction of one array
            return x / (1 - beta ** n).astype(x.dtype)

        def moments(g, m):  # -> (Newton-Schulz input, new momentum), as optax's scale_by_muon
            g = g.astype(jnp.promote_types(g.dtype, m.dtype))  # bf16 gradients into a float32 momentum
            m = (1 - beta) * g + beta * m
            if nesterov:
                m_hat = beta * bias_corrected(m, optax.safe_increment(count)) + (1 - beta) * bias_corrected(g, count)
            else:
                m_hat = bias_corrected(m, count)
            if mu_dtype is not None:  # Newton-Schulz in the momentum's dtype (bf16 halves its temporaries)
                m_hat, m = m_hat.astype(mu_dtype), m.astype(mu_dtype)
            return m_hat, m

        leaves, treedef = jax.tree.flatten(updates)
        mus = treedef.flatten_up_to(state.mu)
        dns = treedef.flatten_up_to(dim_nums(updates))
        per_layer = treedef.flatten_up_to(stacked(updates)) if stacked is not None else [False] * len(leaves)
        experts = (treedef.flatten_up_to(expert_stacks(updates)) if expert_stacks is not None
                   else [False] * len(leaves))
        out, new_mu, batched = [None] * len(leaves), [None] * len(leaves), []
        for i, (g, m, dn, layered, of_experts) in enumerate(zip(leaves, mus, dns, per_layer, experts)):
            whole = newton_schulz.spread_whole_stack(newton_schulz.num_blocks(g, dn))
            if layered and g.size > group_max_size and g.shape[0] > 1 and not whole:
                layers = newton_schulz.layers_per_step(g, dn) if of_experts else 1
                ldn = newton_schulz.drop_leading_axis(dn)

                def some_layers(g_s, m_s, dn=ldn, layers=layers):  # [layers, ...]; experts: [layers, E, ...]
                    m_hat, m_new = moments(g_s, m_s)
                    if layers == 1:
                        x = newton_schulz.orthogonalize_blocks([m_hat[0]], [dn], ns_coeffs=ns_coeffs, ns_steps=ns_steps,
                                                               eps=eps, group_max_size=group_max_size)[0]
                        return x[None], m_new
                    x = jnp.swapaxes(m_hat, 0, 1)  # expert-major, so merging keeps the experts' sharding
                    x = newton_schulz.split_over_experts(x.reshape(-1, *x.shape[2:]), 0)
                    x = newton_schulz.orthogonalize_blocks([x], [dn], ns_coeffs=ns_coeffs, ns_steps=ns_steps, eps=eps,
                                                           group_max_size=group_max_size)[0]
                    x = jnp.swapaxes(x.reshape(m_hat.shape[1], layers, *x.shape[1:]), 0, 1)
                    return newton_schulz.split_over_experts(x, 1), newton_schulz.split_over_experts(m_new, 1)

                out[i], new_mu[i] = _in_place_over_layers(some_layers, g, m, layers)
            else:
                batched.append(i)
        hats = {}
        for i in batched:
            hats[i], new_mu[i] = moments(leaves[i], mus[i])
        ns = newton_schulz.orthogonalize_blocks([hats[i] for i in batched], [dns[i] for i in batched],
                                                ns_coeffs=ns_coeffs, ns_steps=ns_steps, eps=eps,
                                                group_max_size=group_max_size)
        for i, x in zip(batched, ns):
            out[i] = x
        return jax.tree.unflatten(treedef, out), GroupedMuonState(count, jax.tree.unflatten(treedef, new_mu))

    return optax.GradientTransformation(init_fn, update_fn)


def _in_place_over_layers(fn: Callable, g: jax.Array, m: jax.Array, layers: int) -> tuple[jax.Array, jax.Array]:
    """``fn(g[s], m[s]) -> (update, momentum)`` over consecutive ``layers``-long slices ``s`` of the
    stacks ``g, m [L, ...]``, each result written back into the slice it came from: a loop whose
    carry is the two stacks, so XLA updates the gradient's and the donated momentum's buffers in place.
    ``lax.map`` returned two new whole stacks per stacked leaf, all live at once: full K3's optimizer on
    v5p-1024 needed 21.4 GiB of temporaries, 4.0 this way. The update comes back in ``g``'s dtype.

    The next step's slices are read from the stacks *after* this step's writes and carried: every read
    of a stack then follows its last write, so XLA:CPU writes in place too (with the slices read at the
    top of the step, its fusions read the stacks after the writes and it copied both stacks every step)."""
    if g.shape[0] % layers:  # the slices past the last whole one would keep the raw gradient
        raise ValueError(f"{layers} layers per step do not divide the stack of {g.shape[0]}")
    last = g.shape[0] - layers

    def take(u, mu, start):
        return jax.lax.dynamic_slice_in_dim(u, start, layers), jax.lax.dynamic_slice_in_dim(mu, start, layers)

    def body(step, carry):
        u, mu, g_s, m_s = carry
        start = step * layers
        o, m_new = fn(g_s, m_s)
        u = jax.lax.dynamic_update_slice_in_dim(u, o.astype(u.dtype), start, 0)
        mu = jax.lax.dynamic_update_slice_in_dim(mu, m_new.astype(mu.dtype), start, 0)
        return (u, mu, *take(u, mu, jnp.minimum(start + layers, last)))

    u, mu, _, _ = jax.lax.fori_loop(0, g.shape[0] // layers, body, (g, m, *take(g, m, 0)))
    return u, mu


def _path_lookup(table: dict[Path, Any], what: str) -> Callable[[Any, Any], Any]:
    def look(path, _leaf):
        key = normalize_path(path)
        try:
            return table[key]
        except KeyError:
            raise KeyError(f"k3jax.optim: parameter {'/'.join(map(str, key))} is not in the model the "
                           f"optimizer was built for ({what})") from None
    return look


def cast_muon_group(params, dtype) -> Any:
    """``params`` (an ``nnx.State`` of Params) with the Muon group's leaves (the matrices) cast to
    ``dtype``, except the float32 ones (``LatentMoE.FLOAT32_WEIGHTS``): differentiated there, their
    gradients come out in ``dtype``. The layers read the others in the compute dtype anyway, so with
    ``dtype`` the compute dtype the forward is unchanged."""
    table = {p: g == MUON and p[-1] not in FLOAT32_WEIGHTS for p, (g, _, _) in group_table(params).items()}
    look = _path_lookup(table, "gradient dtype")
    return jax.tree_util.tree_map_with_path(lambda path, x: x.astype(dtype) if look(path, x) else x, params)


def decayed_weights_in_float32(weight_decay: float) -> optax.GradientTransformation:
    """``u + weight_decay * w`` in float32 (``optax.add_decayed_weights`` computes ``weight_decay * w`` in
    the weights' dtype: for bf16 weights, a rounded decay)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the parameters")
        return jax.tree.map(lambda u, w: u.astype(jnp.float32) + weight_decay * w.astype(jnp.float32),
                            updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def float32_statistics(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` run on float32 copies of the parameters and gradients: its statistics (AdamW's moments)
    and updates are float32 whatever the weights' dtype (optax keeps them in the parameters' dtype, so
    bf16 weights would get bf16 second moments). A no-op for float32 weights."""

    def up(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update_fn(updates, state, params=None):
        return tx.update(up(updates), state, None if params is None else up(params))

    return optax.GradientTransformation(lambda params: tx.init(up(params)), update_fn)


def stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` (bfloat16) up or down at random, with the probability of
    rounding up equal to the dropped fraction of the gap: ``E[round(x)] = x`` (unbiased), so updates
    far below a bf16 weight's spacing still move it on average. A random 16-bit integer is added to
    the float32 bits below bf16's mantissa, then those bits are cut (the sign is apart, so this
    rounds the magnitude, hence the value, without bias)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"stochastic rounding is to bfloat16, not {jnp.dtype(dtype).name}")
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(dtype)


class RoundingState(NamedTuple):
    count: jax.Array  # int32 scalar: the updates rounded so far (each draws new bits)


def stochastic_weight_rounding(seed: int) -> optax.GradientTransformation:
    """The last step of the chain for weights held below float32 (``model.param_dtype=bfloat16``,
    ``train.optim.weight_rounding=stochastic``). ``optax.apply_updates`` computes ``w + u`` in float32
    and rounds it to the weight's dtype to the nearest value, which drops an update under half the
    weight's spacing (2^-9 of it in bf16). This returns ``u' = SR(w + u) - w`` instead (float32; exact,
    both terms being bf16 values of close magnitude), so the weight becomes :func:`stochastic_round` of
    the float32 sum: unbiased, with bits drawn from ``seed``, the update count and the leaf. Float32
    weights pass unchanged."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("stochastic rounding of the weights needs the parameters")
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(updates)
        ws = treedef.flatten_up_to(params)
        out = []
        for i, (u, w) in enumerate(zip(leaves, ws)):
            if jnp.dtype(w.dtype) == jnp.float32 or not jnp.issubdtype(w.dtype, jnp.floating):
                out.append(u)
                continue
            w32 = w.astype(jnp.float32)
            rounded = stochastic_round(w32 + u.astype(jnp.float32), w.dtype, jax.random.fold_in(key, i))
            out.append(rounded.astype(jnp.float32) - w32)
        return jax.tree.unflatten(treedef, out), RoundingState(optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda params: RoundingState(jnp.zeros([], jnp.int32)), update_fn)


def make_optimizer(cfg: OptimConfig, model, total_steps: int, seed: int = 0) -> optax.GradientTransformation:
    """``clip_by_global_norm -> partition(muon: per-head Muon, adamw: AdamW)`` for ``model``'s
    ``nnx.Param`` tree (a module, or an ``nnx.State`` of its Params). See the module docstring.
    ``cfg.optimizer == "adamw"``: ``clip_by_global_norm -> AdamW`` on every parameter, with the same
    weight-decay mask (the matrices decay, as under Muon)."""
    table = group_table(model, per_head=cfg.per_head_muon)
    labels_t = {p: g for p, (g, _, _) in table.items()}
    dims_t = {p: dn for p, (_, dn, _) in table.items()}
    decay_t = {p: d for p, (_, _, d) in table.items()}
    experts_t = {p: (_axes_of(var) or ())[:2] == STACKED_EXPERTS_AXES for p, var in _flat_params(model)}

    def labels(params):
        return jax.tree_util.tree_map_with_path(_path_lookup(labels_t, "labels"), params)

    def dim_nums(updates):  # sees the Muon-masked tree: only Muon leaves are visited
        return jax.tree_util.tree_map_with_path(_path_lookup(dims_t, "dimension numbers"), updates)

    def stacked(updates):  # the scanned layer groups' weights: axis 0 is the group
        return jax.tree_util.tree_map_with_path(lambda path, _: LayerPlan.is_stacked(normalize_path(path)), updates)

    def expert_stacks(updates):  # stacked routed experts: [layers, E, ...]
        return jax.tree_util.tree_map_with_path(_path_lookup(experts_t, "expert stacks"), updates)

    def adam_decay_mask(params):
        return jax.tree_util.tree_map_with_path(_path_lookup(decay_t, "decay mask"), params)

    muon_lr = learning_rate_schedule(cfg, total_steps)
    adam_peak = cfg.adam_learning_rate if cfg.adam_learning_rate is not None else cfg.learning_rate
    adam_lr = learning_rate_schedule(cfg, total_steps, peak=adam_peak)
    muon_tx = optax.chain(
        scale_by_grouped_muon(dim_nums, beta=cfg.muon_beta, ns_steps=cfg.ns_steps, nesterov=True,
                              mu_dtype=jnp.dtype(cfg.muon_dtype),  # not the weights' (bf16 weights, f32 momentum)
                              stacked=stacked, expert_stacks=expert_stacks),
        scale_by_consistent_rms(dim_nums, CONSISTENT_RMS),
        decayed_weights_in_float32(cfg.weight_decay),
        optax.scale_by_learning_rate(muon_lr),
    )
    adam_tx = float32_statistics(optax.adamw(adam_lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                                             weight_decay=cfg.weight_decay, mask=adam_decay_mask))
    parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    parts.append(adam_tx if cfg.optimizer == ADAMW else optax.partition({MUON: muon_tx, ADAMW: adam_tx}, labels))
    if cfg.weight_rounding == "stochastic":
        parts.append(stochastic_weight_rounding(seed))
    return optax.chain(*parts)


def make_lora_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optimizer of a LoRA run (``train.lora.rank > 0``): ``clip_by_global_norm -> AdamW`` over the
    adapters, what PEFT users expect (HF's trainer), whatever ``cfg.optimizer``: ``adam_learning_rate``
    (else ``learning_rate``), ``adam_b1 / b2 / eps``, the schedule, and ``weight_decay`` on every adapter
    factor (HF's trainer decays all but biases and norms). Muon's settings play no part."""
    peak = cfg.adam_learning_rate if cfg.adam_learning_rate is not None else cfg.learning_rate
    adam = optax.adamw(learning_rate_schedule(cfg, total_steps, peak=peak), b1=cfg.adam_b1, b2=cfg.adam_b2,
                       eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adam) if cfg.grad_clip > 0 else adam


# ---------------------------------------------------------------------------------------------
# QK-clip (Kimi K2 MuonClip) for MLA heads


def qk_clip_gamma(max_logits: jax.Array, tau: float) -> jax.Array:
    """``gamma_h = min(1, tau / S_max^h)`` (1 where the logit is below tau or not positive)."""
    m = jnp.asarray(max_logits, jnp.float32)
    return jnp.where(m > tau, tau / jnp.where(m > 0, m, 1.0), 1.0)


def qk_clip_mla(q_b: jax.Array, kv_b: jax.Array, max_logits: jax.Array, tau: float, *,
                qk_nope_head_dim: int) -> tuple[jax.Array, jax.Array]:
    """K2's MuonClip for one (or a stack of) MLA layer(s), applied after the optimizer step.

    q_b ``[..., r_q, H, nope + rope]`` (or the plain ``q_proj [..., d, H, P]``), kv_b
    ``[..., r_kv, H, nope + v]``, max_logits ``[..., H]``: each head's largest pre-softmax logit
    (already multiplied by the softmax scale) seen in the step's forward pass. With
    ``gamma = min(1, tau / max_logit)``: the head's q nope columns and k nope columns are scaled by
    ``sqrt(gamma)`` (their product by gamma), its q rope columns by ``gamma`` (the shared k_rope,
    in ``kv_a``, is untouched), the value columns are untouched.
    """
    gamma = qk_clip_gamma(max_logits, tau)  # [..., H]
    g = gamma[..., None, :, None]
    sg = jnp.sqrt(g)
    n = qk_nope_head_dim
    p = q_b.shape[-1]
    col = jnp.arange(p)
    q_scale = jnp.where(col < n, sg, g)  # [..., 1, H, P]
    q_new = (q_b.astype(jnp.float32) * q_scale).astype(q_b.dtype)
    kcol = jnp.arange(kv_b.shape[-1])
    kv_scale = jnp.where(kcol < n, sg, 1.0)
    kv_new = (kv_b.astype(jnp.float32) * kv_scale).astype(kv_b.dtype)
    return q_new, kv_new


def qk_clip(model: nnx.Module, max_logits: dict[int, jax.Array], tau: float) -> None:
    """Apply :func:`qk_clip_mla` in place to the MLA layers of ``model`` (a ``K3Model``).

    max_logits: ``{layer index: [H]}``, each MLA layer's largest pre-softmax logit per head in this
    step's forward pass (``model.forward(..., max_logits=True)``: ``ForwardStats.max_logits``).
    ``tau <= 0`` is a no-op. Pure array math on the Variables: works under ``jit``.
    """
    if tau <= 0:
        return
    unused = set(max_logits)
    for layer, layers in model.layer_modules():
        if not unused & set(layers):
            continue
        if not hasattr(layer.mixer, "kv_b"):
            raise KeyError(f"qk_clip: layer {layers[0]} is not an MLA layer")
        unused -= set(layers)
        mla = layer.mixer
        stacked = mla.kv_b[...].ndim == 4  # a slot of the scanned groups: [G, r, H, nope + v]
        logits = jnp.stack([max_logits[i] for i in layers]) if stacked else max_logits[layers[0]]
        q_var = mla.q_b if hasattr(mla, "q_b") else mla.q_proj
        q_new, kv_new = qk_clip_mla(q_var[...], mla.kv_b[...], logits, tau, qk_nope_head_dim=mla.cfg.qk_nope_head_dim)
        q_var[...] = q_new
        mla.kv_b[...] = kv_new
    if unused:
        raise KeyError(f"qk_clip: no layers {sorted(unused)} in this model")


__all__ = ["MDN", "classify", "decayed_weights_in_float32", "float32_statistics", "group_table",
           "learning_rate_schedule", "make_lora_optimizer", "make_optimizer", "muon_dimension_numbers",
           "normalize_path", "param_group", "qk_clip", "qk_clip_gamma", "qk_clip_mla", "scale_by_consistent_rms",
           "scale_by_grouped_muon", "stochastic_round", "stochastic_weight_rounding"]

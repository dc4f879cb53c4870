"""Muon vs AdamW: which parameters each side of the optimizer updates, and Muon's blocks.

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
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import jax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from k3jax.layers.latent_moe import FLOAT32_WEIGHTS

MDN = MuonDimensionNumbers
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


def flat_params(model_or_state) -> list[tuple[Path, nnx.Variable]]:
    """``[(path, Variable)]`` of a module's Params (or of an ``nnx.State``), paths normalised."""
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state, nnx.Param)
    else:
        state = model_or_state
    out = []
    for path, var in nnx.to_flat_state(state):
        out.append((normalize_path(path), var))
    return out


def axes_of(var) -> tuple | None:
    """A Variable's logical axis names (``out_sharding``), or None when unknown."""
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
    for path, var in flat_params(model_or_state):
        shape = _shape_of(var)
        items.append((path, classify(path, axes_of(var), len(shape), per_head=per_head)))
    return _unflatten(items)


def _decays(path: Path, dim_num: MDN | None) -> bool:
    """Decoupled weight decay: every Muon matrix, and the embedding / lm_head in the AdamW group."""
    return dim_num is not None or (bool(path) and path[-1] in ("embed", "lm_head"))


def group_table(model_or_state, *, per_head: bool = True) -> dict[Path, tuple[str, MDN | None, bool]]:
    """``{path: (group, dimension numbers, decayed)}`` for logging and tests."""
    out = {}
    for path, var in flat_params(model_or_state):
        dn = classify(path, axes_of(var), len(_shape_of(var)), per_head=per_head)
        out[path] = (ADAMW if dn is None else MUON, dn, _decays(path, dn))
    return out



def path_lookup(table: dict[Path, Any], what: str) -> Callable[[Any, Any], Any]:
    """A ``tree_map_with_path`` function reading ``table[path]``, with an error naming the parameter
    missing from the model the table was built for (``what``: the table's purpose)."""
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
    look = path_lookup(table, "gradient dtype")
    return jax.tree_util.tree_map_with_path(lambda path, x: x.astype(dtype) if look(path, x) else x, params)


__all__ = ["ADAMW", "MDN", "MUON", "axes_of", "cast_muon_group", "classify", "flat_params", "group_table",
           "muon_dimension_numbers", "normalize_path", "param_group", "path_lookup"]

"""Device meshes and logical-axis sharding rules.

Every parameter carries logical axis names (``out_sharding`` metadata, e.g. ``('layers', 'expert',
'expert_in', 'expert_mlp')``); a rule table maps each logical name to mesh axes, so a user changes a
layout in the config without touching model code. The first mesh axis of a rule that is still free in
that array is used (MaxText's convention), so ``embed -> fsdp`` can coexist with ``expert_in -> fsdp``.

Mesh axes: ``data`` (pure data parallelism), ``fsdp`` (data parallelism with parameters and optimizer
state sharded), ``expert`` (routed experts; also splits the batch), ``sequence`` (context) and
``tensor`` (heads / FFN width).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from k3jax.config import MeshConfig

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

# logical name -> candidate mesh axes (first free one wins; a tuple entry shards over several axes).
DEFAULT_RULES: tuple[tuple[str, tuple], ...] = (
    ("batch", (("data", "fsdp", "expert"),)),
    ("length", ("sequence",)),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("expert_in", ("fsdp",)),
    ("expert_mlp", ("tensor",)),
    ("layers", ()),
    ("head_dim", ()),
    ("q_lora", ()),
    ("kv_lora", ()),
    ("latent", ()),
    ("gate_rank", ()),
    ("conv", ()),
    ("norm", ()),
)


def make_mesh(cfg: MeshConfig, devices: Sequence | None = None) -> Mesh:
    """A mesh with axes ``MESH_AXES`` sized by the config (one ``-1`` fills the remaining devices)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [getattr(cfg, a) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if sizes.count(-1) > 1:
        raise ValueError("mesh: at most one axis may be -1")
    if -1 in sizes:
        if len(devices) % fixed:
            raise ValueError(f"mesh: {len(devices)} devices do not divide by the fixed axes' product {fixed}")
        sizes[sizes.index(-1)] = len(devices) // fixed
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], rules=DEFAULT_RULES, mesh: Mesh | None = None) -> P:
    """PartitionSpec of one array from its logical axis names."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in axes:
        chosen = None
        for cand in table.get(name, ()) if name is not None else ():
            group = cand if isinstance(cand, tuple) else (cand,)
            if mesh is not None:
                group = tuple(a for a in group if mesh.shape[a] > 1)
            if group and not used.intersection(group):
                chosen = group if len(group) > 1 else group[0]
                used.update(group)
                break
        out.append(chosen)
    return P(*out)


def _divisible(shape, spec: P, mesh: Mesh) -> P:
    """Drop shardings that do not divide the dimension (small test models on big meshes)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        size = math.prod(mesh.shape[a] for a in axes)
        out.append(entry if size and dim % size == 0 else None)
    return P(*out)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for every Variable of an NNX state, from its ``out_sharding`` names."""

    def one(var):
        value = var.get_raw_value() if isinstance(var, nnx.Variable) else var
        axes = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        spec = P() if not axes else _divisible(value.shape, logical_to_spec(axes, rules, mesh), mesh)
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
    """Place a model's variables on ``mesh`` according to the rules (in place; returns the model)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    values = jax.tree.map(lambda v: v.get_raw_value(), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    placed = jax.device_put(values, jax.tree.map(lambda s: s, shardings))
    nnx.update(model, placed)
    return model


def batch_sharding(mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
    """Sharding of ``[B, T]`` input arrays: batch over the data-like axes, length over ``sequence``."""
    return NamedSharding(mesh, logical_to_spec(("batch", "length"), rules, mesh))

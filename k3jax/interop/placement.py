"""Filling a model's (possibly sharded) device arrays from host blocks, one tensor at a time.

A leaf is placed whole with ``device_put`` or, when an HF tensor fills one slice of it (a scanned
layer, a routed expert), allocated as zeros on its sharding and written slice by slice with an
in-place, donated ``dynamic_update_slice``: host memory holds one tensor at a time, never a second
copy of the model.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.sharding import Rules, current_rules, logical_to_spec


def as_rules(rules: Mapping | Rules | None, mesh: jax.sharding.Mesh) -> Rules:
    """``from_hf``'s ``rules`` -> a :mod:`k3jax.sharding` rule table. None: the active table (``DEFAULT_RULES``
    outside ``axis_rules``: a serving layout's ``with layout.active()`` loads straight into it); a
    ``{logical: mesh axis, tuple of axes or None}`` mapping (or such pairs): one candidate per name. A mesh
    axis the mesh lacks is an error, not a silently replicated leaf."""
    if rules is None:
        return current_rules()
    pairs = rules.items() if isinstance(rules, Mapping) else rules
    table = []
    for name, target in pairs:
        if target is None:  # replicated
            table.append((name, ()))
            continue
        axes = target if isinstance(target, tuple) else (target,)
        bad = [a for a in axes if a not in mesh.shape]
        if bad:
            raise ValueError(f"sharding rule {name!r} -> {target!r}: mesh has no axis {bad[0]!r} "
                             f"(axes: {tuple(mesh.shape)})")
        table.append((name, (target,)))
    return tuple(table)


def placer_for(var: nnx.Variable, mesh: jax.sharding.Mesh | None, rules: Rules) -> Placer:
    """The placer of one (abstract) leaf, sharded by its logical axis names (``out_sharding``)."""
    sds = var.get_raw_value()
    axes = var.get_metadata().get("out_sharding")
    spec = None if mesh is None else logical_to_spec(axes, rules, mesh, sds.shape) if axes else jax.sharding.PartitionSpec()
    return Placer(sds.shape, sds.dtype, mesh, spec)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding):
    def update(arr, block, *idx):
        block = block.reshape((1,) * len(idx) + block.shape)
        # int32 throughout: a bare 0 would be int64 under jax_enable_x64, and the starts must share a type
        starts = [jnp.asarray(i, jnp.int32) for i in (*idx, *(0,) * (block.ndim - len(idx)))]
        return jax.lax.dynamic_update_slice(arr, block.astype(arr.dtype), starts)

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


class Placer:
    """Fills one leaf: whole (``device_put``) or slice by slice (in-place donated update)."""

    def __init__(self, shape, dtype, mesh, spec):
        self.shape, self.dtype = tuple(shape), jnp.dtype(dtype)
        self.mesh, self.spec = mesh, spec
        self.sharding = jax.sharding.NamedSharding(mesh, spec) if mesh is not None else None
        self.value = None

    def _block_sharding(self, n_idx):
        if self.mesh is None:
            return None
        rest = tuple(self.spec) + (None,) * (len(self.shape) - len(self.spec))
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*rest[n_idx:]))

    def put(self, index: tuple[int, ...], block: np.ndarray) -> None:
        block = np.asarray(block).astype(self.dtype, copy=False)
        if not index:
            self.value = jax.device_put(block, self.sharding) if self.sharding is not None else jnp.asarray(block)
            return
        if self.value is None:
            self.value = _zeros_fn(self.shape, self.dtype, self.sharding)()
        dev = jax.device_put(block, self._block_sharding(len(index))) if self.mesh is not None else block
        idx = [np.int32(i) for i in index]
        self.value = _update_fn(self.sharding)(self.value, dev, *idx)


class PackedPlacer:
    """A weight kept compressed (``k3jax.quant.storage.QuantizedWeight``: MXFP4, INT4, FP8): fills each
    of its storage variables (``parts``: name -> placer; HF orientation), each placed by its own logical axes."""

    def __init__(self, parts: dict[str, Placer]):
        self.parts = parts


__all__ = ["PackedPlacer", "Placer", "as_rules", "placer_for"]

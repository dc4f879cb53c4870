"""The mesh the model runs under, and how one array dimension splits over its axes.

Layers ask :func:`current_mesh` at trace time: it is the mesh of the enclosing ``jax.set_mesh``
(``None`` outside one, or inside a ``shard_map`` that already made an axis manual, where a nested
``shard_map`` over the same axes is not possible). The ``shard_map`` regions then split each
dimension over the axes that divide it, so odd batch sizes (one decode token, a batch of 1 on a
data-parallel mesh) still work: the dimension is simply replicated over the axes that do not fit.
Which axes a dimension may use comes from the rule table of ``k3jax.sharding`` (no axis is named here).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType


def current_mesh() -> jax.sharding.AbstractMesh | None:
    """The abstract mesh of the enclosing ``jax.set_mesh`` with more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    if any(t == AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis ``name`` (1 when the mesh lacks it or there is no mesh)."""
    return 1 if mesh is None else dict(mesh.shape).get(name, 1)


def split_axes(mesh, candidates, size: int) -> tuple[str, ...]:
    """The candidate axes (in order, sizes > 1) whose running product divides ``size``."""
    chosen, product = [], 1
    for name in candidates:
        n = axis_size(mesh, name)
        if n > 1 and size % (product * n) == 0:
            chosen.append(name)
            product *= n
    return tuple(chosen)


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for a dimension split over ``axes`` (None when unsplit)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes

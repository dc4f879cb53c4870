"""Walking a traced program: every equation of a jaxpr and of the jaxprs nested in it (scan, cond, remat,
custom VJPs, ``shard_map`` bodies), for the tests that check what a program holds."""

import jax


def sub_jaxprs(eqn):
    """The jaxprs nested in one equation's parameters."""
    for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jax.extend.core.Jaxpr):
                yield sub


def equations(jaxpr, inside_shard_map: bool = False):
    """``(eqn, inside_shard_map)`` for every equation of ``jaxpr`` and its nested jaxprs, with whether it runs
    inside a ``shard_map`` body (a per-shard program: its values are one shard's)."""
    for eqn in jaxpr.eqns:
        yield eqn, inside_shard_map
        nested = inside_shard_map or eqn.primitive.name == "shard_map"
        for sub in sub_jaxprs(eqn):
            yield from equations(sub, nested)


def shard_map_avals(jaxpr) -> list:
    """The abstract values (shape, dtype) of everything the ``shard_map`` bodies in ``jaxpr`` produce."""
    return [v.aval for eqn, inside in equations(jaxpr) if inside for v in eqn.outvars if hasattr(v.aval, "shape")]

"""The leaves of a k3jax model as the HF interop sees them: every ``nnx.Variable`` by its path, with
an MXFP4-packed expert weight (``packed`` + ``scale`` variables) read as one dense-shaped leaf."""

from __future__ import annotations

from flax import nnx

from k3jax.interop import mxfp4

Path = tuple  # a path of attribute names / list indices into the model graph


def model_variables(model) -> dict[Path, nnx.Variable]:
    return {tuple(p): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}


def packed_parts(variables: dict[Path, nnx.Variable], leaf: Path) -> tuple[nnx.Variable, nnx.Variable] | None:
    """The (packed, scale) variables of an ``MXFP4Weight`` at ``leaf``, or None for a dense leaf."""
    packed, scale = variables.get(leaf + ("packed",)), variables.get(leaf + ("scale",))
    return None if packed is None or scale is None else (packed, scale)


def logical_shape(variables: dict[Path, nnx.Variable], leaf: Path) -> tuple[int, ...]:
    """The dense k3jax shape of ``leaf`` (``(..., in, out)`` for a packed weight)."""
    parts = packed_parts(variables, leaf)
    if parts is None:
        return tuple(variables[leaf].get_raw_value().shape)
    return mxfp4.PackedMXFP4(parts[0].get_raw_value(), parts[1].get_raw_value()).logical_shape


__all__ = ["Path", "logical_shape", "model_variables", "packed_parts"]

"""Device-varying types inside ``jax.shard_map``, the one rule both the kernels and ``k3jax.ops`` follow:
a value's type names the manual mesh axes it varies over, a ``custom_vjp`` must return cotangents of its
inputs' types, and a loop's carry must keep one type. Public and at the bottom of the import graph (it
needs only jax), so that ``k3jax`` can use it without the kernels importing anything from above."""

import jax


def out_struct(shape, dtype, like):
    """A kernel's ``out_shape``: varying over the same manual mesh axes as ``like`` (an operand), so the
    kernel can run inside ``jax.shard_map`` with its type checks on (a no-op outside one)."""
    mat = getattr(jax.typeof(like), "mat", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def match_varying(x, like):
    """``x`` made device-varying over the manual mesh axes ``like`` varies over (inside ``jax.shard_map``;
    a no-op elsewhere). A ``custom_vjp`` must return cotangents of its inputs' types, so a weight shared
    by all devices is made varying *before* the kernel and JAX sums its gradient over the devices."""
    missing = tuple(sorted(_varying_axes(like) - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying_axes(x) -> set:
    t = jax.typeof(x)
    mat = getattr(t, "mat", None)  # jax 0.10: ManualAxisType(varying=...); later releases: .vma
    return set(mat.varying) if mat is not None else set(getattr(t, "vma", ()))

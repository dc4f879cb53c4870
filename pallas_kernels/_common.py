"""Shared helpers: backend / interpret resolution and small utilities for the Pallas kernels."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

HIGHEST = jax.lax.Precision.HIGHEST


def target_platform():
    """The platform the program is built for: that of the current mesh (``jax.set_mesh``; also inside
    ``shard_map`` and during AOT compilation for a TPU topology on a CPU host), else the default backend."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        device = getattr(mesh, "abstract_device", None)
        if device is not None and not mesh.empty:
            return device.platform
    except Exception:  # no mesh API / no mesh set
        pass
    return jax.default_backend()


def resolve(interpret, backend):
    """Return ``(interpret_arg, backend)`` for ``pl.pallas_call``.

    backend: ``"tpu"`` (Mosaic TPU), ``"gpu"`` or None (the target platform's; on CPU the TPU kernel
    is interpreted). interpret: None = interpret when the target platform (``target_platform``) is
    neither a TPU nor a GPU; True = the generic Pallas interpreter; a ``pltpu.InterpretParams`` is
    passed through (TPU-semantics interpreter: simulated VMEM/DMA, NaN-filled scratch).
    """
    platform = target_platform()
    if backend is None:
        backend = "gpu" if platform in ("gpu", "cuda", "rocm") else "tpu"
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"backend must be 'tpu', 'gpu' or None, got {backend!r}")
    if interpret is None:
        interpret = platform not in ("tpu", "gpu", "cuda", "rocm")
    return interpret, backend


def compiler_params(backend, dimension_semantics):
    if backend != "tpu":
        raise NotImplementedError(f"no {backend} lowering for these kernels yet")
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


BF16_3X = "bf16_3x"


def mm(a, b, *, trans_a=False, trans_b=False, precision=None):
    """2-D matmul with float32 accumulation: ``op(a) @ op(b)``, ``op`` = optional transpose.

    Operands keep their dtype (bf16 goes to the MXU as bf16); float32 operands use HIGHEST precision
    unless told otherwise, so TPU/GPU do not round them to bf16/TF32. ``precision="bf16_3x"`` splits
    fp32 operands into bf16 high and low parts and sums three bf16 products (about 2^-16 relative error,
    half the MXU passes of HIGHEST; Mosaic has no Precision.HIGH).
    """
    if precision == BF16_3X:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        a_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16)
        b_lo = (b - b_hi.astype(jnp.float32)).astype(jnp.bfloat16)
        f = lambda x, y: mm(x, y, trans_a=trans_a, trans_b=trans_b)
        return f(a_hi, b_hi) + (f(a_hi, b_lo) + f(a_lo, b_hi))
    ca = 0 if trans_a else 1
    cb = 1 if trans_b else 0
    if precision is None and (a.dtype == jnp.float32 or b.dtype == jnp.float32):
        precision = HIGHEST
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

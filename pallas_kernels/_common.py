"""Small shared pieces of the Pallas kernels: compiler parameters, block sizes, matmul precision (the
backend / interpret rule is ``pallas_kernels.platform.resolve_backend``; manual-axis typing is
``pallas_kernels.varying``)."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

HIGHEST = jax.lax.Precision.HIGHEST


def compiler_params(backend, dimension_semantics):
    """Mosaic TPU compiler parameters (the GPU kernels use ``triton_params``)."""
    if backend != "tpu":
        raise NotImplementedError(f"compiler_params is for the TPU kernels; the {backend} kernels use triton_params")
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


def triton_params(num_warps, num_stages):
    """Pallas Triton compiler parameters: passing them makes ``pl.pallas_call`` lower to Triton on GPU (the
    default GPU lowering of jax 0.10.2 is Mosaic GPU, which these kernels are not written for)."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_pow2(n, minimum=1):
    """Smallest power of two >= max(n, minimum) (Triton blocks are powers of two)."""
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


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

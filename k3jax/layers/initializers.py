"""Parameter factories: every weight carries its logical axis names (``out_sharding`` metadata).

Logical names used across k3jax (mapped to mesh axes by the sharding rules):
``vocab, embed, heads, head_dim, q_lora, kv_lora, latent, mlp, expert, expert_in, expert_mlp, conv,
norm, gate_rank``; stacked (scanned) layers get ``layers`` prepended.

Random values are drawn on the host with NumPy when the key is concrete (eager initialisation):
XLA:CPU needs tens of seconds to compile a program with a few hundred threefry samplers, NumPy
needs milliseconds. Under a trace (``jax.eval_shape``, a jitted sharded init) ``jax.random`` is used;
both give the same distributions, not the same numbers.
"""

import contextlib
import contextvars
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax.ops.weight_cast import weight_cast
from k3jax.quant.storage import QuantizedWeight
from k3jax.sharding import gather_weight


class RouterBias(nnx.Variable):
    """Selection-only balancing bias of a MoE router: state, not a trainable parameter."""


_ABSTRACT = contextvars.ContextVar("k3jax_abstract_init", default=False)


@contextlib.contextmanager
def abstract_init():
    """Within this context parameters are ``jax.ShapeDtypeStruct``s: shapes, dtypes and axis names
    without allocating or tracing anything (tracing a 93-layer init costs minutes in flax's
    variable bookkeeping; building the structure directly takes a second)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def param(shape: tuple[int, ...], axes: tuple[str | None, ...], dtype, make: Callable[[], jax.Array],
          kind: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    """A variable whose value is ``make()`` (or just its shape under ``abstract_init``)."""
    assert len(shape) == len(axes), (shape, axes)
    if _ABSTRACT.get():
        return kind(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), out_sharding=axes)
    value = make()
    assert value.shape == tuple(shape), (value.shape, shape)
    return kind(value.astype(dtype), out_sharding=axes)


def _host_rng(key: jax.Array) -> np.random.Generator:
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())


def _is_traced(key: jax.Array) -> bool:
    return isinstance(key, jax.core.Tracer)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float,
           dtype) -> nnx.Param:
    def make():
        key = rngs.params()
        if _is_traced(key):
            return std * jax.random.normal(key, shape, jnp.float32)
        return jnp.asarray(std * _host_rng(key).standard_normal(shape, dtype=np.float32))

    return param(shape, axes, dtype, make)


def uniform(rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float) -> jax.Array:
    """A float32 array drawn from U(low, high) (for gate constants)."""
    key = rngs.params()
    if _is_traced(key):
        return jax.random.uniform(key, shape, jnp.float32, low, high)
    return jnp.asarray(_host_rng(key).uniform(low, high, shape).astype(np.float32))


def constant(value: float, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype,
             kind: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    return param(shape, axes, dtype, lambda: jnp.full(shape, value, dtype), kind)


def cast(p: nnx.Variable | QuantizedWeight, dtype) -> jax.Array:
    """A parameter's value in the compute dtype (params are stored in ``param_dtype``; the cast is
    ``k3jax.ops.weight_cast``, which XLA keeps inside the layer loop), gathered over the FSDP mesh axes
    when running under a mesh (``k3jax.sharding.gather_weight``). A compressed weight
    (``k3jax.quant.storage.QuantizedWeight``: MXFP4, INT4, FP8) is dequantized to ``dtype`` first."""
    if isinstance(p, QuantizedWeight):
        return gather_weight(p.dequantize(dtype), p.axes)
    return gather_weight(weight_cast(p[...], dtype), p.get_metadata().get("out_sharding"))

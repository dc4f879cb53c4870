"""Weights held below float32: weight decay and AdamW statistics in float32, stochastic rounding of
the updated weights (``model.param_dtype=bfloat16``, ``train.optim.weight_rounding``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def decayed_weights_in_float32(weight_decay: float) -> optax.GradientTransformation:
    """``u + weight_decay * w`` in float32 (``optax.add_decayed_weights`` computes ``weight_decay * w`` in
    the weights' dtype: for bf16 weights, a rounded decay)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the parameters")
        return jax.tree.map(lambda u, w: u.astype(jnp.float32) + weight_decay * w.astype(jnp.float32),
                            updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def float32_statistics(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` run on float32 copies of the parameters and gradients: its statistics (AdamW's moments)
    and updates are float32 whatever the weights' dtype (optax keeps them in the parameters' dtype, so
    bf16 weights would get bf16 second moments). A no-op for float32 weights."""

    def up(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update_fn(updates, state, params=None):
        return tx.update(up(updates), state, None if params is None else up(params))

    return optax.GradientTransformation(lambda params: tx.init(up(params)), update_fn)


def stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype`` (bfloat16) up or down at random, with the probability of
    rounding up equal to the dropped fraction of the gap: ``E[round(x)] = x`` (unbiased), so updates
    far below a bf16 weight's spacing still move it on average. A random 16-bit integer is added to
    the float32 bits below bf16's mantissa, then those bits are cut (the sign is apart, so this
    rounds the magnitude, hence the value, without bias)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"stochastic rounding is to bfloat16, not {jnp.dtype(dtype).name}")
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(dtype)


class RoundingState(NamedTuple):
    count: jax.Array  # int32 scalar: the updates rounded so far (each draws new bits)


def stochastic_weight_rounding(seed: int) -> optax.GradientTransformation:
    """The last step of the chain for weights held below float32 (``model.param_dtype=bfloat16``,
    ``train.optim.weight_rounding=stochastic``). ``optax.apply_updates`` computes ``w + u`` in float32
    and rounds it to the weight's dtype to the nearest value, which drops an update under half the
    weight's spacing (2^-9 of it in bf16). This returns ``u' = SR(w + u) - w`` instead (float32; exact,
    both terms being bf16 values of close magnitude), so the weight becomes :func:`stochastic_round` of
    the float32 sum: unbiased, with bits drawn from ``seed``, the update count and the leaf. Float32
    weights pass unchanged."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("stochastic rounding of the weights needs the parameters")
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(updates)
        ws = treedef.flatten_up_to(params)
        out = []
        for i, (u, w) in enumerate(zip(leaves, ws)):
            if jnp.dtype(w.dtype) == jnp.float32 or not jnp.issubdtype(w.dtype, jnp.floating):
                out.append(u)
                continue
            w32 = w.astype(jnp.float32)
            rounded = stochastic_round(w32 + u.astype(jnp.float32), w.dtype, jax.random.fold_in(key, i))
            out.append(rounded.astype(jnp.float32) - w32)
        return jax.tree.unflatten(treedef, out), RoundingState(optax.safe_increment(state.count))

    return optax.GradientTransformation(lambda params: RoundingState(jnp.zeros([], jnp.int32)), update_fn)


__all__ = ["RoundingState", "decayed_weights_in_float32", "float32_statistics", "stochastic_round",
           "stochastic_weight_rounding"]

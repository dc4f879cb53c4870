"""Per-row sampling for a batch of unrelated requests: each row has its own temperature, top-p and
random key (``k3jax.inference.sampling.sample_logits`` takes one setting for the whole batch, as ``generate``
needs). Row for row the same rule: greedy at temperature 0, else temperature, then the nucleus
(``k3jax.inference.sampling.nucleus``)."""

import jax
import jax.numpy as jnp

from k3jax.inference.sampling import nucleus


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits ``[B, V]``, keys ``[B]`` (typed PRNG keys), temperature ``[B]`` (0 = greedy), top_p
    ``[B]`` in (0, 1] -> tokens ``[B]`` int32. A row with temperature t and top-p p draws what
    ``sample_logits(logits[r:r+1], keys[r], temperature=t, top_p=p)`` draws."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # the sort of the nucleus costs more than the step's argmax: skipped when every row is greedy
    return jax.lax.cond(jnp.any(temperature > 0), _draw, lambda *args: args[-1], logits, keys, temperature, top_p, greedy)


def _draw(logits, keys, temperature, top_p, greedy):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    kept = nucleus(scaled, top_p[:, None])
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row[None], axis=-1)[0])(keys, kept)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)

"""Token sampling: greedy, temperature, top-k and top-p (nucleus), all inside jit. The nucleus rule
(:func:`nucleus`) lives here once; the server's per-row sampler (``k3jax.serving.sampling``) uses it."""

import jax
import jax.numpy as jnp


def sample_logits(logits: jax.Array, key: jax.Array, *, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
    """One token per row of ``logits [B, V]`` (float32) -> ``[B]`` int32.

    ``temperature == 0`` is greedy (argmax; top-k / top-p are then irrelevant). Otherwise logits are
    divided by the temperature, restricted to the ``top_k`` largest and to the smallest set whose
    probability mass reaches ``top_p``, and sampled.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        logits = nucleus(logits, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def nucleus(logits: jax.Array, top_p) -> jax.Array:
    """The nucleus (top-p) rule: logits ``[..., V]`` (float32, temperature applied) with every token
    outside the smallest set whose probability mass reaches ``top_p`` set to ``-inf``. ``top_p``: a
    float, or an array broadcasting against ``[..., 1]`` (one value per row); ``top_p >= 1`` keeps
    every token (rounding in the cumulative sum cannot cut the tail)."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the top token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p < 1.0) & (logits < cutoff), -jnp.inf, logits)

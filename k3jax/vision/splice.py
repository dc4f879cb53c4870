"""Image features into the token stream: the LM embeds text and overwrites ``<|media_pad|>`` positions.

Row b's j-th ``<|media_pad|>`` token (in sequence order) takes row b's j-th projected image token,
which is how the release splices them (sglang ``general_mm_embed_routine``, HF ``masked_scatter``),
done per row so that batch rows (and gradient-accumulation micro-batches) stay independent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def splice_image_features(x: jax.Array, tokens: jax.Array, features: jax.Array, pad_id: int) -> jax.Array:
    """x ``[B, T, d]`` token embeddings, tokens ``[B, T]``, features ``[B, M, d]`` -> ``[B, T, d]``.

    Placeholders beyond a row's M features (a caller error) read the last feature; features beyond
    the row's placeholders (packing slack) are unused. Differentiable in ``features``.
    """
    is_pad = tokens == pad_id
    index = jnp.clip(jnp.cumsum(is_pad, axis=1, dtype=jnp.int32) - 1, 0, features.shape[1] - 1)
    gathered = jnp.take_along_axis(features, index[..., None], axis=1)
    return jnp.where(is_pad[..., None], gathered.astype(x.dtype), x)


__all__ = ["splice_image_features"]

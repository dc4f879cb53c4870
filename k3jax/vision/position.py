"""Where a patch is: the resampled learned position table and the 2-D RoPE of MoonViT.

Both are per-patch functions of (row, col) in the image's patch grid and the grid size (h, w), so
images of different sizes packed into one sequence need no per-image loop: the host supplies those
four integers per patch (``k3jax.vision.inputs``) and everything here is elementwise + a gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Keys' cubic convolution constant used by torch's bicubic F.interpolate (and PIL's BICUBIC).
_CUBIC_A = -0.75


def _axis_taps(index: jax.Array, size: jax.Array, side: int, mode: str) -> tuple[jax.Array, jax.Array]:
    """Source taps and weights of one axis of ``F.interpolate(mode, align_corners=False)`` resizing a
    ``side``-long table to ``size``: index, size ``[P]`` int -> (taps ``[P, n]`` int, weights ``[P, n]``
    float32), n = 2 (bilinear) or 4 (bicubic). Taps outside the table are clamped to its border, which
    is what torch does (for bilinear it clamps the source coordinate at 0 instead; the border clamp
    gives the same value)."""
    src = (index.astype(jnp.float32) + 0.5) * side / size.astype(jnp.float32) - 0.5
    floor = jnp.floor(src)
    offsets = jnp.arange(2) if mode == "bilinear" else jnp.arange(-1, 3)
    taps = floor.astype(jnp.int32)[:, None] + offsets
    distance = jnp.abs(src[:, None] - taps.astype(jnp.float32))
    if mode == "bilinear":
        weights = jnp.maximum(1.0 - distance, 0.0)
    else:
        a = _CUBIC_A
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
        weights = jnp.where(distance <= 1, near, far)
    return jnp.clip(taps, 0, side - 1), weights


def resample_position_table(table: jax.Array, rows: jax.Array, cols: jax.Array, heights: jax.Array,
                            widths: jax.Array, mode: str) -> jax.Array:
    """The learned table ``[S, S, D]`` resized to each patch's image grid and read at its position.

    rows, cols, heights, widths ``[...]`` int (the patch's (row, col) and its image's grid (h, w))
    -> ``[..., D]`` float32. Equals ``F.interpolate(table, (h, w), mode, align_corners=False)[row, col]``
    (an identity when (h, w) == (S, S)), computed separably as a weighted gather of n x n taps.
    """
    side = table.shape[0]
    shape = rows.shape
    flat = lambda a: a.reshape(-1)  # noqa: E731
    h_taps, h_w = _axis_taps(flat(rows), flat(heights), side, mode)
    w_taps, w_w = _axis_taps(flat(cols), flat(widths), side, mode)
    gathered = table.astype(jnp.float32)[h_taps[:, :, None], w_taps[:, None, :]]  # [P, n, n, D]
    out = jnp.einsum("pijd,pi,pj->pd", gathered, h_w, w_w)
    return out.reshape(shape + (table.shape[-1],))


def rope2d_angles(rows: jax.Array, cols: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """Rotation angles ``[..., head_dim / 2]`` (float32) of the 2-D RoPE, one per complex pair.

    Frequencies ``f_i = theta^(-4 i / head_dim)``, i < head_dim / 4; pair ``2i`` turns by
    ``col * f_i`` and pair ``2i + 1`` by ``row * f_i`` (the release's ``Rope2DPosEmbRepeated``; its
    docstring swaps the axis names, the code does this).
    """
    # float32 frequencies: positions go up to 512 per side, bf16 angles would be off by whole turns
    freqs = theta ** (-4.0 * jnp.arange(head_dim // 4, dtype=jnp.float32) / head_dim)
    col = cols.astype(jnp.float32)[..., None] * freqs
    row = rows.astype(jnp.float32)[..., None] * freqs
    return jnp.stack([col, row], axis=-1).reshape(rows.shape + (head_dim // 2,))


def apply_rope2d(x: jax.Array, angles: jax.Array) -> jax.Array:
    """Rotate adjacent pairs ``(x[2j], x[2j+1])`` by ``angles[j]`` (``view_as_complex`` layout).

    x ``[..., P, H, K]``, angles ``[..., P, K/2]`` -> ``[..., P, H, K]`` in x's dtype (computed in
    float32). HF transformers' ``kimi_k25`` permutes q/k weights to the half-split layout instead
    (``PermuteForRope``); the attention scores are the same.
    """
    xf = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    a, b = xf[..., 0], xf[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


__all__ = ["apply_rope2d", "resample_position_table", "rope2d_angles"]

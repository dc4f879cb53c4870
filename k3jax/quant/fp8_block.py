"""DeepSeek-style block-scaled FP8 weights (Kimi K2 / DeepSeek-V3 ``quant_method: fp8``), in JAX.

For a torch-orientation weight ``W [..., out, in]`` and ``weight_block_size [bo, bi]`` (K2: 128 x 128):
``weight`` ``float8_e4m3fn [..., out, in]`` and ``weight_scale_inv`` float32 ``[..., ceil(out / bo),
ceil(in / bi)]``, one factor per tile (edge tiles partial): ``W = weight * scale_inv[o // bo, i // bi]``.
The quantizer of the DeepSeek release: ``scale_inv = amax(tile) / 448`` (E4M3's largest value), the
elements ``W / scale_inv`` rounded to E4M3.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from k3jax.quant.storage import QuantizedStorage, QuantizedWeight, swap_last

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Torch-orientation ``[..., out, in]`` -> the ``weight_scale_inv`` shape ``[..., ceil(out/bo), ceil(in/bi)]``."""
    *lead, n_out, n_in = shape
    return (*lead, math.ceil(n_out / block[0]), math.ceil(n_in / block[1]))


def _expand(scale: jax.Array, shape: tuple[int, ...], block: tuple[int, int]) -> jax.Array:
    """Per-tile factors ``[..., ceil(out/bo), ceil(in/bi)]`` -> per element ``[..., out, in]``."""
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return full[..., : shape[-2], : shape[-1]]


def dequantize_fp8_block(weight: jax.Array, scale_inv: jax.Array, block: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """``weight`` float8 ``[..., out, in]`` + ``scale_inv [..., ceil(out/bo), ceil(in/bi)]`` -> ``W`` in ``dtype``."""
    if scale_inv.shape != scale_shape(weight.shape, block):
        raise ValueError(f"FP8 block scales {scale_inv.shape} do not fit weight {weight.shape} with blocks {block} "
                         f"(expected {scale_shape(weight.shape, block)})")
    w = weight.astype(jnp.float32) * _expand(scale_inv.astype(jnp.float32), weight.shape, block)
    return w.astype(dtype)


def quantize_fp8_block(w: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """``W [..., out, in]`` -> (``float8_e4m3fn [..., out, in]``, float32 ``scale_inv``); a zero tile gets scale 1."""
    *lead, n_out, n_in = w.shape
    bo, bi = block
    po, pi = -n_out % bo, -n_in % bi
    padded = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, po), (0, pi)])
    tiles = padded.reshape(*lead, (n_out + po) // bo, bo, (n_in + pi) // bi, bi)
    amax = jnp.max(jnp.abs(tiles), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    elements = (w.astype(jnp.float32) / _expand(scale, w.shape, block)).astype(jnp.float8_e4m3fn)
    return elements, scale


class FP8BlockWeight(QuantizedWeight):
    """A weight ``W (..., in, out)`` held as block-scaled FP8: ``weight (..., out, in)`` float8_e4m3fn and
    ``scale_inv (..., ceil(out/bo), ceil(in/bi))`` float32 (:class:`QuantizedStorage`, torch orientation
    like the checkpoint, so the tiles are the release's)."""

    def __init__(self, weight, scale_inv, block: tuple[int, int], axes: tuple[str | None, ...] | None = None):
        self.block = (int(block[0]), int(block[1]))
        self.axes = None if axes is None else tuple(axes)
        meta = {} if axes is None else {"out_sharding": swap_last(self.axes)}
        self.weight = QuantizedStorage(weight, **meta)
        self.scale_inv = QuantizedStorage(scale_inv, **meta)

    @classmethod
    def from_dense(cls, w: jax.Array, block: tuple[int, int], axes=None) -> "FP8BlockWeight":
        """Quantize a dense ``w (..., in, out)`` (concrete or traced)."""
        return cls(*quantize_fp8_block(jnp.swapaxes(w, -1, -2), block), block, axes)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], block: tuple[int, int], axes=None) -> "FP8BlockWeight":
        *lead, n_in, n_out = shape
        torch_shape = (*lead, n_out, n_in)
        return cls(jax.ShapeDtypeStruct(torch_shape, jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct(scale_shape(torch_shape, block), jnp.float32), block, axes)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n_out, n_in = self.weight.get_raw_value().shape
        return (*lead, n_in, n_out)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return jnp.swapaxes(dequantize_fp8_block(self.weight[...], self.scale_inv[...], self.block, dtype), -1, -2)


__all__ = ["E4M3_MAX", "FP8BlockWeight", "dequantize_fp8_block", "quantize_fp8_block", "scale_shape"]

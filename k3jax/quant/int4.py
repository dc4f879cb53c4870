"""Symmetric group-wise INT4 weights in the compressed-tensors ``pack-quantized`` layout (Kimi K2
Thinking's routed experts), in JAX: the device side of the format.

The layout, for a torch-orientation weight ``W [..., out, in]`` with groups of ``G`` input columns:

- ``weight_packed`` int32 ``[..., out, ceil(in / 8)]``: eight signed 4-bit values per word, stored
  offset-binary (``q + 8``, 0..15); element ``8 j + k`` of a row sits in bits ``4 k .. 4 k + 3`` of
  word ``j`` (the first element in the lowest nibble);
- ``weight_scale`` ``[..., out, in / G]`` (bfloat16 in the releases): one scale per group, no zero
  point (``symmetric``);
- ``weight_shape`` int ``[2]``: ``(out, in)``.

``W[o, i] = q[o, i] * scale[o, i // G]``. compressed-tensors' scale rule for a group whose largest
magnitude is ``amax`` is ``amax / 7.5`` (half the range -8..7), and ``q = clamp(round_half_even(W /
scale), -8, 7)``. The host codec of the HF interop (``k3jax.interop.compressed_tensors``, NumPy) takes
the layout's constants from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.quant.storage import QuantizedStorage, QuantizedWeight, swap_last

BITS = 4
PER_WORD = 32 // BITS  # values per int32 word
OFFSET = 1 << (BITS - 1)  # stored = q + OFFSET
Q_MIN, Q_MAX = -OFFSET, OFFSET - 1
HALF_RANGE = (Q_MAX - Q_MIN) / 2  # compressed-tensors' symmetric scale: amax / HALF_RANGE


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 ``[..., W]`` -> the signed values int8 ``[..., 8 W]`` (element ``8 j + k`` from word ``j``'s
    nibble ``k``)."""
    words = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    shifts = jnp.arange(PER_WORD, dtype=jnp.uint32) * BITS
    nibbles = (words[..., None] >> shifts) & jnp.uint32((1 << BITS) - 1)
    return (nibbles.astype(jnp.int8) - OFFSET).reshape(*packed.shape[:-1], packed.shape[-1] * PER_WORD)


def pack_int4(q: jax.Array) -> jax.Array:
    """Signed values ``[..., n]`` (n a multiple of 8, in [-8, 7]) -> int32 ``[..., n / 8]``."""
    n = q.shape[-1]
    if n % PER_WORD:
        raise ValueError(f"INT4 packing needs the last dimension to be a multiple of {PER_WORD}, got {n}")
    nibbles = (q.astype(jnp.int32) + OFFSET).astype(jnp.uint32).reshape(*q.shape[:-1], n // PER_WORD, PER_WORD)
    words = jnp.sum(nibbles << (jnp.arange(PER_WORD, dtype=jnp.uint32) * BITS), axis=-1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def dequantize_int4(packed: jax.Array, scale: jax.Array, group_size: int, dtype=jnp.float32) -> jax.Array:
    """``packed`` int32 ``[..., out, in/8]`` + ``scale [..., out, in/G]`` -> ``W [..., out, in]`` in
    ``dtype`` (computed in float32: every INT4 value times a bfloat16 scale is exact there)."""
    n_in = scale.shape[-1] * group_size
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * PER_WORD != n_in:
        raise ValueError(f"INT4 shapes disagree: packed {packed.shape} ({PER_WORD} values per word) vs scale "
                         f"{scale.shape} with group size {group_size}")
    q = unpack_int4(packed).astype(jnp.float32).reshape(*scale.shape, group_size)
    return (q * scale.astype(jnp.float32)[..., None]).reshape(*scale.shape[:-1], n_in).astype(dtype)


def quantize_int4(w: jax.Array, group_size: int, scale_dtype) -> tuple[jax.Array, jax.Array]:
    """``W [..., out, in]`` -> (``packed`` int32 ``[..., out, in/8]``, ``scale [..., out, in/G]`` in
    ``scale_dtype``) with compressed-tensors' symmetric rule (module docstring); the values are
    rounded against the stored (``scale_dtype``) scale."""
    n_in = w.shape[-1]
    if n_in % group_size or group_size % PER_WORD:
        raise ValueError(f"INT4 groups: the input dimension ({n_in}) must be a multiple of the group size "
                         f"({group_size}), itself a multiple of {PER_WORD}")
    groups = w.astype(jnp.float32).reshape(*w.shape[:-1], n_in // group_size, group_size)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = (amax / HALF_RANGE).astype(scale_dtype)
    safe = jnp.where(scale == 0, jnp.ones_like(scale), scale).astype(jnp.float32)  # a zero group stays zero
    q = jnp.clip(jnp.round(groups / safe[..., None]), Q_MIN, Q_MAX).reshape(w.shape)
    return pack_int4(q), scale


def int4_shapes(shape: tuple[int, ...], group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Dense ``(..., in, out)`` -> (packed ``(..., out, in/8)``, scale ``(..., out, in/G)``)."""
    *lead, n_in, n_out = shape
    if n_in % group_size or group_size % PER_WORD:
        raise ValueError(f"INT4 weight of shape {shape}: the input dimension must be a multiple of the group "
                         f"size {group_size}, itself a multiple of {PER_WORD}")
    return (*lead, n_out, n_in // PER_WORD), (*lead, n_out, n_in // group_size)


class Int4Weight(QuantizedWeight):
    """A weight ``W (..., in, out)`` held as compressed-tensors INT4: ``packed (..., out, in/8)`` int32
    and ``scale (..., out, in/G)`` (:class:`QuantizedStorage`, torch orientation like the checkpoint)."""

    def __init__(self, packed, scale, group_size: int, axes: tuple[str | None, ...] | None = None):
        self.group_size = int(group_size)
        self.axes = None if axes is None else tuple(axes)
        meta = {} if axes is None else {"out_sharding": swap_last(self.axes)}
        self.packed = QuantizedStorage(packed, **meta)
        self.scale = QuantizedStorage(scale, **meta)

    @classmethod
    def from_dense(cls, w: jax.Array, group_size: int, scale_dtype, axes=None) -> "Int4Weight":
        """Quantize a dense ``w (..., in, out)`` (concrete or traced)."""
        packed, scale = quantize_int4(jnp.swapaxes(w, -1, -2), group_size, scale_dtype)
        return cls(packed, scale, group_size, axes)

    @classmethod
    def abstract(cls, shape: tuple[int, ...], group_size: int, scale_dtype, axes=None) -> "Int4Weight":
        p, s = int4_shapes(tuple(shape), group_size)
        return cls(jax.ShapeDtypeStruct(p, jnp.int32), jax.ShapeDtypeStruct(s, jnp.dtype(scale_dtype)), group_size,
                   axes)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n_out, n_groups = self.scale.get_raw_value().shape
        return (*lead, n_groups * self.group_size, n_out)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return jnp.swapaxes(dequantize_int4(self.packed[...], self.scale[...], self.group_size, dtype), -1, -2)


__all__ = ["BITS", "HALF_RANGE", "Int4Weight", "OFFSET", "PER_WORD", "Q_MAX", "Q_MIN", "dequantize_int4", "int4_shapes",
           "pack_int4", "quantize_int4", "unpack_int4"]

"""compressed-tensors ``pack-quantized`` INT4 checkpoints (Kimi K2 Thinking's routed experts): the
``quantization_config`` and the host-side (NumPy) codec of the HF interop.

The layout (``k3jax.quant.int4`` holds its constants and the JAX side): per quantized ``nn.Linear``
``<module>.weight_packed`` int32 ``[out, ceil(in / 8)]`` (eight offset-binary 4-bit values per word,
the first in the lowest nibble), ``<module>.weight_scale`` ``[out, in / G]`` (bfloat16 in the
releases) and ``<module>.weight_shape`` ``[out, in]``; ``W = q * scale`` per group of ``G`` inputs,
symmetric (no zero point).

Which modules are quantized follows the config's ``config_groups.*.targets`` minus ``ignore``, with
compressed-tensors' matching rule: an entry ``re:<pattern>`` matches a module name by ``re.match``,
any other entry matches the name exactly or is a module class name (``Linear``: every projection).
K2 Thinking: targets ``["Linear"]``, ignore ``lm_head``, attention, shared experts and the dense
MLPs: the routed experts are INT4, everything else bfloat16. A packed tensor for an ignored module
is refused; a dense tensor for a targeted one is taken as it is (routers are not ``nn.Linear``).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from k3jax.quant.int4 import BITS, OFFSET, PER_WORD

FORMAT = "pack-quantized"
CLASS_TARGETS = ("Linear",)  # class-name targets; every weight the interop maps is an nn.Linear's or not quantized


class CompressedTensorsError(ValueError):
    """A compressed-tensors config or tensor k3jax cannot read; the message names the field or tensor."""


@dataclasses.dataclass(frozen=True)
class PackQuantized:
    """What k3jax needs of a ``pack-quantized`` INT4 ``quantization_config``."""

    group_size: int
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def quantizes(self, module: str) -> bool:
        """Whether the config quantizes the module named ``module`` (``...experts.3.w1``, no ``.weight``)."""
        targeted = any(t in CLASS_TARGETS or _matches(module, t) for t in self.targets)
        return targeted and not self.ignored_by(module)

    def ignored_by(self, module: str) -> str | None:
        """The ``ignore`` entry naming ``module``, or None."""
        return next((i for i in self.ignore if _matches(module, i)), None)


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def parse_config(q: dict) -> PackQuantized:
    """A ``quant_method: compressed-tensors, format: pack-quantized`` config -> :class:`PackQuantized`.
    Refuses (naming the field) anything but symmetric group-wise 4-bit integer weights with one group
    size, and activation quantization (k3jax computes the matmul in the compute dtype)."""
    groups = q.get("config_groups") or {}
    if not groups:
        raise CompressedTensorsError("quantization_config.config_groups: empty (no quantized weights described)")
    sizes, targets = set(), []
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if group.get("format") not in (None, FORMAT):
            raise CompressedTensorsError(f"{where}.format: {group.get('format')!r}; only {FORMAT!r} is supported")
        w = group.get("weights") or {}
        want = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group"}
        for key, value in want.items():
            if w.get(key) != value:
                raise CompressedTensorsError(f"{where}.weights.{key}: {w.get(key)!r}; only {value!r} is supported "
                                             f"(symmetric group-wise INT{BITS})")
        if w.get("dynamic"):
            raise CompressedTensorsError(f"{where}.weights.dynamic: true; only static weight scales are supported")
        size = w.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise CompressedTensorsError(f"{where}.weights.group_size: {size!r}; must be a positive integer")
        sizes.add(size)
        for key in ("input_activations", "output_activations"):
            if group.get(key) is not None:
                raise CompressedTensorsError(f"{where}.{key}: activation quantization is not supported")
        targets += list(group.get("targets") or [])
    if len(sizes) > 1:
        raise CompressedTensorsError(f"quantization_config.config_groups: group sizes {sorted(sizes)} differ; "
                                     "one group size is supported")
    return PackQuantized(sizes.pop(), tuple(targets), tuple(q.get("ignore") or ()))


def unpack(packed: np.ndarray) -> np.ndarray:
    """int32 ``[..., W]`` -> signed int8 ``[..., 8 W]`` (value ``8 j + k`` from word ``j``'s nibble ``k``)."""
    words = np.asarray(packed).astype(np.int32, copy=False).view(np.uint32)
    nibbles = (words[..., None] >> (np.arange(PER_WORD, dtype=np.uint32) * BITS)) & ((1 << BITS) - 1)
    return (nibbles.astype(np.int8) - OFFSET).reshape(*words.shape[:-1], words.shape[-1] * PER_WORD)


def check_shapes(name: str, packed: np.ndarray, scale: np.ndarray, shape, group_size: int) -> tuple[int, int]:
    """``(out, in)`` of the weight ``name`` (its ``weight_shape``), after checking that its packed words and
    its scales fit it; a mismatch raises naming the tensor."""
    shape = tuple(int(s) for s in np.asarray(shape).reshape(-1))
    if len(shape) != 2:
        raise CompressedTensorsError(f"{name}.weight_shape: {shape}; expected [out, in]")
    n_out, n_in = shape
    want_packed = (n_out, -(-n_in // PER_WORD))
    if packed.dtype != np.int32 or tuple(packed.shape) != want_packed:
        raise CompressedTensorsError(f"{name}.weight_packed: {packed.dtype} {tuple(packed.shape)} does not fit "
                                     f"weight_shape {list(shape)} (expected int32 {want_packed}, {PER_WORD} values a word)")
    want_scale = (n_out, -(-n_in // group_size))
    if tuple(scale.shape) != want_scale:
        raise CompressedTensorsError(f"{name}.weight_scale: shape {tuple(scale.shape)} does not fit weight_shape "
                                     f"{list(shape)} with group_size {group_size} (expected {want_scale})")
    return n_out, n_in


def decode(name: str, packed: np.ndarray, scale: np.ndarray, shape, group_size: int) -> np.ndarray:
    """The float32 weight ``[out, in]`` of module ``name`` from its ``weight_packed`` / ``weight_scale`` /
    ``weight_shape`` (exact: a 4-bit integer times a bfloat16 scale fits float32's mantissa)."""
    n_out, n_in = check_shapes(name, packed, scale, shape, group_size)
    q = unpack(packed)[:, :n_in].astype(np.float32)
    per_column = np.repeat(np.asarray(scale, np.float32), group_size, axis=1)[:, :n_in]
    return q * per_column


__all__ = ["CompressedTensorsError", "FORMAT", "PackQuantized", "check_shapes", "decode", "parse_config", "unpack"]

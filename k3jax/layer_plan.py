"""Which decoder layers run unrolled and which are stacked and scanned, and where each layer lives.

Layers whose (mixer, FFN) pattern repeats with the layout period (``[KDA, KDA, MLA, KDA]`` for K3's
layers 1-88) are stacked into one parameter tree with a leading ``layers`` axis (the *group* axis)
and run with ``jax.lax.scan``; the layers before and after that run are ordinary modules. This module
is the one place that maps between a model layer index and its place in the model: everything else
(model, cache, training statistics, optimizer, checkpoint interop) asks the plan.
"""

from __future__ import annotations

import dataclasses

from k3jax.config import ModelConfig

LayerKind = tuple[str, str]  # (mixer, ffn), e.g. ("kda", "moe")
Path = tuple[str | int, ...]

# Attribute paths of the three parts in ``K3Model``: prefix[k], groups.layers[slot] (stacked), suffix[k].
PREFIX, GROUPS, SUFFIX = "prefix", "groups", "suffix"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """``prefix`` layers run first, then ``num_groups`` repetitions of ``group_kinds`` starting at layer
    ``group_start``, then the ``suffix`` layers. Group ``g``'s slot ``j`` is layer
    ``group_start + g * period + j``."""

    prefix: tuple[int, ...]
    group_start: int
    group_kinds: tuple[LayerKind, ...]
    num_groups: int
    suffix: tuple[int, ...]

    @property
    def period(self) -> int:
        """Layers per scanned group."""
        return len(self.group_kinds)

    def layer_at(self, group, slot: int):
        """The model layer index of the stacked slice (``group``, ``slot``); ``group`` may be an int
        or an int array (e.g. traced inside the scan, or ``arange(num_groups)``)."""
        return self.group_start + group * self.period + slot

    def slot_layers(self, slot: int) -> tuple[int, ...]:
        """The layers stacked in ``slot`` of the groups, in group order (axis 0 of its leaves)."""
        return tuple(self.layer_at(g, slot) for g in range(self.num_groups))

    def locate(self, i: int) -> tuple[Path, tuple[int, ...]]:
        """Where layer ``i`` lives: (path of its ``DecoderLayer`` in the model, leading indices into
        that module's leaves: ``(g,)`` for a stacked layer, ``()`` otherwise)."""
        if i in self.prefix:
            return (PREFIX, self.prefix.index(i)), ()
        if i in self.suffix:
            return (SUFFIX, self.suffix.index(i)), ()
        g, slot = divmod(i - self.group_start, self.period) if self.period else (-1, 0)
        if not 0 <= g < self.num_groups:
            raise IndexError(f"layer {i} is not in this plan ({self})")
        return (GROUPS, "layers", slot), (g,)

    @staticmethod
    def is_stacked(path: Path) -> bool:
        """Whether a parameter path (names from the model root) lies in the stacked groups, whose
        leaves lead with the group axis."""
        return bool(path) and path[0] == GROUPS


def layer_kind(cfg: ModelConfig, i: int) -> LayerKind:
    return (cfg.mixer(i), cfg.ffn(i))


def plan_layers(cfg: ModelConfig) -> LayerPlan:
    """Find the longest periodic run of layers after the dense prefix (period = ``mla_period`` for a
    hybrid layout, 1 for a uniform one) and scan it."""
    n = cfg.num_layers
    if not cfg.scan_layers:
        return LayerPlan(tuple(range(n)), n, (), 0, ())
    period = cfg.mla_period if cfg.layout == "hybrid" or cfg.mla_layers is not None else 1
    kinds = [layer_kind(cfg, i) for i in range(n)]
    best = (0, n)  # (num_groups, start)
    for start in range(cfg.first_dense_layers, min(cfg.first_dense_layers + period, n)):
        pattern = kinds[start:start + period]
        groups = 0
        while start + (groups + 1) * period <= n and kinds[start + groups * period:start + (groups + 1) * period] == pattern:
            groups += 1
        if groups > best[0]:
            best = (groups, start)
    groups, start = best
    if groups < 2:  # nothing worth scanning
        return LayerPlan(tuple(range(n)), n, (), 0, ())
    end = start + groups * period
    return LayerPlan(tuple(range(start)), start, tuple(kinds[start:start + period]), groups, tuple(range(end, n)))


__all__ = ["GROUPS", "LayerKind", "LayerPlan", "PREFIX", "SUFFIX", "layer_kind", "plan_layers"]

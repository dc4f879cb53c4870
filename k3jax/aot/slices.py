"""TPU pod slices to compile for (no TPU needed): v5p shapes, HBM, peak FLOP/s and ICI bandwidth, and the
slice's devices as libtpu describes them (``get_topology_desc``)."""

from __future__ import annotations

import dataclasses
import math

GIB = 1024**3
# HBM per v5p device as libtpu's compiler budgets it (the limit its RESOURCE_EXHAUSTED message
# quotes); Cloud TPU documents 95 GiB usable of 96 GiB physical per chip.
V5P_HBM_BYTES = int(95.74 * GIB)
# v5p per chip (Cloud TPU's published figures): 459 TFLOP/s bf16, 2,765 GB/s of HBM, 4,800 Gbit/s of ICI over
# its links.
V5P_PEAK_FLOPS = 459e12
V5P_HBM_BANDWIDTH = 2765e9
V5P_ICI_BYTES_PER_S = 4800e9 / 8
# v5p slices as Cloud TPU names them (v5p-N: N TensorCores = 2 per chip) -> chips per dimension.
# A v5p chip is one JAX device (megacore: its two TensorCores act as one).
V5P_SHAPES = {
    "v5p-8": (2, 2, 1), "v5p-16": (2, 2, 2), "v5p-64": (2, 4, 4), "v5p-128": (4, 4, 4),
    "v5p-256": (4, 4, 8), "v5p-512": (4, 8, 8), "v5p-1024": (8, 8, 8), "v5p-1536": (8, 8, 12),
    "v5p-2048": (8, 8, 16), "v5p-4096": (8, 16, 16),
}
_CUBE = 4  # a full v5p cube is 4x4x4 chips; slices of whole cubes are wrapped into a 3D torus
_CHIPS_PER_HOST = (2, 2, 1)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A TPU pod slice to compile for (no TPU needed)."""

    name: str  # e.g. "v5p-1024"
    chips: tuple[int, ...]  # chips per torus dimension, e.g. (8, 8, 8)
    hbm_bytes: int  # per device

    @classmethod
    def v5p(cls, name: str) -> "TpuSlice":
        if name not in V5P_SHAPES:
            raise ValueError(f"unknown slice {name!r}; known: {', '.join(V5P_SHAPES)}")
        return cls(name, V5P_SHAPES[name], V5P_HBM_BYTES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.chips)

    @property
    def topology(self) -> str:
        return "v5:" + "x".join(map(str, self.chips))

    def devices(self) -> list:
        """libtpu's device descriptions of the slice (usable in a Mesh for lowering and compiling)."""
        from jax.experimental import topologies

        full_cube = all(c % _CUBE == 0 for c in self.chips)
        topo = topologies.get_topology_desc(platform="tpu", topology_name=self.topology, chip_config_name="megacore",
                                            chips_per_host_bounds=_CHIPS_PER_HOST, num_slices=1,
                                            wrap=(full_cube,) * len(self.chips))
        return list(topo.devices)


__all__ = ["GIB", "V5P_HBM_BANDWIDTH", "V5P_HBM_BYTES", "V5P_ICI_BYTES_PER_S", "V5P_PEAK_FLOPS", "V5P_SHAPES", "TpuSlice"]

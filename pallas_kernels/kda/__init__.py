"""Chunkwise KDA Pallas kernels (forward + backward); see ``chunk.py``."""

from pallas_kernels.kda.chunk import chunk_kda

__all__ = ["chunk_kda"]

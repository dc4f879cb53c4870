"""How glibc's ``malloc`` treats XLA:CPU's per-call temporaries (process-wide; a no-op off glibc).

XLA:CPU allocates each call's temporaries as one block and frees it when the call ends: ~2 GB for the
``small`` config's train step at 4 x 256 tokens, 38 MB for its decode step at batch 32. With glibc's
defaults that block is a fresh ``mmap`` (over 32 MB) or, freed, a heap top handed back to the kernel
(over 128 kB), and JAX's threads allocate from arenas of their own; so every call page-faults its
temporaries in afresh: 496,000 faults per ``small`` train step (3.5 s with them gone instead of 4.4 s),
~20 ms of a 60 ms decode step at batch 32. :func:`keep_host_memory` turns ``mmap`` and trimming off
and puts every thread on the one main arena, so the heap keeps its high-water mark and calls mostly
reuse earlier calls' pages (not always: a small block left above a freed large one makes the next
large block come from fresh memory). The cost: freed host memory is not returned
to the system before the process ends.

It is a trade-off, so it is opt-in: XLA's compiler runs slower on it (the tiny train step's cold
compile in ``train.py``: 83 s -> 103 s), so it pays where steps outweigh compiles (a long run of a
larger model, a server; the benchmarks run both sides with it), not for the demo or the test suite.
The arena setting only reaches threads that have not allocated yet, and ``import jax`` starts some:
``K3JAX_HOST_MEMORY=keep`` in the environment makes ``import k3jax`` apply it first thing
(:func:`apply_default`). The serving engine sets the rest (no ``mmap``, no trimming) when it starts,
for as long as it runs. With several CPU devices (``JAX_NUM_CPU_DEVICES``, XLA's
``--xla_force_host_platform_device_count``) the blocks still fault in afresh on every call: XLA:CPU
allocates them otherwise there (seen, not yet understood).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (<malloc.h>) and glibc's defaults
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX, DEFAULT_ARENA_MAX = 128 * 1024, 65536, 0  # arena 0: 8 per core
NO_TRIMMING = -1
# K3JAX_HOST_MEMORY: "keep" (apply keep_host_memory at import) or "glibc" (the default: leave glibc alone)
ENV_VAR, KEEP, GLIBC = "K3JAX_HOST_MEMORY", "keep", "glibc"

_kept = False  # whether keep_host_memory() is in effect


def keep_host_memory(keep: bool = True) -> bool:
    """Make glibc keep freed memory for reuse (``keep=False``: glibc's defaults again). Returns
    whether it took effect (False off glibc)."""
    global _kept
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # not glibc
        return False
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NO_TRIMMING), (M_ARENA_MAX, 1)) if keep else (
        (M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD), (M_ARENA_MAX, DEFAULT_ARENA_MAX))
    done = all([bool(mallopt(param, value)) for param, value in settings])
    _kept = keep and done
    return done


def apply_default() -> bool:
    """What ``import k3jax`` does: :func:`keep_host_memory` when ``$K3JAX_HOST_MEMORY`` is ``keep``.
    Returns whether glibc now keeps freed memory."""
    choice = os.environ.get(ENV_VAR, GLIBC)
    if choice not in (KEEP, GLIBC):
        raise ValueError(f"${ENV_VAR} must be {KEEP!r} or {GLIBC!r}, got {choice!r}")
    return choice == KEEP and keep_host_memory()


def keeps_host_memory() -> bool:
    """Whether :func:`keep_host_memory` is in effect in this process."""
    return _kept


__all__ = ["apply_default", "keep_host_memory", "keeps_host_memory"]

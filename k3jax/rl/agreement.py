"""Every process of a multi-host RL run must hold the same rollout: the check, once per step.

Each process samples the whole rollout itself (the same prompts, seeds and engine decisions, its tokens,
log-probabilities and experts read from replicated device outputs; the environments' turns and the rewards
are process 0's, sent to all: ``distributed.main_process_result``), so all build the same training batch,
and each places its own shards of it. Processes running other code, configs or data would make the batches
differ: the processes would train on inconsistent rows or, once their engines decide differently, run
different programs and hang the slice. So before the batch is used, every process
compares a digest of its rollout (the completions' tokens, their sampled log-probabilities and the rewards:
a few kilobytes per row) with the others' (one all-gather of an int32) and stops with
:class:`RolloutDivergenceError` naming both digests when one differs.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np


class RolloutDivergenceError(RuntimeError):
    """The processes of a multi-host RL run hold different rollouts (module docstring)."""


def rollout_digest(*arrays: np.ndarray) -> int:
    """A 31-bit digest (crc32) of the arrays' shapes, dtypes and bytes, in order."""
    crc = 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode(), crc)
        crc = zlib.crc32(a.tobytes(), crc)
    return crc & 0x7FFF_FFFF


def check_same_rollout(step: int, tokens: np.ndarray, logprobs: np.ndarray, rewards: np.ndarray) -> None:
    """Raise :class:`RolloutDivergenceError` on every process unless all processes' rollouts of ``step`` have
    the same :func:`rollout_digest` (``tokens`` ``[B, T]``, their sampled ``logprobs`` ``[B, T]``, ``rewards``
    ``[B]``). One process: nothing to compare."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = rollout_digest(tokens, logprobs, rewards)
    digests = np.asarray(multihost_utils.process_allgather(np.asarray(digest, np.int32))).reshape(-1)
    differs = np.flatnonzero(digests != digests[0])
    if differs.size:
        other = int(differs[0])
        raise RolloutDivergenceError(
            f"step {step}: the processes' rollouts differ: process {other}'s digest is {int(digests[other])}, "
            f"process 0's {int(digests[0])} (this is process {jax.process_index()}). Every process must sample the "
            f"same rollout: do all processes run the same code, config, prompts and devices?")


__all__ = ["RolloutDivergenceError", "check_same_rollout", "rollout_digest"]

"""Multi-process jobs: ``jax.distributed.initialize`` across several hosts, and what the processes agree on.

``train.py`` and ``infer.py`` call :func:`initialize` before touching any device. ``--distributed``
chooses:

- ``auto`` (default): initialize when the environment describes a multi-process job — an explicit
  coordinator (``JAX_COORDINATOR_ADDRESS``, with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``),
  a multi-host Cloud TPU slice (``TPU_WORKER_HOSTNAMES`` listing several hosts), or a SLURM / Open MPI
  launch of more than one task; otherwise run as one process.
- ``on``: always initialize (``jax.distributed.initialize()`` auto-detects TPU pods, SLURM, MPI).
- ``off``: never.

After it, ``jax.devices()`` lists every process's devices, so the mesh built from ``cfg.mesh`` spans
the whole job; each process reads its own ``1 / process_count`` of every global batch
(``k3jax.data``) and contributes it with ``jax.make_array_from_process_local_data`` (an RL run's
batch, which every process computes whole, is placed with ``k3jax.sharding.place_batch``); orbax writes
each process's shards of the train state to the shared checkpoint directory, and process 0 the
metadata. Single-host runs never call it.

The processes of a job agree on what one of them saw (:func:`any_process`, :func:`agreed_stop`), take
what process 0 alone computed (:func:`main_process_result`: an RL run's tool turns and rewards) and
compile a program before any of them runs it (:func:`compiled_together`).

A process that stops answering the coordination service's heartbeat for ``heartbeat_timeout_s``
(JAX's default: 100 s) is declared dead, and JAX then aborts every other process with a message naming
it ("Terminating process because the JAX distributed service detected fatal errors"): the bound on how
long a job can hang on a lost host whose collectives do not fail by themselves.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Literal

import jax
import numpy as np

Mode = Literal["auto", "on", "off"]
MODES = ("auto", "on", "off")


def _env_tasks(*names: str) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def multi_process_env() -> str | None:
    """Which launcher describes a multi-process job in the environment (None: a single process)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]) > 1:
        return "TPU_WORKER_HOSTNAMES"
    if _env_tasks("SLURM_NTASKS", "SLURM_NPROCS") > 1:
        return "SLURM"
    if _env_tasks("OMPI_COMM_WORLD_SIZE") > 1:
        return "Open MPI"
    return None


def initialize(mode: Mode = "auto", heartbeat_timeout_s: int | None = None) -> bool:
    """Start the multi-process runtime if ``mode`` asks for it (module docstring); True when started.
    ``heartbeat_timeout_s``: seconds without a heartbeat before a process counts as dead (None: JAX's)."""
    if mode not in MODES:
        raise ValueError(f"--distributed must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and multi_process_env() is None):
        return False
    kwargs = {}
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # explicit wiring (any platform, CPU included)
        kwargs = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                      num_processes=_env_tasks("JAX_NUM_PROCESSES"), process_id=int(os.environ.get("JAX_PROCESS_ID", 0)))
    if heartbeat_timeout_s is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_s
    jax.distributed.initialize(**kwargs)
    return True


def is_main_process() -> bool:
    """Process 0 writes logs, plots and prints samples; every process saves its checkpoint shards."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """``flag`` of any process, seen by all (process 0's lock outcome)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def agreed_stop(signum: int) -> int:
    """The stop signal any process received (0: none), seen by all: a signal reaches one host (or the
    hosts at different moments), and every host must stop and save at the same step, or the checkpoint
    would be torn and the others would wait forever in the next step's collectives."""
    if jax.process_count() == 1:
        return signum
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(signum, np.int32))))


def compiled_together(fn, *, barrier: str):
    """The jitted ``fn``, which with several processes compiles at its first call, then waits there for
    every process to have compiled it (the coordination service's barrier ``barrier``, a name used once
    per job; no device collective) before any runs it: gloo gives a peer 30 s to join a collective, and
    processes compiling on a busy machine can finish further apart than that. Later calls run that
    executable, so they must pass arguments of the first call's shapes and shardings. One process: ``fn``."""
    if jax.process_count() == 1:
        return fn
    compiled = None

    def call(*args):
        nonlocal compiled
        if compiled is None:
            compiled = fn.lower(*args).compile()
            from jax._src import distributed  # noqa: PLC0415 - the public API's barriers are device collectives

            distributed.global_state.client.wait_at_barrier(barrier, timeout_in_ms=3_600_000)
        return compiled(*args)

    return call


class MainProcessError(RuntimeError):
    """Raised on the other processes when process 0's :func:`main_process_result` computation raised."""


def main_process_result(compute: Callable[[], Any]) -> Any:
    """``compute()`` run by process 0 alone, its (JSON-serialisable) result handed to every process: what must
    be the same everywhere but may not come out the same when each process computes it (a tool's output, a
    reward that reads a clock or a sandbox), or is not worth computing on every host. An exception in
    ``compute`` is raised on every process (on the others a :class:`MainProcessError` quoting it), so none is left
    waiting. One process: ``compute()`` as it is."""
    if jax.process_count() == 1:
        return compute()
    from jax.experimental import multihost_utils

    error, message = None, {}
    if is_main_process():
        try:
            message = {"value": compute()}
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others have heard of it
            error, message = e, {"error": f"{type(e).__name__}: {e}"}
    data = json.dumps(message).encode()
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int32)))
    buffer = np.zeros(max(256, 1 << (size - 1).bit_length()), np.uint8)  # powers of two: few shapes to compile
    buffer[:len(data)] = np.frombuffer(data, np.uint8)
    message = json.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer))[:size].tobytes())
    if error is not None:
        raise error
    if "error" in message:
        raise MainProcessError(f"process 0: {message['error']}")
    return message["value"]


__all__ = ["MODES", "MainProcessError", "agreed_stop", "any_process", "compiled_together", "initialize", "is_main_process",
           "main_process_result", "multi_process_env"]

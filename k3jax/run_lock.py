"""One training process per run directory: an exclusive lock on ``<run_dir>/train.lock``.

Two runs writing one directory would delete each other's checkpoints and interleave their metrics,
so :func:`lock_run_dir` takes an ``fcntl.flock`` on the lock file and records the holder
(``pid host start-time``) in it. The operating system releases a flock when its process dies, so a
killed run leaves no lock behind; the recorded PID covers what flock cannot see: a lock held by a
child that outlived its parent (the PID is dead on this host: the lock is stale and taken over) and
file systems without flock (then the live PID alone guards the directory).

The file stays in the run directory after the run (deleting it would let a process that opened it
just before lock a file nobody else sees).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import socket
import time

LOCK_FILE = "train.lock"


class RunLockedError(RuntimeError):
    """The run directory is in use by another live process."""


def _holder(text: str) -> tuple[int, str] | None:
    """``(pid, host)`` recorded in a lock file, or None if it holds none."""
    parts = text.split()
    if len(parts) >= 2 and parts[0].isdigit():
        return int(parts[0]), parts[1]
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


@contextlib.contextmanager
def lock_run_dir(run_dir: str | pathlib.Path):
    """Hold the run directory's lock for the duration of the ``with`` block (creating the directory).

    Raises :class:`RunLockedError`, naming the other process (PID, host, start time), if a live
    process holds it.
    """
    path = pathlib.Path(run_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_by_other = False
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                held_by_other = True
            elif e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # no flock here: the recorded PID decides
                held_by_other = None
            else:
                raise
        record = os.pread(fd, 4096, 0).decode(errors="replace")
        holder, host = _holder(record), socket.gethostname()
        dead = holder is not None and holder[1] == host and not _alive(holder[0])
        # A flock held with no record yet is a run that is just starting; another host's PID cannot be
        # checked, so it counts as live.
        in_use = held_by_other if held_by_other is not None else holder is not None
        if in_use and not dead:
            who = f"process {holder[0]} on {holder[1]}" if holder else "another process"
            started = " ".join(record.split()[2:]) or "at an unknown time"
            raise RunLockedError(f"run directory {path.parent} is in use by {who} (started {started}; lock "
                                 f"file {path}). Wait for it to finish or stop it, or use another run_dir.")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {host} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # released: a later reader finds no holder to name
    finally:
        os.close(fd)  # closing the descriptor releases the flock


__all__ = ["LOCK_FILE", "RunLockedError", "lock_run_dir"]

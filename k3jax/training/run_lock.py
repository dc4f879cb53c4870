"""One training process per run directory: an exclusive lock on ``<run_dir>/train.lock``.

Two runs writing one directory would delete each other's checkpoints and interleave their metrics,
so :func:`lock_run_dir` takes an ``fcntl.flock`` on the lock file and records the holder
(``pid host start-time``) in it. The operating system releases a flock when its process dies, so a
killed run leaves no lock behind; the recorded PID covers what flock cannot see: a lock held by a
child that outlived its parent (the PID is dead on this host: the lock is stale and taken over) and
file systems without flock (then the live PID alone guards the directory).

The file stays in the run directory after the run (deleting it would let a process that opened it
just before lock a file nobody else sees).

On an object store (a ``gs://`` run directory) there is no flock and no process to ask: the lock is a
*lease*, an object created only if absent (GCS's ``ifGenerationMatch=0`` precondition, through gcsfs's
JSON API calls), rewritten by its holder every :data:`LEASE_S` / 3 seconds (each rewrite conditioned on
the generation it last wrote) and deleted at the end (conditioned the same way). A lease whose object has
not been rewritten for :data:`LEASE_S` seconds (by the store's clock against this host's: hosts' clocks
must agree to well within that), or whose holder is a dead PID on this host, is stale: it is taken over by
a rewrite conditioned on the stale generation, so of two processes racing for it exactly one wins. Other
URL schemes (``s3://``, ...) have no generation preconditions in fsspec: there the lock is created if
absent after a check, which two processes starting within the same moment can both pass; run one
process per run directory there.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import pathlib
import socket
import sys
import threading
import time
from urllib.parse import quote

from k3jax.runtime import storage

LOCK_FILE = "train.lock"
LEASE_S = 120.0  # an object-store lock not rewritten for this long is stale (its holder is gone)


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
    if storage.is_remote(run_dir):
        with _lease(storage.join(run_dir, LOCK_FILE)):
            yield
        return
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


def _record() -> str:
    return f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"


def _refused(url: str, record: str) -> RunLockedError:
    holder = _holder(record)
    who = f"process {holder[0]} on {holder[1]}" if holder else "another process"
    started = " ".join(record.split()[2:]) or "at an unknown time"
    return RunLockedError(f"run directory {url.rsplit('/', 1)[0]} is in use by {who} (started {started}; lock "
                          f"object {url}, held while rewritten every {LEASE_S / 3:.0f} s). Wait for it to finish "
                          f"or stop it, or use another run_dir.")


class _GcsObject:
    """One GCS object written and deleted under generation preconditions (JSON API through gcsfs)."""

    def __init__(self, url: str):
        self.fs = storage.filesystem(url)
        self.url = url
        self.bucket, self.key, _ = self.fs.split_path(url)

    def write(self, data: bytes, if_generation: int) -> int:
        """Upload ``data`` if the object's generation is ``if_generation`` (0: absent); its new generation.
        Raises ``FileExistsError`` when the precondition fails (HTTP 412)."""
        out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                           uploadType="media", name=self.key, ifGenerationMatch=str(if_generation), data=data,
                           headers={"Content-Type": "text/plain"}, json_out=True)
        return int(out["generation"])

    def read(self) -> tuple[str, int, float] | None:
        """(content, generation, seconds since it was written) or None when absent."""
        try:
            meta = self.fs.call("GET", "b/{}/o/{}", self.bucket, self.key, json_out=True)
            _, content = self.fs.call("GET", f"{self.fs._location}/download/storage/v1/b/{quote(self.bucket)}/o/"
                                      f"{quote(self.key, safe='')}", alt="media", generation=meta["generation"])
        except FileNotFoundError:
            return None
        updated = datetime.datetime.fromisoformat(meta["updated"].replace("Z", "+00:00")).timestamp()
        return content.decode(errors="replace"), int(meta["generation"]), time.time() - updated

    def delete(self, if_generation: int) -> None:
        with contextlib.suppress(FileNotFoundError, FileExistsError):
            self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.key, ifGenerationMatch=str(if_generation))


def _stale(record: str, age: float) -> bool:
    holder = _holder(record)
    dead_here = holder is not None and holder[1] == socket.gethostname() and not _alive(holder[0])
    return dead_here or age > LEASE_S


@contextlib.contextmanager
def _lease(url: str):
    """The object-store lock (module docstring)."""
    if storage.scheme(url) not in ("gs", "gcs"):
        if storage.exists(url) and storage.read_text(url, errors="replace").strip():
            raise _refused(url, storage.read_text(url, errors="replace"))
        storage.write_text(url, _record())
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                storage.remove(url)
        return
    obj, record = _GcsObject(url), _record().encode()
    try:
        generation = obj.write(record, 0)
    except FileExistsError:
        found = obj.read()
        if found is not None and not _stale(found[0], found[2]):
            raise _refused(url, found[0]) from None
        try:  # absent again, or stale: exactly one contender's conditioned write wins
            generation = obj.write(record, 0 if found is None else found[1])
        except FileExistsError:
            raise _refused(url, (obj.read() or ("",))[0]) from None
    held = {"generation": generation}
    stop = threading.Event()

    def renew():
        while not stop.wait(LEASE_S / 3):
            try:
                held["generation"] = obj.write(record, held["generation"])
            except FileExistsError:
                print(f"warning: the run lock {url} was taken over by another process", file=sys.stderr)
                return
            except Exception as e:  # noqa: BLE001 - a transient network error: the next renewal retries
                print(f"warning: renewing the run lock {url} failed ({type(e).__name__}: {e})", file=sys.stderr)

    thread = threading.Thread(target=renew, name="k3jax-run-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        obj.delete(held["generation"])


__all__ = ["LEASE_S", "LOCK_FILE", "RunLockedError", "lock_run_dir"]

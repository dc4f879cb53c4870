"""Where a run's files live: local paths, or URLs of an object store (``gs://bucket/run``, ``s3://``, any
fsspec scheme). The one home of the rule; every reader and writer of run directories, checkpoints, data,
metrics, TensorBoard events, the run lock and Hugging Face directories goes through it.

- :func:`path` turns a string into a path object: a ``pathlib.Path`` for a local path (unchanged
  behaviour and speed), an ``etils.epath.Path`` for a URL (``gs://`` through ``gcsfs``, others through
  their fsspec package). Both have the ``pathlib`` interface (``/``, ``exists``, ``is_dir``, ``iterdir``,
  ``glob``, ``open``, ``read_text``, ``write_text``, ``mkdir``); orbax writes checkpoints through the
  same ``epath`` (arrays through tensorstore, which reads ``gs://`` itself).
- :func:`glob` expands a pattern, :func:`read_range` reads a byte range (a JSONL record, one ranged
  request on a bucket), :func:`write_bytes` replaces a file whole (atomic: a local temp file renamed; an
  object PUT is atomic by itself), :func:`rmtree` deletes a tree.
- :func:`local_copy` gives a local directory or file for readers that need one (ArrayRecord's reader,
  safetensors' memory map): a remote one is downloaded once into :func:`cache_dir`, keyed by its URL,
  size and generation. :func:`staged_upload` is the converse for writers of whole directories.

Object stores have no appends and no renames: files written piece by piece (``metrics.jsonl``,
TensorBoard's event files) are rewritten whole on each flush (:class:`RewrittenFile`).

Tests and local emulators: gcsfs and google-cloud-storage read ``STORAGE_EMULATOR_HOST``, tensorstore
``TENSORSTORE_GCS_HTTP_URL`` (tests/test_gcs.py).
"""

from __future__ import annotations

import contextlib
import glob as _glob
import hashlib
import io
import os
import pathlib
import re
import shutil
import tempfile

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
CACHE_ENV = "K3JAX_STORAGE_CACHE"  # where remote files needed locally are kept (default ~/.cache/k3jax/storage)


def scheme(p) -> str | None:
    """The URL scheme of ``p`` (``"gs"``), or None for a local path (``file://`` counts as local)."""
    m = _URL.match(str(p))
    if m is None or m["scheme"] == "file":
        return None
    return m["scheme"]


def is_remote(p) -> bool:
    """Whether ``p`` names an object in a remote store (a URL other than ``file://``)."""
    return scheme(p) is not None


def path(p):
    """``p`` as a path object: ``pathlib.Path`` when local, ``etils.epath.Path`` for a URL."""
    if is_remote(p):
        from etils import epath

        return p if isinstance(p, epath.Path) else epath.Path(str(p))
    s = str(p)
    return pathlib.Path(s[len("file://"):] if s.startswith("file://") else s)


def join(p, *parts) -> str:
    """``p / part / ...`` as a string (local or URL)."""
    return str(path(p).joinpath(*parts))


def filesystem(p):
    """The fsspec filesystem of a URL (gcsfs for ``gs://``)."""
    import fsspec

    return fsspec.filesystem(scheme(p) or "file")


def exists(p) -> bool:
    return path(p).exists()


def mkdir(p) -> None:
    """Create a directory and its parents (a no-op on an object store, which has no directories)."""
    if not is_remote(p):
        pathlib.Path(path(p)).mkdir(parents=True, exist_ok=True)


def open(p, mode: str = "rb", **kwargs):  # noqa: A001 - the module's ``open``, like ``io.open``
    """A file object for reading or writing ``p`` (remote: streamed through fsspec)."""
    if not is_remote(p):
        return io.open(path(p), mode, **kwargs)
    return filesystem(p).open(str(p), mode, **kwargs)


def read_bytes(p) -> bytes:
    return path(p).read_bytes()


def read_text(p, encoding: str = "utf-8", errors: str = "strict") -> str:
    if not is_remote(p):  # text mode, as before: universal newlines
        return path(p).read_text(encoding=encoding, errors=errors)
    return read_bytes(p).decode(encoding, errors)


def write_bytes(p, data: bytes) -> None:
    """Replace ``p`` with ``data`` whole: a crash leaves the old or the new content, never half of it."""
    if is_remote(p):
        filesystem(p).pipe_file(str(p), data)  # one object upload: atomic
        return
    target = path(p)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # created as open() creates: the umask's mode
    try:
        with io.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(p, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


def read_range(p, start: int, length: int) -> bytes:
    """``length`` bytes of ``p`` from ``start`` (remote: one ranged read)."""
    if not is_remote(p):
        with io.open(path(p), "rb") as f:
            f.seek(start)
            return f.read(length)
    return filesystem(p).cat_file(str(p), start=start, end=start + length)


def glob(pattern: str) -> list:
    """Paths matching ``pattern`` (``*``, ``?``, ``[...]``, ``**``), sorted."""
    if not is_remote(pattern):
        return sorted(pathlib.Path(p) for p in _glob.glob(os.path.expanduser(pattern), recursive=True))
    fs, prefix = filesystem(pattern), f"{scheme(pattern)}://"
    return sorted(path(prefix + m.removeprefix(prefix)) for m in fs.glob(pattern))


def rmtree(p) -> None:
    if is_remote(p):
        path(p).rmtree()
    else:
        shutil.rmtree(path(p))


def remove(p) -> None:
    path(p).unlink()


def _version(url: str) -> str:
    """An object's size and generation (GCS; modification time elsewhere): what :func:`local_copy` keys its
    cached copy by."""
    info = filesystem(url).info(url)
    stamp = info.get("generation") or info.get("updated") or info.get("mtime") or info.get("LastModified") or ""
    return f"{info.get('size') or 0} {stamp}"


def cache_dir() -> pathlib.Path:
    """Local cache of remote files (``$K3JAX_STORAGE_CACHE``, else ``$XDG_CACHE_HOME/k3jax/storage``)."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "k3jax" / "storage"


def local_copy(p) -> pathlib.Path:
    """A local path with the content of ``p`` (a file or a directory): ``p`` itself when local, else a copy
    in :func:`cache_dir` (downloaded once per version of each file; concurrent readers each download to
    a temporary name and rename, so a reader never sees half a file)."""
    if not is_remote(p):
        return path(p)
    fs, url = filesystem(p), str(p).rstrip("/")
    root = cache_dir() / hashlib.sha256(url.encode()).hexdigest()[:24]
    prefix = f"{scheme(url)}://"
    if fs.isdir(url):
        files = {root / f[len(url) + 1:]: f for f in (prefix + f.removeprefix(prefix) for f in fs.find(url))}
        for target, f in files.items():
            _download(f, target)
        for old in [f for f in root.rglob("*") if f.is_file() and not f.name.startswith(".")]:
            if old not in files:  # gone from the store since an earlier copy (a re-export with fewer shards)
                old.unlink()
        return root
    target = root / url.rsplit("/", 1)[-1]
    _download(url, target)
    return target


def _download(url: str, target: pathlib.Path) -> None:
    mark, version = target.with_name(f".{target.name}.version"), _version(url)
    if target.exists() and mark.exists() and mark.read_text() == version:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        filesystem(url).get_file(url, tmp)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    mark.write_text(version)


@contextlib.contextmanager
def staged_upload(p):
    """A local directory to write into for ``p``: ``p`` itself when local; for a URL a temporary directory
    whose files are uploaded under ``p`` when the block ends without an error (then deleted)."""
    if not is_remote(p):
        path(p).mkdir(parents=True, exist_ok=True)
        yield path(p)
        return
    with tempfile.TemporaryDirectory(prefix="k3jax-upload-") as tmp:
        yield pathlib.Path(tmp)
        fs, url = filesystem(p), str(p).rstrip("/")
        for f in sorted(pathlib.Path(tmp).rglob("*")):
            if f.is_file():
                fs.put_file(str(f), f"{url}/{f.relative_to(tmp).as_posix()}")


class RewrittenFile:
    """A file written piece by piece onto an object store, which has no appends: the bytes are kept in
    memory and the whole object is rewritten on every :meth:`flush` (and on close). ``initial`` is the
    content it starts from (an append continues an existing object). No ``fileno``: nothing to fsync."""

    def __init__(self, p, initial: bytes = b""):
        self.url, self._buffer, self._dirty, self.closed = str(p), bytearray(initial), False, False

    def write(self, data) -> int:
        self._buffer += bytes(data)
        self._dirty = True
        return len(data)

    def flush(self) -> None:
        if self._dirty:
            write_bytes(self.url, bytes(self._buffer))
            self._dirty = False

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True


def open_for_append(p):
    """A text file to append lines to: a local file opened ``"a"``, or a :class:`RewrittenFile`."""
    if not is_remote(p):
        return io.open(path(p), "a")
    return _TextAppender(RewrittenFile(p, read_bytes(p) if exists(p) else b""))


class _TextAppender:
    """Text lines onto a :class:`RewrittenFile` (UTF-8)."""

    def __init__(self, raw: RewrittenFile):
        self.raw = raw

    def write(self, text: str) -> int:
        return self.raw.write(text.encode("utf-8"))

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()


class _TensorboardWriterFactory:
    """tensorboardX's writer factory for a URL scheme: event files as :class:`RewrittenFile` objects."""

    def open(self, p):
        return RewrittenFile(p)

    def directory_check(self, p):  # object stores need no directories
        pass


def register_tensorboard(p) -> None:
    """Route tensorboardX's event files under the URL ``p`` through fsspec (one client for every store)."""
    if not is_remote(p):
        return
    from tensorboardX import record_writer

    record_writer.register_writer_factory(scheme(p), _TensorboardWriterFactory())


__all__ = ["CACHE_ENV", "RewrittenFile", "cache_dir", "exists", "filesystem", "glob", "is_remote", "join",
           "local_copy", "mkdir", "open", "open_for_append", "path", "read_bytes", "read_range", "read_text",
           "register_tensorboard", "remove", "rmtree", "scheme", "staged_upload", "write_bytes", "write_text"]

"""Document sources: random-access sequences of strings (grain ``RandomAccessDataSource``s).

``open_documents(source, format="auto", text_field="text")`` takes ``train.data.source``:

- ``"bundled"``: the shipped corpus, ``k3jax/data/corpus/kjv.txt`` (King James Bible, Genesis to
  Ruth, public domain; one chapter per document).
- a file, a directory (every file in it with a known extension, sorted) or a glob pattern; local, or a
  URL of an object store (``gs://bucket/data/*.jsonl``; ``k3jax.runtime.storage``): JSONL records are then read
  by ranged reads, parquet through fsspec, ArrayRecord files from a local cached copy.

Formats, chosen by extension when ``format="auto"``:

- text (``.txt``, ``.text``, ``.md``): one document per blank-line-separated block (a file without
  blank lines is one document). Read into memory.
- jsonl (``.jsonl``, ``.ndjson``, ``.json`` with one object per line): the ``text_field`` of each
  line; lines are read lazily through a byte-offset index built once.
- parquet (``.parquet``): the ``text_field`` column (needs ``pyarrow``).
- ArrayRecord (``.arrayrecord``, ``.array_record``): each record is UTF-8 text, or a JSON object
  whose ``text_field`` is used (``grain.sources.ArrayRecordDataSource``).

Errors name the offending file (and line) and, for a missing field, the fields that exist.

``open_records(source)`` reads the same containers as whole records (JSON objects: a JSONL line, a
parquet row, an ArrayRecord record) for the chat format (``k3jax.data.chat``); each record source
says where record ``i`` is (``where(i)``: file, record number and line) for error messages. The
bundled chat set is ``k3jax/data/corpus/chat.jsonl``.

Bad records (``train.data.bad_records``, :class:`GuardedRecords`): a record that cannot be decoded
(invalid JSON or UTF-8), has a field of the wrong type, holds an empty document, is an invalid
conversation, or cannot be read any more (its file gone mid-run) raises :class:`BadRecordError` naming the
file and record (``stop``, the default), or is skipped and counted (``skip``: :class:`SkippedRecords`,
logged as ``skipped_records`` in ``metrics.jsonl``). A source whose every record is bad stops either way.
"""

from __future__ import annotations

import bisect
import importlib.resources
import json
import os
import pathlib
import re
from typing import Sequence

import numpy as np

from k3jax.runtime import storage

FORMATS = ("text", "jsonl", "parquet", "arrayrecord")
_EXTENSIONS = {
    ".txt": "text", ".text": "text", ".md": "text",
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".parquet": "parquet",
    ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord",
}
_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


def bundled_corpus_path() -> pathlib.Path:
    """Path of the shipped default corpus (``k3jax/data/corpus/kjv.txt``)."""
    return pathlib.Path(str(importlib.resources.files("k3jax.data").joinpath("corpus", "kjv.txt")))


def bundled_chat_path() -> pathlib.Path:
    """Path of the shipped chat set (``k3jax/data/corpus/chat.jsonl``, questions about ``kjv.txt``)."""
    return pathlib.Path(str(importlib.resources.files("k3jax.data").joinpath("corpus", "chat.jsonl")))


def split_text_documents(text: str) -> list[str]:
    """Blank-line-separated blocks, stripped of surrounding whitespace; empty blocks dropped."""
    text = text.replace("\r\n", "\n")
    return [block.strip() for block in _BLANK_LINES.split(text) if block.strip()]


class BadRecordError(ValueError):
    """A record that cannot be trained on; the message names its file and record."""


class TextDocuments:
    """Documents held in memory (text files)."""

    def __init__(self, docs: Sequence[str], name: str = "<memory>"):
        self._docs = list(docs)
        self.name = name

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "TextDocuments":
        return cls(split_text_documents(storage.read_text(path, errors="replace")), str(path))

    def where(self, index: int) -> str:
        return f"{self.name}: document {index}"

    def __len__(self) -> int:
        return len(self._docs)

    def __getitem__(self, index: int) -> str:
        return self._docs[index]

    def __repr__(self) -> str:
        return f"TextDocuments({self.name!r}, {len(self)} documents)"


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise BadRecordError(f"{where}: expected a JSON object with a {field!r} field, got {type(record).__name__}")
    if field not in record:
        raise BadRecordError(f"{where}: no field {field!r} (train.data.text_field); fields: {sorted(record)}")
    value = record[field]
    if not isinstance(value, str):
        raise BadRecordError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
    return value


class JsonlRecords:
    """Each non-empty line of a JSON-lines file, parsed, read lazily by byte offset (``os.pread``, safe
    from grain's reader threads; a URL: one ranged read per record)."""

    def __init__(self, path: str | os.PathLike, check_first: bool = True):
        self.path = storage.path(path)
        self._remote = storage.is_remote(path)
        offsets, lengths, lines = [], [], []
        pos = 0
        with storage.open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    offsets.append(pos)
                    lengths.append(len(line))
                    lines.append(number)
                pos += len(line)
        self._offsets = np.asarray(offsets, np.int64)
        self._lengths = np.asarray(lengths, np.int64)
        self._lines = np.asarray(lines, np.int64)
        self._fd = None
        self._pid = None
        if check_first and len(self):
            self[0]  # fail early on a wrong field or a malformed first line

    def __len__(self) -> int:
        return len(self._offsets)

    def _file(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # reopen in forked workers
            self._fd, self._pid = os.open(self.path, os.O_RDONLY), os.getpid()
        return self._fd

    def where(self, index: int) -> str:
        return f"{self.path}: record {index} (line {self._lines[index]})"

    def __getitem__(self, index: int):
        length, offset = int(self._lengths[index]), int(self._offsets[index])
        try:
            # pread: positional and thread-safe (grain reads the source from several threads)
            line = (storage.read_range(self.path, offset, length) if self._remote
                    else os.pread(self._file(), length, offset))
        except OSError as e:
            raise BadRecordError(f"{self.where(index)}: cannot be read ({type(e).__name__}: {e}); was the file "
                                 f"removed or replaced during the run?") from e
        if len(line) != length:
            raise BadRecordError(f"{self.where(index)}: the file changed during the run (read {len(line)} of "
                                 f"{length} bytes)")
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            raise BadRecordError(f"{self.where(index)}: not valid JSON ({e})") from None
        except UnicodeDecodeError as e:
            raise BadRecordError(f"{self.where(index)}: not valid UTF-8 ({e})") from None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fd"] = state["_pid"] = None
        return state

    def __del__(self):
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"JsonlRecords({str(self.path)!r}, {len(self)} records)"


class JsonlDocuments(JsonlRecords):
    """The ``text_field`` of each record of a JSON-lines file."""

    def __init__(self, path: str | os.PathLike, text_field: str = "text", check_first: bool = True):
        self.text_field = text_field
        super().__init__(path, check_first)

    def __getitem__(self, index: int) -> str:
        return _field(super().__getitem__(index), self.text_field, self.where(index))

    def __repr__(self) -> str:
        return f"JsonlDocuments({str(self.path)!r}, field={self.text_field!r}, {len(self)} documents)"


class ParquetDocuments:
    """The ``text_field`` column of a parquet file (read into memory with pyarrow)."""

    def __init__(self, path: str | os.PathLike, text_field: str = "text"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        self.path = storage.path(path)
        with storage.open(self.path, "rb") as f:
            schema = pq.read_schema(f)
            if text_field not in schema.names:
                raise ValueError(f"{self.path}: no column {text_field!r} (train.data.text_field); columns: "
                                 f"{schema.names}")
            f.seek(0)
            column = pq.read_table(f, columns=[text_field]).column(text_field)
        # a null or non-string value stays what it is: a bad record when read
        self._docs = column.to_pylist()
        self.text_field = text_field

    def where(self, index: int) -> str:
        return f"{self.path}: record {index} (row {index})"

    def __len__(self) -> int:
        return len(self._docs)

    def __getitem__(self, index: int) -> str:
        value = self._docs[index]
        if not isinstance(value, str):
            raise BadRecordError(f"{self.where(index)}: column {self.text_field!r} is "
                                 f"{type(value).__name__}, not a string")
        return value

    def __repr__(self) -> str:
        return f"ParquetDocuments({str(self.path)!r}, {len(self)} documents)"


class ParquetRecords:
    """The rows of a parquet file as dicts (read into memory with pyarrow; nested columns such as a
    ``messages`` list of structs become lists of dicts)."""

    def __init__(self, path: str | os.PathLike):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
        self.path = storage.path(path)
        with storage.open(self.path, "rb") as f:
            self._rows = pq.read_table(f).to_pylist()

    def where(self, index: int) -> str:
        return f"{self.path}: record {index} (row {index})"

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict:
        return self._rows[index]

    def __repr__(self) -> str:
        return f"ParquetRecords({str(self.path)!r}, {len(self)} records)"


class ArrayRecordRecords:
    """The records of ArrayRecord file(s), each a UTF-8 JSON object."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        import grain

        self.paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        self._source = grain.sources.ArrayRecordDataSource([str(storage.local_copy(p)) for p in self.paths])

    def where(self, index: int) -> str:
        return f"{', '.join(self.paths)}: record {index}"

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int):
        raw = self._source[index]
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRecordError(f"{self.where(index)}: not a UTF-8 JSON record ({e})") from None

    def __repr__(self) -> str:
        return f"ArrayRecordRecords({self.paths!r}, {len(self)} records)"


class ArrayRecordDocuments:
    """Records of ArrayRecord file(s): UTF-8 text, or JSON objects with a ``text_field``."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], text_field: str = "text",
                 check_first: bool = True):
        import grain

        paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        self.paths = paths
        self.text_field = text_field
        self._source = grain.sources.ArrayRecordDataSource([str(storage.local_copy(p)) for p in paths])
        if check_first and len(self):
            self[0]

    def __len__(self) -> int:
        return len(self._source)

    def where(self, index: int) -> str:
        return f"{', '.join(self.paths)}: record {index}"

    def __getitem__(self, index: int) -> str:
        raw = self._source[index]
        try:
            text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else str(raw)
        except UnicodeDecodeError as e:
            raise BadRecordError(f"{self.where(index)}: not valid UTF-8 ({e})") from None
        if text.lstrip().startswith("{"):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                return text
            return _field(record, self.text_field, self.where(index))
        return text

    def __repr__(self) -> str:
        return f"ArrayRecordDocuments({self.paths!r}, {len(self)} documents)"


class ConcatDocuments:
    """Several sources one after another."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self._ends = np.cumsum([len(p) for p in self.parts]).tolist()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> str:
        part, local = self._locate(index)
        return self.parts[part][local]

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self._ends, index)
        return part, index - (self._ends[part - 1] if part else 0)

    def where(self, index: int) -> str:
        """Where record ``index`` is (parts that are record sources)."""
        part, local = self._locate(index)
        return self.parts[part].where(local)

    def __repr__(self) -> str:
        return f"ConcatDocuments({len(self.parts)} parts, {len(self)} documents)"


class SkippedRecords:
    """The bad records one process skipped (``train.data.bad_records=skip``): ``count`` and the last one's
    error."""

    def __init__(self):
        self.count, self.last = 0, ""

    def add(self, error: Exception) -> None:
        self.count += 1
        self.last = str(error)


class GuardedRecords:
    """``source[i]`` under the bad-record policy ``policy`` (``train.data.bad_records``): a record that
    raises ``ValueError`` / ``OSError`` when read, or is an empty document, raises :class:`BadRecordError`
    naming its file and record (``stop``) or reads as None and is counted in ``skipped`` (``skip``). When
    every one of the ``reachable`` records it may be asked for (default: all; a process's share of a split
    in the pipeline) has been found bad with no good one in between, it stops either way: nothing would
    ever be trained."""

    def __init__(self, source, policy: str, skipped: SkippedRecords | None = None, reachable: int | None = None):
        if policy not in ("stop", "skip"):
            raise ValueError(f"train.data.bad_records: {policy!r} is not one of stop, skip")
        self.source, self.policy = source, policy
        self.skipped = skipped if skipped is not None else SkippedRecords()
        self.reachable = len(source) if reachable is None else reachable
        self._bad_since_good: set[int] = set()

    def __len__(self) -> int:
        return len(self.source)

    def where(self, index: int) -> str:
        where = getattr(self.source, "where", None) or getattr(getattr(self.source, "records", None), "where", None)
        return where(index) if where is not None else f"record {index}"

    def __getitem__(self, index: int):
        try:
            value = self.source[index]
            if isinstance(value, str) and not value.strip():
                raise BadRecordError(f"{self.where(index)}: empty document")
        except (ValueError, OSError) as e:
            self.reject(index, e)
            return None
        self._bad_since_good.clear()
        return value

    def reject(self, index: int, error: Exception) -> None:
        """Apply the policy to record ``index``, found bad by ``error`` (here or by a later stage)."""
        where = self.where(index)
        text = str(error) if str(error).startswith(where.split(":")[0]) else f"{where}: {error}"
        bad = BadRecordError(text)
        if self.policy == "stop":
            raise bad from error
        self.skipped.add(bad)
        self._bad_since_good.add(index)
        if len(self._bad_since_good) >= self.reachable:
            raise BadRecordError(f"every record of the source is bad ({self.reachable} of them; the last: {text})") \
                from error


def detect_format(path: str | os.PathLike) -> str:
    suffix = pathlib.Path(path).suffix.lower()
    if suffix not in _EXTENSIONS:
        raise ValueError(f"train.data.source: cannot tell the format of {path} from its extension "
                         f"(known: {', '.join(sorted(_EXTENSIONS))}); set train.data.format")
    return _EXTENSIONS[suffix]


def _expand(source: str) -> list:
    if any(ch in source for ch in "*?["):
        paths = [p for p in storage.glob(source) if p.is_file()]
        if not paths:
            raise FileNotFoundError(f"train.data.source: no file matches {source!r}")
        return paths
    path = storage.path(source)
    if not storage.is_remote(source):
        path = path.expanduser()
    if path.is_dir():
        paths = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _EXTENSIONS)
        if not paths:
            raise FileNotFoundError(f"train.data.source: directory {path} holds no file with a known "
                                    f"extension ({', '.join(sorted(_EXTENSIONS))})")
        return paths
    if not path.exists():
        raise FileNotFoundError(f"train.data.source: {source!r} does not exist (use 'bundled' for the "
                                "shipped corpus, or a file, directory or glob)")
    return [path]


def _open_one(path, fmt: str, text_field: str, check_first: bool):
    if fmt == "text":
        return TextDocuments.from_file(path)
    if fmt == "jsonl":
        return JsonlDocuments(path, text_field, check_first)
    if fmt == "parquet":
        return ParquetDocuments(path, text_field)
    if fmt == "arrayrecord":
        return ArrayRecordDocuments(path, text_field, check_first)
    raise ValueError(f"train.data.format: unknown format {fmt!r}; one of auto, {', '.join(FORMATS)}")


_RECORD_READERS = {"jsonl": JsonlRecords, "parquet": ParquetRecords, "arrayrecord": ArrayRecordRecords}


def open_records(source: str):
    """A random-access source of whole records (JSON values) with ``where(i)``, from a file, directory or
    glob of JSONL, parquet or ArrayRecord files (by extension)."""
    parts = []
    for path in _expand(source):
        fmt = detect_format(path)
        if fmt not in _RECORD_READERS:
            raise ValueError(f"train.data.source: {path} is {fmt}; records are read from "
                             f"{', '.join(_RECORD_READERS)} files")
        parts.append(_RECORD_READERS[fmt](path))
    records = parts[0] if len(parts) == 1 else ConcatDocuments(parts)
    if len(records) == 0:
        raise ValueError(f"train.data.source: {source!r} holds no records")
    return records


def open_documents(source: str = "bundled", format: str = "auto", text_field: str = "text",
                   bad_records: str = "stop"):
    """A random-access source of document strings (see the module docstring). ``bad_records="stop"``
    reads the first record of each file at once (a wrong ``text_field`` fails here); with ``"skip"`` bad
    records are left to :class:`GuardedRecords`."""
    if format != "auto" and format not in FORMATS:
        raise ValueError(f"train.data.format: unknown format {format!r}; one of auto, {', '.join(FORMATS)}")
    if source == "bundled":
        path = bundled_corpus_path()
        if not path.exists():
            raise FileNotFoundError(f"the bundled corpus {path} is missing from this installation")
        return TextDocuments.from_file(path)
    paths = _expand(source)
    parts = [_open_one(p, detect_format(p) if format == "auto" else format, text_field, bad_records == "stop")
             for p in paths]
    docs = parts[0] if len(parts) == 1 else ConcatDocuments(parts)
    if len(docs) == 0:
        raise ValueError(f"train.data.source: {source!r} holds no documents")
    return docs


__all__ = ["ArrayRecordDocuments", "ArrayRecordRecords", "BadRecordError", "ConcatDocuments", "GuardedRecords",
           "SkippedRecords", "JsonlDocuments", "JsonlRecords",
           "ParquetDocuments", "ParquetRecords", "TextDocuments", "bundled_chat_path", "bundled_corpus_path",
           "detect_format", "open_documents", "open_records", "split_text_documents"]

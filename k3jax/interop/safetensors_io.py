"""Minimal streaming reader and writer for the safetensors format, NumPy only.

safetensors' own NumPy backend cannot return ``bfloat16`` or ``float8`` tensors (NumPy has no
such dtypes; ``safe_open(..., "numpy")`` raises "data type 'bfloat16' not understood"), and its
other backends allocate on an accelerator or need torch. The format is simple (an 8-byte
little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``, then the raw
little-endian bytes), so this module reads exactly one tensor at a time with ``readinto`` (the
resident set grows by that tensor only) and writes shards tensor by tensor, with ``ml_dtypes``
supplying bfloat16 and float8.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in NAMES:
        raise TypeError(f"no safetensors dtype for {dt}")
    return NAMES[dt]


class SafetensorsFile:
    """One ``.safetensors`` file: ``keys()``, ``shape(name)``, ``dtype(name)``, ``get(name)``."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + n > size:  # also a garbage length: nothing is read past the file
                raise ValueError(f"{self.path}: not a complete safetensors file: it ends inside its header "
                                 f"({size} bytes; the header needs {8 + n if size >= 8 else 8}). Was it cut "
                                 f"short by an interrupted download or copy?")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: the safetensors header is not valid JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._meta = header
        self._file = None

    def __enter__(self):
        self._file = open(self.path, "rb")
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()
            self._file = None

    def keys(self) -> list[str]:
        """Names in storage order (sequential reads)."""
        return sorted(self._meta, key=lambda k: self._meta[k]["data_offsets"][0])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._meta[name]["dtype"]

    def nbytes(self, name: str) -> int:
        start, end = self._meta[name]["data_offsets"]
        return end - start

    def get(self, name: str) -> np.ndarray:
        """The tensor as a fresh NumPy array (little-endian, native dtype)."""
        info = self._meta[name]
        dt = DTYPES.get(info["dtype"])
        if dt is None:
            raise TypeError(f"{self.path.name}:{name}: unsupported safetensors dtype {info['dtype']}")
        start, end = info["data_offsets"]
        buf = np.empty(end - start, np.uint8)
        f = self._file or open(self.path, "rb")
        try:
            f.seek(self._data_start + start)
            if f.readinto(memoryview(buf)) != end - start:
                raise OSError(f"{self.path}: truncated tensor {name}")
        finally:
            if self._file is None:
                f.close()
        return buf.view(dt.newbyteorder("<")).astype(dt, copy=False).reshape(info["shape"])


class TensorSpec:
    """A tensor to write: name, shape, dtype and a callable producing its value on demand."""

    __slots__ = ("name", "shape", "dtype", "produce")

    def __init__(self, name: str, shape: tuple[int, ...], dtype, produce: Callable[[], np.ndarray]):
        self.name, self.shape, self.dtype, self.produce = name, tuple(int(s) for s in shape), np.dtype(dtype), produce

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_file(path: str | os.PathLike, specs: Iterable[TensorSpec], metadata: dict | None = None,
               on_tensor: Callable[[TensorSpec], None] | None = None) -> int:
    """Write ``specs`` to one file, producing (and dropping) one tensor at a time. Returns bytes."""
    specs = list(specs)
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": dtype_name(s.dtype), "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for s in specs:
            value = np.asarray(s.produce())
            if value.shape != s.shape:
                raise ValueError(f"{s.name}: produced shape {value.shape}, planned {s.shape}")
            value = np.ascontiguousarray(value.astype(s.dtype.newbyteorder("<"), copy=False))
            f.write(memoryview(value.reshape(-1).view(np.uint8)))
            if on_tensor is not None:
                on_tensor(s)
    return offset


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9 bytes, ``"2GiB"`` -> 2 * 2**30, ints pass through (HF's convention)."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9, "MB": 10**6,
             "KB": 10**3, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


__all__ = ["DTYPES", "SafetensorsFile", "TensorSpec", "dtype_name", "parse_size", "write_file"]

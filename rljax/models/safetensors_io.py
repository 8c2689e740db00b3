"""Minimal streaming safetensors reader (memory-mapped) and writer.

File layout (the safetensors spec): 8-byte little-endian header length N, N bytes of
JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the raw row-major tensor bytes. Reading memory-maps the file, so a tensor costs
anonymous memory only once it is converted; writing streams one tensor at a time.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

# (name, shape, numpy dtype, producer): producer() returns the array to write.
TensorSpec = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


class SafetensorsFile:
    """Read-only view of one .safetensors file; `get(name)` returns a memory-mapped array."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"{self.path}: corrupt safetensors header length {n}")
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + n
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size > 8 + n else None
        for name, e in header.items():
            if e["dtype"] not in _DTYPES:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has dtype {e['dtype']}; "
                    f"supported: {sorted(_DTYPES)}"
                )
            begin, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * _DTYPES[e["dtype"]].itemsize
            if end - begin != want or self._data_start + end > size:
                raise ValueError(f"{self.path}: corrupt entry for tensor {name!r}")

    def names(self) -> list[str]:
        """Tensor names in this file."""
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of tensor `name`."""
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a read-only memory-mapped array in its stored dtype."""
        e = self._entries[name]
        begin, end = e["data_offsets"]
        dtype = _DTYPES[e["dtype"]]
        if end == begin:
            return np.zeros(e["shape"], dtype)
        buf = self._mmap[self._data_start + begin:self._data_start + end]
        return buf.view(dtype).reshape(e["shape"])


def write_safetensors(path: str | os.PathLike, specs: Sequence[TensorSpec],
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors to `path` one at a time.

    specs: list of (name, shape, numpy dtype, producer) where producer() returns the array;
    only one produced array is alive at a time.
    """
    header, offset = {}, 0
    for name, shape, dtype, _ in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype, produce in specs:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"tensor {name!r}: produced shape {arr.shape}, declared {shape}")
            f.write(arr.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())

"""TensorSource: the one interface the streaming loader reads checkpoint tensors through.

A source names its tensors as the checkpoint (or, for GGUF, as Transformers) names
them, tells their shapes and dtypes without reading data, and reads a window of
rows and columns of one tensor, so a rank never materialises another rank's rows.

SafetensorsSource reads the safetensors layout itself with positioned reads
(os.preadv straight into the returned tensor) rather than through a memory map:
a mapped column window faults in every page of the tensor and leaves the file's
pages counted in the rank's resident memory, so a rank reading half of each
matrix would show the whole checkpoint resident. pread moves exactly the
rank's bytes, and nothing stays mapped.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ster_dist.errors import Refusal
from ster_dist.shard.safetensors_header import DTYPES, entries


class TensorSource(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows (dim 0) and columns (dim 1) of one tensor; None means all. Never more than asked."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Entry:
    fd: int
    offset: int  # absolute byte offset of the tensor's data in its file
    shape: tuple[int, ...]
    dtype: torch.dtype


class SafetensorsSource:
    def __init__(self, files: list[Path] | tuple[Path, ...]):
        self._fds: list[int] = []
        self._entries: dict[str, _Entry] = {}
        self.bytes_read = 0
        for path in files:
            found = entries(path)  # the header, each entry checked against the file's size
            fd = os.open(path, os.O_RDONLY)
            self._fds.append(fd)
            for entry in found:
                if entry.name in self._entries:
                    raise Refusal(
                        f"tensor {entry.name} appears in two weight files (the second is {path}); "
                        "remove the duplicate shard"
                    )
                self._entries[entry.name] = _Entry(
                    fd, entry.offset, entry.shape, DTYPES[entry.dtype]
                )

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        entry = self._entries[name]
        (r0, r1), (c0, c1) = self._window(entry, rows, cols)
        shape = (
            (r1 - r0, c1 - c0)
            if c1 is not None
            else ((r1 - r0, *entry.shape[1:]) if entry.shape else ())
        )
        out = torch.empty(shape, dtype=entry.dtype)
        self._read(entry, out, r0, r1, c0, c1)
        return out

    def read_into(
        self, name: str, out: torch.Tensor, rows: slice | None = None, cols: slice | None = None
    ) -> bool:
        """Read straight into `out` (no temporary) when it is contiguous and of the stored dtype and
        shape; False when it is not, and the caller reads and converts instead."""
        entry = self._entries[name]
        if out.dtype != entry.dtype or not out.is_contiguous():
            return False
        (r0, r1), (c0, c1) = self._window(entry, rows, cols)
        shape = (
            (r1 - r0, c1 - c0)
            if c1 is not None
            else ((r1 - r0, *entry.shape[1:]) if entry.shape else ())
        )
        if tuple(out.shape) != tuple(shape):
            return False
        self._read(entry, out, r0, r1, c0, c1)
        return True

    @staticmethod
    def _window(entry: _Entry, rows, cols):
        shape = entry.shape
        if not shape:
            return (0, 1), (0, None)
        r0, r1 = _bounds(rows, shape[0])
        if cols is None or len(shape) < 2:
            return (r0, r1), (0, None)
        if len(shape) != 2:
            raise ValueError(f"column windows are read from matrices only; shape {list(shape)}")
        c0, c1 = _bounds(cols, shape[1])
        if (c0, c1) == (0, shape[1]):
            return (r0, r1), (0, None)  # every column: whole rows, one read
        return (r0, r1), (c0, c1)

    def _read(
        self, entry: _Entry, out: torch.Tensor, r0: int, r1: int, c0: int, c1: int | None
    ) -> None:
        item = entry.dtype.itemsize
        row_bytes = math.prod(entry.shape[1:]) * item
        if c1 is None:
            self._pread(entry.fd, out, entry.offset + r0 * row_bytes)
            return
        base = entry.offset + r0 * row_bytes + c0 * item
        for i in range(r1 - r0):
            self._pread(entry.fd, out[i], base + i * row_bytes)

    def read_window(self, name: str, window: tuple[slice, ...]) -> torch.Tensor:
        """A block of an N-d tensor, one slice per dimension, read as runs of contiguous bytes."""
        entry = self._entries[name]
        shape = entry.shape
        bounds = [w.indices(n)[:2] for w, n in zip(window, shape, strict=True)]
        out = torch.empty([max(0, b - a) for a, b in bounds], dtype=entry.dtype)
        if out.numel() == 0:
            return out
        # dimensions after `last` are read whole, so each run is contiguous: dim `last`'s range
        # times them
        last = len(shape) - 1
        while last > 0 and bounds[last] == (0, shape[last]):
            last -= 1
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        run = (bounds[last][1] - bounds[last][0]) * strides[last]
        flat = out.view(-1)
        item = entry.dtype.itemsize
        for i, index in enumerate(itertools.product(*(range(a, b) for a, b in bounds[:last]))):
            start = (
                sum(c * strides[d] for d, c in enumerate(index)) + bounds[last][0] * strides[last]
            )
            self._pread(entry.fd, flat[i * run : (i + 1) * run], entry.offset + start * item)
        return out

    def _pread(self, fd: int, out: torch.Tensor, offset: int) -> None:
        view = (
            memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            if out.numel()
            else memoryview(b"")
        )
        done, total = 0, len(view)
        while done < total:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise Refusal(
                    f"failed to read tensor data at byte {offset + done}: the file is truncated"
                )
            done += n
        self.bytes_read += total

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._entries.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _bounds(window: slice | None, length: int) -> tuple[int, int]:
    if window is None:
        return 0, length
    start, stop, step = window.indices(length)
    if step != 1:
        raise ValueError("strided windows are not read")
    return start, max(start, stop)

"""A safetensors file written in pieces: the header first (every shape is known once the prompts
are tokenized), then each batch's rows at their offsets, so a large capture never sits in memory
whole. Written beside the target and renamed at the end: a reader never sees half a file.

The layout is plain safetensors (8-byte little-endian header length, JSON header padded with
spaces to a multiple of 8, then the data), so `safetensors.safe_open` reads it back.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch

_DTYPES = {torch.float32: ("F32", 4), torch.int64: ("I64", 8)}


class StreamedSafetensors:
    def __init__(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]):
        self.path = Path(path)
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        header: dict[str, object] = {"__metadata__": dict(metadata)}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            tag, size = _DTYPES[dtype]
            count = 1
            for dim in shape:
                count *= dim
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + count * size]}
            self.layout[name] = (dtype, tuple(shape), offset, count * size)
            offset += count * size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.written = {name: 0 for name in tensors}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            os.write(self.fd, struct.pack("<Q", len(text)) + text)
            os.ftruncate(self.fd, self.data_start + offset)
        except BaseException:
            self.abort()
            raise

    def write_rows(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        """Rows [first_row, first_row + len(rows)) of tensor `name` (row-major along dim 0)."""
        dtype, shape, start, nbytes = self.layout[name]
        row_bytes = nbytes // shape[0] if shape and shape[0] else 0
        data = rows.to(dtype).contiguous().numpy().tobytes()
        if first_row < 0 or first_row * row_bytes + len(data) > nbytes:
            raise ValueError(f"rows {first_row}.. of {name} fall outside its {shape[0]} rows")
        view, at = memoryview(data), self.data_start + start + first_row * row_bytes
        while view:
            done = os.pwrite(self.fd, view, at)
            view, at = view[done:], at + done
        self.written[name] += len(data)

    def commit(self) -> None:
        short = [n for n, (_, _, _, nbytes) in self.layout.items() if self.written[n] != nbytes]
        if short:
            self.abort()
            raise ValueError(f"tensors not fully written: {', '.join(short)}")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        Path(self.tmp).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.abort()
        elif self.fd is not None:
            self.commit()

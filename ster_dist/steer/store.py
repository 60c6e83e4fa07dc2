"""A safetensors file written in pieces: the header first (every shape is known once the prompts
are tokenized), then each batch's rows at their offsets, so a large capture never sits in memory
whole. Written beside the target and renamed at the end (atomic.replacing): a reader never sees
half a file.

The header comes from shard/safetensors_header.py, the one writer of that format, so
`safetensors.safe_open` reads the file back.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ster_dist.atomic import replacing
from ster_dist.shard.safetensors_header import TAGS, data_offsets, header_bytes


class StreamedSafetensors:
    def __init__(
        self,
        path: Path,
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str],
    ):
        self.path = Path(path)
        specs = [(name, TAGS[dtype], tuple(shape)) for name, (dtype, shape) in tensors.items()]
        offsets = data_offsets(specs)
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {
            name: (dtype, tuple(shape), offsets[name][0], offsets[name][1] - offsets[name][0])
            for name, (dtype, shape) in tensors.items()
        }
        header = header_bytes(specs, metadata)
        self.data_start = len(header)
        self.written = {name: 0 for name in tensors}
        # held open across calls (commit renames, abort removes), so entered by hand rather than
        # with `with`
        self._target = replacing(self.path, binary=True, durable=True)
        # positioned writes only: the handle's buffer stays empty
        self.fd = self._target.__enter__().fileno()
        try:
            view, at = memoryview(header), 0
            while view:
                done = os.pwrite(self.fd, view, at)
                view, at = view[done:], at + done
            os.ftruncate(self.fd, self.data_start + sum(size for *_, size in self.layout.values()))
        except BaseException as exc:
            self._finish(exc)
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
        self._finish(None)

    def abort(self) -> None:
        self._finish(RuntimeError(f"writing {self.path} was abandoned"))

    def _finish(self, error: BaseException | None) -> None:
        """Leave the replacing block: renamed into place (fsynced first) without an error, removed
        with one."""
        if self.fd is None:
            return
        self.fd = None
        if error is None:
            self._target.__exit__(None, None, None)
        else:
            self._target.__exit__(type(error), error, error.__traceback__)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.abort()
        elif self.fd is not None:
            self.commit()

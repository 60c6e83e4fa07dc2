"""TensorSource: the one interface the streaming loader reads checkpoint tensors through.

A source names its tensors as the checkpoint (or, for GGUF, as Transformers) names
them, tells their shapes and dtypes without reading data, and reads a window of
rows and columns of one tensor, so a rank never materialises another rank's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import safe_open


class TensorSource(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """Rows (dim 0) and columns (dim 1) of one tensor; None means all. Never more than asked."""
        ...

    def close(self) -> None: ...


class SafetensorsSource:
    """Memory-mapped safetensors files; reads go through get_slice."""

    def __init__(self, files: list[Path] | tuple[Path, ...]):
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where: dict[str, object] = {}
        for handle, path in zip(self._handles, files):
            for name in handle.keys():
                if name in self._where:
                    from ster_dist.errors import Refusal

                    raise Refusal(f"tensor {name} appears in two weight files (the second is {path}); "
                                  "remove the duplicate shard")
                self._where[name] = handle
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._where[name].get_slice(name).get_dtype()]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        view = self._where[name].get_slice(name)
        ndim = len(view.get_shape())
        if rows is None and cols is None:
            out = view[:]
        elif ndim == 1:
            out = view[rows or slice(None)]
        else:
            out = view[rows or slice(None), cols or slice(None)]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def iter_names(source: TensorSource) -> Iterator[str]:
    yield from sorted(source.names())

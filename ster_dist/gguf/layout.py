"""check_layout: a .gguf file's header walked and bounded before gguf.GGUFReader parses it.

GGUFReader trusts every count and length it reads: an array declaring 2**60 elements past the
end of the file loops without end (each element read past the end is empty, so the offset never
moves), a tensor's dimensions multiply with numpy's wrap-around, nested arrays recurse without a
floor. This walk reads the same structure with Python integers and refuses, in one line, any count,
length, type or offset that does not fit inside the file, so the reader only ever sees a header
that describes bytes the file holds.

The walk also hands back what loading needs of the header (`Header`: its scalar and string metadata,
each tensor's name, type, dimensions and absolute offset), so a model directory's .gguf loads
without GGUFReader, which builds a numpy view for every token of the vocabulary: 20 s of a SmolLM2
load on 2 busy cores, against about 1 s here.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ster_dist.errors import Refusal

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # gguf_reader.READER_SUPPORTED_VERSIONS
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: llama.cpp writes none deeper than one
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# GGUF value type -> bytes of one scalar (strings and arrays are sized by what they hold)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_KNOWN_TYPES = {t.value: t for t in GGMLQuantizationType}


class _Walk:
    def __init__(self, data, path: Path, order: str):
        self.data, self.path, self.order, self.at = data, path, order, 0

    def fail(self, what: str) -> Refusal:
        return Refusal(
            f"GGUF file {self.path} is damaged: {what} (at byte {self.at} of {len(self.data)}); "
            "download or convert it again"
        )

    def take(self, size: int, what: str) -> int:
        if size > len(self.data) - self.at:
            raise self.fail(f"{what} needs {size} bytes but the file ends first")
        start = self.at
        self.at += size
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(
            self.data[start : start + size], "little" if self.order == "<" else "big"
        )

    def string(self, what: str) -> str:
        length = self.uint(8, f"the length of {what}")
        start = self.take(length, f"{what} of {length} bytes")
        try:
            return self.data[start : start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, what: str, depth: int = 0) -> object:
        """Skip one value of GGUF type `kind`; returns it when it is a scalar uint32 (alignment)."""
        if kind in _SCALAR:
            start = self.take(_SCALAR[kind], what)
            if kind == _UINT32:
                return struct.unpack_from(self.order + "I", self.data, start)[0]
            return None
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what} has value type {kind}, which GGUF does not define")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays deeper than {_MAX_NESTING}")
        item = self.uint(4, f"the item type of {what}")
        count = self.uint(8, f"the length of {what}")
        if item in _SCALAR:
            self.take(count * _SCALAR[item], f"{what}, {count} items of type {item}")
            return None
        if item not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has items of type {item}, which GGUF does not define")
        # every string or array item takes at least 8 bytes: a count past that cannot fit
        if count * 8 > len(self.data) - self.at:
            raise self.fail(f"{what} declares {count} items, more than the rest of the file holds")
        for index in range(count):
            self.value(item, f"item {index} of {what}", depth + 1)
        return None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header lists it, in GGUFReader's terms: dimensions innermost first (ggml's
    order), the storage type's number, and where its bytes start in the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    data_offset: int


@dataclass
class Header:
    # scalar uint32 and string metadata only
    fields: dict[str, object] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    little_endian: bool = True


def check_layout(path: Path) -> Header:
    """Refuse a GGUF file whose header does not fit inside it (see the module docstring); its
    Header."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size == 0:
                raise Refusal(f"GGUF file {path} is empty; download or convert it again")
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise Refusal(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
    try:
        return _walk(data, path)
    finally:
        data.close()


def _walk(data: mmap.mmap, path: Path) -> Header:
    walk = _Walk(data, path, "<")
    if bytes(data[:4]) != _MAGIC:
        raise Refusal(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); give a llama.cpp .gguf file"
        )
    walk.take(4, "the magic")
    version = walk.uint(4, "the version")
    # written on a machine of the other byte order, as GGUFReader reads it
    if version & 0xFFFF == 0:
        walk.order = ">"
        version = int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in _VERSIONS:
        raise Refusal(
            f"GGUF file {path} is version {version}; ster_dist reads versions "
            f"{', '.join(map(str, _VERSIONS))}; convert it with a current llama.cpp"
        )
    tensors = walk.uint(8, "the tensor count")
    fields = walk.uint(8, "the metadata count")
    # a metadata entry takes at least 13 bytes (key length, type, one byte), a tensor entry 24
    if fields * 13 + tensors * 24 > len(data) - walk.at:
        raise walk.fail(
            f"it declares {fields} metadata entries and {tensors} tensors, more than the file holds"
        )
    alignment = _DEFAULT_ALIGNMENT
    header = Header(little_endian=walk.order == "<")
    for index in range(fields):
        key = walk.string(f"the key of metadata entry {index}")
        kind = walk.uint(4, f"the type of {key!r}")
        value = walk.value(kind, f"metadata {key!r}")
        if value is not None:
            header.fields[key] = value
        if key == "general.alignment":
            if kind != _UINT32 or not value or value & (value - 1):
                raise walk.fail("general.alignment is not a power of two stored as uint32")
            alignment = value
    infos = []
    for index in range(tensors):
        name = walk.string(f"the name of tensor {index}")
        n_dims = walk.uint(4, f"the dimension count of tensor {name!r}")
        if n_dims > _MAX_DIMS:
            raise walk.fail(
                f"tensor {name!r} has {n_dims} dimensions; GGUF tensors have at most {_MAX_DIMS}"
            )
        dims = [walk.uint(8, f"a dimension of tensor {name!r}") for _ in range(n_dims)]
        kind = walk.uint(4, f"the type of tensor {name!r}")
        offset = walk.uint(8, f"the data offset of tensor {name!r}")
        infos.append((name, dims, kind, offset))
    data_start = -(-walk.at // alignment) * alignment
    room = len(data) - data_start
    for name, dims, kind, offset in infos:
        qtype = _KNOWN_TYPES.get(kind)
        if qtype is None or qtype not in GGML_QUANT_SIZES:
            raise walk.fail(f"tensor {name!r} has storage type {kind}, which GGUF does not define")
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise walk.fail(
                f"tensor {name!r} has rows of {dims[0]} values, not whole {qtype.name} blocks of {block}"
            )
        count = 1
        for d in dims:
            count *= d
        nbytes = count // block * type_size
        if offset + nbytes > room:
            raise walk.fail(
                f"tensor {name!r} ({' x '.join(map(str, dims)) or 'scalar'} {qtype.name}, {nbytes} "
                f"bytes at data offset {offset}) reaches past the end of the file"
            )
        header.tensors.append(
            TensorInfo(name, qtype, np.array(dims, dtype=np.int64), data_start + offset)
        )
    return header

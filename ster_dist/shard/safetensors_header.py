"""The safetensors header, read and written in one place.

A safetensors file is an 8-byte little-endian header length, a JSON object (each tensor's name ->
dtype tag, shape and data offsets relative to the data's start, plus an optional "__metadata__"
object of strings), padded with spaces to a multiple of 8 so the data is aligned, then the data.
Every reader of headers (the loader's source, the merge planner, adapter and artifact checks) and
every writer (merged shards, streamed captures) goes through here, so the format's rules and the
refusals for a damaged file are stated once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch

from ster_dist.errors import Refusal

METADATA = "__metadata__"
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TAGS = {dtype: tag for tag, dtype in DTYPES.items()}
# a larger claimed length is a damaged or foreign file, not a header worth reading into memory
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One tensor of a file, checked against the file: its data lies inside it and fits its
    shape."""

    name: str
    dtype: str  # the safetensors tag: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    # name -> the stored entry (dtype, shape, data_offsets), in the JSON's order
    tensors: dict[str, dict]
    metadata: dict
    data_start: int  # where the data begins: 8 + the JSON's length


FIX = "the file is damaged or not safetensors; re-download it"


def _refusal(path, why: str) -> Refusal:
    return Refusal(f"failed to map {path}: {why}; {FIX}")


def _shown(name: str) -> str:
    # a fuzzed or damaged name can be megabytes long: the refusal stays one readable line
    return name if len(name) <= 120 else name[:117] + "..."


def read_header(path) -> Header:
    """The header of one file, every entry checked against the format and the file's size before any
    tensor is read; a file that is not safetensors is refused as `failed to map PATH: why; fix`."""
    path = Path(path)
    twice: list[str] = []

    def pairs(items):
        # called for every object, the outermost last: `twice` ends as the top level's repeated
        # names
        out, twice[:] = {}, []
        for key, value in items:
            if key in out:
                twice.append(key)
            out[key] = value
        return out

    try:
        # O_NONBLOCK: opening a FIFO named *.safetensors would otherwise wait for a writer forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise _refusal(path, f"it cannot be opened ({exc.strerror or exc})") from None
    _check_regular(path, fd)
    with open(fd, "rb") as handle:
        try:
            size = os.fstat(fd).st_size
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise _refusal(
                    path, "not a safetensors file (shorter than its 8-byte header length)"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER or 8 + length > size:
                raise _refusal(
                    path, f"its safetensors header claims {length} bytes of a {size}-byte file"
                )
            raw = handle.read(length)
        except OSError as exc:
            raise _refusal(path, f"it cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:
        # RecursionError: deeply nested JSON, which no safetensors writer produces
        # (UnicodeDecodeError is a ValueError)
        raise _refusal(
            path, f"its header is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    if not isinstance(header, dict):
        raise _refusal(
            path, f"its safetensors header is a JSON {type(header).__name__}, not an object"
        )
    if twice:  # json.loads keeps the last entry: which one the writer meant is unknown
        raise Refusal(
            f"model weight {_shown(twice[0])} appears twice in {path.name}; the weight file is corrupt: "
            "re-export it"
        )
    metadata = _metadata(path, header.pop(METADATA, None))
    _check_entries(path, header, size - 8 - length)
    return Header(header, metadata, 8 + length)


def _check_regular(path, fd: int) -> None:
    """A directory, FIFO or device is refused (and `fd` closed): only a regular file has a size to
    check."""
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refusal(path, "it is not a regular file")


def _metadata(path, metadata) -> dict:
    """__metadata__ is an object of strings by the format; anything else is a damaged header."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refusal(path, "its __metadata__ is not an object of strings")
    return metadata


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a size


def _check_entry(path, name: str, info, data_size: int) -> tuple[int, int]:
    """One tensor's entry: a known dtype, a shape of sizes, offsets inside the data that fit the
    shape. Returns its (begin, end) relative to the data's start."""
    where = f"tensor {_shown(name)}"
    if not isinstance(info, dict):
        raise _refusal(
            path, f"{where} has a JSON {type(info).__name__} for its entry, not an object"
        )
    tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(tag, str) or tag not in DTYPES:
        raise _refusal(path, f"{where} has dtype {str(tag)[:40]!r}, not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _refusal(
            path, f"{where} has shape {str(shape)[:80]}, not a list of non-negative integers"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) for n in offsets):
        raise _refusal(path, f"{where} has data_offsets {str(offsets)[:80]}, not two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _refusal(
            path, f"{where} has data_offsets [{begin}, {end}] outside its {data_size}-byte data"
        )
    if end - begin != math.prod(shape) * DTYPES[tag].itemsize:
        raise _refusal(path, f"{where} has {end - begin} bytes of data for shape {shape} in {tag}")
    return begin, end


def _check_entries(path, tensors: dict, data_size: int) -> None:
    """Every entry checked, then no two tensors' data overlapping (one would be read as the
    other)."""
    spans = sorted(
        (*_check_entry(path, name, info, data_size), name) for name, info in tensors.items()
    )
    last_end, last_name = 0, None
    for begin, end, name in spans:
        if begin == end:  # an empty tensor has no bytes to share
            continue
        if begin < last_end:
            raise _refusal(
                path, f"tensor {_shown(name)}'s data overlaps tensor {_shown(last_name)}'s"
            )
        last_end, last_name = end, name


def entries(path, header: Header | None = None) -> list[Entry]:
    """Every tensor of one file, in the header's order; read_header has checked each one."""
    header = header or read_header(path)
    out = []
    for name, info in header.tensors.items():
        start, stop = info["data_offsets"]
        out.append(
            Entry(
                name, info["dtype"], tuple(info["shape"]), header.data_start + start, stop - start
            )
        )
    return out


def data_offsets(tensors) -> dict[str, tuple[int, int]]:
    """(start, stop) of each tensor's data, relative to the data's start, laid out in the given
    order.
    `tensors`: (name, dtype tag, shape) triples."""
    out, offset = {}, 0
    for name, tag, shape in tensors:
        nbytes = math.prod(shape) * DTYPES[tag].itemsize
        out[name] = (offset, offset + nbytes)
        offset += nbytes
    return out


def header_bytes(tensors, metadata: dict | None = None) -> bytes:
    """The length prefix and header of a file holding `tensors` ((name, dtype tag, shape) triples,
    data in that order), with `metadata` (string values) when given; padded to a multiple of 8."""
    tensors = list(tensors)
    header: dict = {} if metadata is None else {METADATA: dict(metadata)}
    for (name, tag, shape), (start, stop) in zip(tensors, data_offsets(tensors).values()):
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [start, stop]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw

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
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ster_dist.errors import Refusal

METADATA = "__metadata__"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
TAGS = {dtype: tag for tag, dtype in DTYPES.items()}
# a larger claimed length is a damaged or foreign file, not a header worth reading into memory
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One tensor of a file, checked against the file: its data lies inside it and fits its shape."""

    name: str
    dtype: str  # the safetensors tag: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, dict]  # name -> the stored entry (dtype, shape, data_offsets), in the JSON's order
    metadata: dict
    data_start: int  # where the data begins: 8 + the JSON's length
    twice: tuple[str, ...] = ()  # names the JSON states more than once (json.loads keeps the last)


def read_header(path) -> Header:
    """The header of one file; a file that is not safetensors is refused as `failed to map PATH: why`."""
    path = Path(path)
    twice: list[str] = []

    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                twice.append(key)
            out[key] = value
        return out

    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise Refusal(f"failed to map {path}: not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER:
                raise Refusal(f"failed to map {path}: its safetensors header claims {length} bytes")
            header = json.loads(handle.read(length), object_pairs_hook=pairs)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise Refusal(f"failed to map {path}: {exc}") from None
    if not isinstance(header, dict):
        raise Refusal(f"failed to map {path}: its safetensors header is not a JSON object")
    metadata = header.pop(METADATA, None) or {}
    return Header(header, metadata, 8 + length, tuple(twice))


def entries(path, header: Header | None = None) -> list[Entry]:
    """Every tensor of one file, in the header's order, each checked: a known dtype, data offsets
    that match its shape, data inside the file. One that fails is refused by name."""
    path = Path(path)
    header = header or read_header(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise Refusal(f"failed to map {path}: {exc}") from None
    out = []
    for name, info in header.tensors.items():
        tag = info.get("dtype") if isinstance(info, dict) else None
        shape = tuple(info.get("shape", ())) if isinstance(info, dict) else ()
        start, stop = info.get("data_offsets", (0, -1)) if isinstance(info, dict) else (0, -1)
        if tag not in DTYPES or stop - start != math.prod(shape) * DTYPES[tag].itemsize \
                or header.data_start + stop > size:
            raise Refusal(f"failed to map {path}: tensor {name} has an unreadable entry "
                          f"(dtype {tag}, shape {list(shape)})")
        out.append(Entry(name, tag, shape, header.data_start + start, stop - start))
    return out


def data_offsets(tensors) -> dict[str, tuple[int, int]]:
    """(start, stop) of each tensor's data, relative to the data's start, laid out in the given order.
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

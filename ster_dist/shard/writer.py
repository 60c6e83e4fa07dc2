"""The merge writer: the shard plan walked backwards, and safetensors shards written tensor by
tensor.

`placements` answers the inverse of the loader's question: for a decoder parameter, which
checkpoint tensor holds its rows and which rows they are. It reads the same FamilySpec rules
through the same matcher as shard/plan.py, and fused layouts through the same
`fused_source_rows`, so a parameter's rows go back exactly where the loader took them from
(rows of Phi-3's qkv_proj and gate_up_proj, GPT-NeoX's head-by-head query_key_value, the
columns of GPT-2's inputs-first Conv1D).

`write_shard` writes one safetensors file from source tensors: a tensor with no update is
copied byte for byte from its source file (copy_file_range: the bytes never enter this
process), a tensor with updates is read in row blocks with positioned reads, the low-rank
deltas are added in f32 and the sum is cast back to the source dtype. The file is written
beside its final name and renamed only when complete, so a finished shard is never half a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ster_dist.atomic import replacing
from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.families.spec import FamilySpec, Fused, target_name
from ster_dist.shard.names import NameMatcher
from ster_dist.shard.plan import fused_source_rows, size_of
from ster_dist.shard.safetensors_header import DTYPES, header_bytes
from ster_dist.shard.source import SafetensorsSource

_COPY_CHUNK = 16 << 20
_WRITE_CHUNK = 1 << 20
_BLOCK_BYTES = 8 << 20  # f32 bytes of one block of an updated tensor's rows
_ALLOCATOR_SET = False


@dataclass(frozen=True)
class Placement:
    """Where a decoder parameter's rows live in the checkpoint."""

    tensor: str
    # (tensor row start, stop, parameter row offset); None: all
    runs: tuple[tuple[int, int, int], ...] | None
    transposed: bool = False  # stored inputs-first: the parameter's rows are the tensor's columns


def placements(
    spec: FamilySpec, cfg: ModelConfig, names: list[str], params: set[str]
) -> dict[str, Placement]:
    """The placement of each of `params` among the checkpoint tensor `names` (absent when none holds
    it)."""
    matcher = NameMatcher(spec, cfg.wrapper, params)
    out: dict[str, Placement] = {}
    for name in names:
        if matcher.ignored(name):
            continue
        found = matcher.match(name)
        if found is None:
            continue
        rule, groups = found
        if groups.get("h") is not None:
            continue  # one row of a stacked parameter (per-head norms): never a projection
        if isinstance(rule.target, str):
            param = target_name(rule.target, groups)
            if param in params:
                out[param] = Placement(name, None, rule.transposed)
            continue
        layout: Fused = rule.target
        layer = int(groups["i"]) if groups.get("i") is not None else None
        for index, (template, count) in enumerate(layout.parts):
            param = target_name(template, groups)
            if param in params:
                rows = (0, part_rows(layout, count, cfg, layer))
                out[param] = Placement(
                    name, tuple(fused_source_rows(layout, index, rows, cfg, layer)), rule.transposed
                )
    return out


def part_rows(layout: Fused, count: str, cfg: ModelConfig, layer: int | None = None) -> int:
    """Global rows of one part of a fused tensor (of `layer`, where its parts differ from layer to
    layer)."""
    return size_of(layout.groups, cfg) * size_of(count, cfg, layer) * size_of(layout.unit, cfg)


@dataclass(frozen=True)
class Update:
    """(b @ a) * scale added to some rows of a tensor, in its outputs-first orientation."""

    a: torch.Tensor  # [rank, inputs]
    b: torch.Tensor  # [rows, rank]: the parameter's rows in its own order
    scale: float
    runs: tuple[tuple[int, int, int], ...] | None  # see Placement.runs


@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output shard: where its bytes come from, and what is added to it."""

    name: str
    dtype: str  # safetensors dtype name, the source's
    shape: tuple[int, ...]
    file: str  # the source weight file
    offset: int  # absolute byte offset of its data there
    nbytes: int
    transposed: bool = False
    updates: tuple[Update, ...] = ()


def split_shards(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Consecutive groups of at most max_bytes of data (a larger tensor gets a shard of its own)."""
    shards: list[list[OutTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards if shards[0] else []


def shard_names(count: int, stem: str = "model") -> list[str]:
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shard_header(tensors: list[OutTensor]) -> bytes:
    """The safetensors header of a shard holding `tensors` in order, with Transformers' format
    tag."""
    return header_bytes(((t.name, t.dtype, t.shape) for t in tensors), {"format": "pt"})


def shard_size(tensors: list[OutTensor]) -> int:
    return len(shard_header(tensors)) + sum(t.nbytes for t in tensors)


def write_shard(path: Path, tensors: list[OutTensor], durable: bool = True) -> int:
    """Write one shard at `path` (beside it, renamed when whole); returns the bytes written.
    `durable`: fsync before the rename, so a shard renamed into place is a whole shard even after a
    crash."""
    _return_large_blocks()
    sources = sorted({t.file for t in tensors if t.updates})
    reader = SafetensorsSource([Path(f) for f in sources]) if sources else None
    inputs: dict[str, int] = {}
    try:
        with replacing(path, binary=True, durable=durable) as handle, one_thread():
            # raw writes and copy_file_range only: the handle's buffer stays empty
            fd = handle.fileno()
            written = _write_all(fd, shard_header(tensors))
            for tensor in tensors:
                if tensor.updates:
                    for block in merged_blocks(reader, tensor):
                        written += _write_all(fd, block)
                    continue
                if tensor.file not in inputs:
                    inputs[tensor.file] = os.open(tensor.file, os.O_RDONLY)
                written += copy_range(inputs[tensor.file], tensor.offset, tensor.nbytes, fd)
        return written
    finally:
        for handle in inputs.values():
            os.close(handle)
        if reader is not None:
            reader.close()


def merged_blocks(reader: SafetensorsSource, tensor: OutTensor):
    """The bytes of base + sum of updates, cast back to the base's dtype, in row blocks.

    Outputs-first tensors go by blocks of rows: each row of (b @ a) is the same dot products
    whatever block it is computed in, so the result is the whole-matrix product's bit for bit.
    An inputs-first tensor (GPT-2's Conv1D) has its outputs as columns; a column block of the
    product would not be bit-identical, so it is merged whole (such tensors are small).
    """
    dtype = DTYPES[tensor.dtype]
    if len(tensor.shape) != 2:
        raise ValueError(
            f"low-rank updates apply to matrices; {tensor.name} has shape {list(tensor.shape)}"
        )
    if tensor.transposed:
        weight = reader.read(tensor.name).float()
        for update in tensor.updates:
            delta = (update.b @ update.a) * update.scale
            for t0, t1, d in update.runs or ((0, delta.shape[0], 0),):
                weight[:, t0:t1] += delta[d : d + t1 - t0].t()
        yield _as_bytes(weight.to(dtype))
        return
    rows, cols = tensor.shape
    step = max(1, min(rows, _BLOCK_BYTES // max(1, cols * 4)))
    # buffers reused by every block: fresh pages fault in at a third of copy speed (ENV-NOTES)
    delta = torch.empty(step, cols)
    wide = torch.empty(step, cols) if dtype != torch.float32 else None
    narrow = torch.empty(step, cols, dtype=dtype) if dtype != torch.float32 else None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        block = reader.read(tensor.name, rows=slice(r0, r1))
        weight = block if wide is None else wide[: r1 - r0].copy_(block)
        for update in tensor.updates:
            for t0, t1, d in update.runs or ((0, rows, 0),):
                x0, x1 = max(t0, r0), min(t1, r1)
                if x0 < x1:
                    part = delta[: x1 - x0]
                    torch.matmul(update.b[d + x0 - t0 : d + x1 - t0], update.a, out=part)
                    # (b @ a) * scale, as PEFT computes it
                    weight[x0 - r0 : x1 - r0] += part.mul_(update.scale)
        yield _as_bytes(weight if narrow is None else narrow[: r1 - r0].copy_(weight))


@contextlib.contextmanager
def one_thread():
    """Run memory-bound tensor arithmetic on one thread.

    A merge's arithmetic moves bytes rather than multiplying much; one thread keeps pace with the
    disk, while two OpenMP threads on busy cores stalled 10-40x at every barrier (measured).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _return_large_blocks() -> None:
    """Have glibc map every block of 1 MB or more and give it back when freed.

    By default glibc raises its mmap threshold each time a large block is freed, so the next
    blocks of that size come from the heap and stay resident after use: a merge's peak RSS then
    creeps toward the model's size although it holds a few blocks at a time (measured: 113 MB
    against 60 MB with the threshold fixed, on a 545 MB checkpoint).
    """
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET:
        return
    _ALLOCATOR_SET = True
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator decides
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed, no longer adjusted


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _write_all(fd: int, data) -> int:
    view = memoryview(data).cast("B")
    done = 0
    # in 1 MB writes: single writes of tens of MB ran 6x slower on ext4 (measured)
    while done < len(view):
        done += os.write(fd, view[done : done + _WRITE_CHUNK])
    return done


def copy_range(src: int, offset: int, count: int, dst: int) -> int:
    """Append count bytes of src from offset to dst: in the kernel when it can, else in 16 MB
    chunks."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < count:
                n = os.copy_file_range(src, dst, count - done, offset + done)
                if n <= 0:
                    raise Refusal(
                        f"a weight file ended {count - done} bytes early; the checkpoint is truncated"
                    )
                done += n
            return done
        except OSError as exc:
            if done or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
    while done < count:  # file systems without copy_file_range
        chunk = os.pread(src, min(_COPY_CHUNK, count - done), offset + done)
        if not chunk:
            raise Refusal(
                f"a weight file ended {count - done} bytes early; the checkpoint is truncated"
            )
        done += _write_all(dst, chunk)
    return done

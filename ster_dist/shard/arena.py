"""A rank's parameters in one block of memory, in 2 MiB pages where the kernel allows.

`allocate` takes the place of `Module.to_empty` on the CPU. Decoding one token reads every weight
once, so how the weights lie in memory sets the step's speed: spread over 4 KiB pages, each page
costs a TLB miss and stops the hardware prefetcher at its end. On this project's 2-core test
machine, SmolLM2's compiled one-token step ran 13-16% faster with its weights in transparent huge
pages (bench/README.md); llama.cpp gets them from the page cache of its mapped GGUF. One block also
lets a fused product's parts be laid out one after another, so `FusedColumns.fuse` can take a view
of them instead of a second, concatenated copy.

Huge pages are asked for with madvise(MADV_HUGEPAGE) before the loader writes any byte (Linux only;
where the system disallows them the block simply stays in 4 KiB pages). The block is an anonymous
memory map, freed when the last parameter over it goes.
"""

from __future__ import annotations

import mmap
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64  # bytes: each run of tensors starts on a cache line
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def allocate(
    model: nn.Module, device: str | torch.device, runs: list[list[nn.Parameter]] = ()
) -> None:
    """Give every parameter and buffer of `model` fresh, uninitialised memory on `device`, as
    `model.to_empty(device)` does; on the CPU the parameters lie in one block. Each of `runs`
    (parameters a product joins, in order) is laid out back to back, without padding, where all its
    members are held.

    Each run, and each parameter outside one, gets a storage of its own over its bytes of the block:
    torch takes tensors of one storage for aliases, and torch.compile will not pass aliased inputs
    into a region several layers share (the one-token stack, model/compiled.py)."""
    device = torch.device(device)
    if device.type != "cpu":
        model.to_empty(device=device)
        return
    owners = [
        (module, attr, param)
        for module in model.modules()
        for attr, param in module._parameters.items()
        if param is not None
    ]
    unique = {id(param): param for _, _, param in owners}
    pieces, size = _layout(list(unique.values()), runs)
    block = Block(size)
    fresh = {}
    for start, members in pieces:
        span = block.piece(start, sum(_nbytes(p) for p in members))
        offset = 0
        for param in members:
            view = span[offset : offset + _nbytes(param)].view(param.dtype).view(param.shape)
            fresh[id(param)] = nn.Parameter(view, requires_grad=param.requires_grad)
            offset += _nbytes(param)
    for module, attr, param in owners:
        module._parameters[attr] = fresh[id(param)]
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def _nbytes(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _layout(params: list[nn.Parameter], runs) -> tuple[list[tuple[int, list[nn.Parameter]]], int]:
    """([(byte offset, parameters laid out from it)], block size): parameters in order, a run's
    members together at its first."""
    held = {id(p) for p in params}
    run_of = {}
    for run in runs:
        if (
            len(run) > 1
            and all(p is not None and id(p) in held for p in run)
            and len({id(p) for p in run}) == len(run)
        ):
            for p in run:
                run_of.setdefault(id(p), run)
    placed: set[int] = set()
    pieces = []
    end = 0
    for param in params:
        if id(param) in placed:
            continue
        members = run_of.get(id(param), [param])
        if any(id(p) in placed for p in members):  # a member already placed by another run
            members = [param]
        end = -(-end // ALIGN) * ALIGN
        pieces.append((end, members))
        placed.update(id(p) for p in members)
        end += sum(_nbytes(p) for p in members)
    return pieces, end


class Block:
    """`nbytes` of anonymous memory; a large block starts on a huge page and is advised to use them
    before anything is written. Freed when the last tensor over it goes (each holds the mapping)."""

    def __init__(self, nbytes: int):
        huge = nbytes >= 4 * HUGE_PAGE and sys.platform.startswith("linux")
        size = max(nbytes + (HUGE_PAGE if huge else 0), 1)
        # private: Python's default for anonymous maps is shared memory, which huge-page advice does
        # not reach
        # and a forked child would write through
        private = getattr(mmap, "MAP_PRIVATE", None)
        self.map = (
            mmap.mmap(-1, size)
            if private is None
            else mmap.mmap(-1, size, flags=private | mmap.MAP_ANONYMOUS)
        )
        self.start = 0
        if huge:
            address = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
            self.start = -address % HUGE_PAGE
            # whole huge pages inside the map
            span = (len(self.map) - self.start) // HUGE_PAGE * HUGE_PAGE
            # advice only: where the system has no transparent huge pages the block works the same
            try:
                self.map.madvise(MADV_HUGEPAGE, self.start, span)
            except (OSError, ValueError):
                pass

    def piece(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the block as a uint8 tensor with a storage of its
        own."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(
            self.map, dtype=torch.uint8, count=nbytes, offset=self.start + offset
        )

"""ParallelCtx: which tensor-parallel rank this process is, passed explicitly to every layer.

Layers take global sizes and ask the context for their local share; nothing
reads a global rank. World size 1 runs the same code with no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """Which part of a parameter's global tensor this rank holds: ranges along one dim (None: all)."""

    global_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    pad_to: int | None = None  # local rows allocated (vocab padding); rows past the ranges stay zero

    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        shape = list(self.global_shape)
        shape[self.dim] = self.pad_to if self.pad_to is not None else sum(b - a for a, b in self.ranges)
        return tuple(shape)


@dataclass(frozen=True)
class ParallelCtx:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None

    # -- shares ---------------------------------------------------------------
    def even(self, total: int, what: str) -> tuple[int, int]:
        if total % self.tp_size:
            from ster_dist.errors import Refusal

            raise Refusal(f"{what} ({total}) does not divide over {self.tp_size} tensor-parallel ranks; "
                          "choose a --tp that divides it")
        size = total // self.tp_size
        return self.tp_rank * size, (self.tp_rank + 1) * size

    def heads(self, num_heads: int) -> tuple[int, int]:
        return self.even(num_heads, "the number of attention heads")

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """Key-value heads split when there are at least as many as ranks, else one replicated per rank."""
        if num_kv_heads >= self.tp_size:
            return self.even(num_kv_heads, "the number of key-value heads")
        if self.tp_size % num_kv_heads:
            from ster_dist.errors import Refusal

            raise Refusal(f"{num_kv_heads} key-value heads cannot be replicated evenly over {self.tp_size} "
                          "ranks; choose a --tp that is a multiple of the key-value heads")
        head = self.tp_rank * num_kv_heads // self.tp_size
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, last row, padded local rows): the vocabulary padded to a multiple of tp."""
        per_rank = -(-vocab_size // self.tp_size)
        start = min(self.tp_rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size), per_rank

    # -- collectives ----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


SINGLE = ParallelCtx()

"""ParallelCtx: which tensor-, expert- and pipeline-parallel rank this process is, passed explicitly
to every layer.

Layers take global sizes and ask the context for their local share; nothing
reads a global rank. World size 1 runs the same code with no process group.

World rank r of tp x ep ranks is tensor-parallel rank r % tp and expert-parallel
rank r // tp: a tensor-parallel group is tp consecutive ranks (one node's GPUs),
an expert-parallel group the ranks of one tensor-parallel position across them.
Dense layers are split over the tp group and replicated over the ep group;
experts are split in contiguous blocks over the ep group, and each expert's
matrices over the tp group like a dense feed-forward.

Under pipeline parallelism the world is pp stages of tp x ep ranks each, stage s holding world ranks
s*tp*ep .. (s+1)*tp*ep - 1: a stage's tensor- and expert-parallel groups are the ones above within
it, and each rank passes its activations to the rank of the same position in the next stage
(parallel/pipeline.py splits the layers between stages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """Which part of a parameter's global tensor this rank holds: ranges along one dim (None:
    all)."""

    global_shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    # local rows allocated (vocab padding); rows past the ranges stay zero
    pad_to: int | None = None
    # a stacked expert parameter: the experts (dim 0) this rank holds
    experts: tuple[int, int] | None = None

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        if self.experts is not None:
            shape[0] = self.experts[1] - self.experts[0]
        if self.dim is not None:
            shape[self.dim] = (
                self.pad_to if self.pad_to is not None else sum(b - a for a, b in self.ranges)
            )
        return tuple(shape)


@dataclass(frozen=True)
class ParallelCtx:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object | None = None
    pp_rank: int = 0
    pp_size: int = 1
    # the world rank this one receives its stage input from (None: the first stage)
    pp_prev: int | None = None
    pp_next: int | None = None  # the world rank it sends its stage output to (None: the last stage)
    sampler: int = 0  # the world rank whose logits choose the tokens: the last stage's first rank

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # -- shares ---------------------------------------------------------------
    def split(self, total: int) -> tuple[int, int]:
        """This rank's share of `total` rows, balanced: shares differ by at most one."""
        return self.tp_rank * total // self.tp_size, (self.tp_rank + 1) * total // self.tp_size

    def attention_heads(
        self, num_heads: int, num_kv_heads: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(query heads, key-value heads) this rank holds, keeping each query head with its
        key-value head.

        With at least as many key-value heads as ranks, key-value heads are split (balanced, so
        SmolLM2's 3 over 2 ranks is 1 + 2) and each brings its query heads. With fewer, each
        key-value head is replicated on tp / kv ranks, which split its query heads between them.
        """
        if num_heads % num_kv_heads:
            from ster_dist.errors import Refusal

            raise Refusal(
                f"{num_heads} attention heads do not group over {num_kv_heads} key-value heads; "
                "the config is inconsistent"
            )
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.tp_size:
            k0, k1 = self.split(num_kv_heads)
            return (k0 * group, k1 * group), (k0, k1)
        if self.tp_size % num_kv_heads:
            from ster_dist.errors import Refusal

            raise Refusal(
                f"{num_kv_heads} key-value heads cannot be replicated evenly over {self.tp_size} "
                "ranks; choose a --tp that is a multiple or a divisor of the key-value heads"
            )
        per_head = self.tp_size // num_kv_heads
        kv, j = divmod(self.tp_rank, per_head)
        if group < per_head:
            from ster_dist.errors import Refusal

            raise Refusal(
                f"{num_heads} attention heads are fewer than {self.tp_size} ranks can share; "
                "lower --tp"
            )
        q0, q1 = kv * group + j * group // per_head, kv * group + (j + 1) * group // per_head
        return (q0, q1), (kv, kv + 1)

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first row, last row, padded local rows): the vocabulary padded to a multiple of tp."""
        per_rank = -(-vocab_size // self.tp_size)
        start = min(self.tp_rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size), per_rank

    def experts(self, num_experts: int) -> tuple[int, int]:
        """The contiguous block of experts this expert-parallel rank holds (balanced: 5 over 2 is 2
        + 3)."""
        return self.ep_rank * num_experts // self.ep_size, (
            self.ep_rank + 1
        ) * num_experts // self.ep_size

    def token_share(self, tokens: int) -> tuple[int, int]:
        """The rows of a replicated [tokens, hidden] batch this expert-parallel rank dispatches."""
        return self.ep_rank * tokens // self.ep_size, (self.ep_rank + 1) * tokens // self.ep_size

    # -- collectives ----------------------------------------------------------
    def send_next(self, x: torch.Tensor) -> None:
        """This stage's output to the next stage's rank of the same position."""
        dist.send(x.contiguous(), dst=self.pp_next)

    def recv_prev(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's output: every rank knows the shape, from the token ids all ranks
        hold."""
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=self.pp_prev)
        return x

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

    def ep_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every expert-parallel rank's x (partial sums of one shape), added in f32: one
        gather (gloo's all_gather_single took 0.6 ms between two processes here, its all_reduce 1.65
        ms)."""
        if self.ep_size == 1:
            return x
        # gloo gathers into the concatenation
        out = x.new_empty((self.ep_size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=self.ep_group)
        return out.view(self.ep_size, *x.shape).float().sum(0).to(x.dtype)

    def ep_gather_rows(self, x: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every expert-parallel rank's token share [its rows, ...] back into the whole [tokens,
        ...].

        Shares differ by at most one row; gloo gathers only equal sizes, so each is padded
        to the largest share and the padding cut away."""
        if self.ep_size == 1:
            return x
        width = -(-tokens // self.ep_size)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((width * self.ep_size, *x.shape[1:]))
        dist.all_gather_single(out, padded, group=self.ep_group)
        rows = [
            out[
                r * width : r * width
                + (r + 1) * tokens // self.ep_size
                - r * tokens // self.ep_size
            ]
            for r in range(self.ep_size)
        ]
        return torch.cat(rows)


SINGLE = ParallelCtx()

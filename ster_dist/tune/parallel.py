"""The dp x tp layout of a training run, and collectives that carry gradients.

World rank r of dp x tp ranks is tensor-parallel rank r % tp and data-parallel rank r // tp, as
parallel/ctx.py lays out tp x ep: a tensor-parallel group is tp consecutive ranks, a data-parallel
group the ranks of one tensor-parallel position across them. Every rank creates every group, in the
same order, as torch.distributed requires; the groups are kept per process, so a rank that trains
twice reuses them.

Why gradients come out right across tensor-parallel ranks: every rank runs the same replicated
computation (norms, residual stream, loss) around its own shards, so each holds an identical copy of
the loss. The run is treated as one program whose objective is the mean of those copies (each rank
backpropagates loss / tp), every collective gets its true adjoint as backward (an all-reduce's is an
all-reduce; an all-gather's is the sum of every copy's gradient, cut to this rank's part), and a
trainable parameter replicated on every tensor-parallel rank has its gradient summed over them. The
decoder's layers reach other ranks only through ctx.all_reduce and ctx.all_gather_last, so TrainCtx
overriding those two is all the decoder needs: no layer changes for training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ster_dist.parallel.ctx import ParallelCtx


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.width = group, rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return (
            grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(),
            None,
            None,
            None,
        )


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over the group: a parameter every rank holds whole."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass(frozen=True)
class TrainCtx(ParallelCtx):
    """A ParallelCtx whose collectives are differentiable (see the module docstring)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        return _AllReduce.apply(x, self.tp_group)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        return _GatherLast.apply(x, self.tp_group, self.tp_rank, self.tp_size)

    def sum_grad(self, param: torch.Tensor) -> torch.Tensor:
        """`param` as used on this rank, its gradient summed over the tensor-parallel ranks."""
        if self.tp_size == 1:
            return param
        return _SumGrad.apply(param, self.tp_group)


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    rank: int
    tp_group: object
    dp_group: object

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    def ctx(self) -> TrainCtx:
        return TrainCtx(self.tp_rank, self.tp, self.tp_group if self.tp > 1 else None)

    def mpu(self) -> ModelParallelView:
        return ModelParallelView(self)


_LAYOUTS: dict[tuple[int, int], Layout] = {}


def layout(dp: int, tp: int) -> Layout:
    """This rank's place in dp x tp ranks; the process group must already span exactly dp * tp
    ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != dp * tp:
        raise RuntimeError(f"the process group has {world} ranks, the run needs dp {dp} x tp {tp}")
    key = (dp, tp)
    if key not in _LAYOUTS:
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        _LAYOUTS[key] = Layout(dp, tp, rank, tp_groups[rank // tp], dp_groups[rank % tp])
    return _LAYOUTS[key]


def forget_layouts() -> None:
    """The process group these layouts were made in is gone (a one-rank run destroys its own)."""
    _LAYOUTS.clear()


class ModelParallelView:
    """What DeepSpeed asks its `mpu` argument: the data-parallel group it averages gradients and
    partitions optimizer state over, and the model-parallel group that already shares the model."""

    def __init__(self, lay: Layout):
        self.lay = lay

    def get_model_parallel_rank(self) -> int:
        return self.lay.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.lay.tp

    def get_model_parallel_group(self):
        return self.lay.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.lay.dp_rank * self.lay.tp

    def get_data_parallel_rank(self) -> int:
        return self.lay.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.lay.dp

    def get_data_parallel_group(self):
        return self.lay.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return [d * self.lay.tp + self.lay.tp_rank for d in range(self.lay.dp)]

"""A paged step's attention through the Triton kernels (`--kernels triton`, kernels/select.py): decodes through
the split-KV decode kernel, a prompt's chunk through the extend kernel, both reading the cache where its blocks
hold it. What they cannot take (a layer's own attention beyond softmax with scale and cap, Llama 4's chunks, a
prefix LM's two-way prompt, a cache of another dtype, a gradient asked for) is said once and left to torch's
path (model/paged_step.py)."""

from __future__ import annotations

import torch

from ster_dist.kernels import select


def triton_terms(fn, q) -> tuple[float, float] | None:
    """(scale, soft cap or 0) where the Triton kernels may compute `fn`'s attention of q: Triton chosen and fn a
    layer's plain softmax attention (Attention.kernel_terms); None otherwise (said once where Triton is chosen)."""
    if select.chosen() != "triton" or not isinstance(q, torch.Tensor):
        return None
    kernel_terms = getattr(getattr(fn, "__self__", None), "kernel_terms", None)
    terms = kernel_terms(fn) if kernel_terms is not None else None
    if terms is None:
        select.fall_back("attention", f"{type(getattr(fn, '__self__', fn)).__name__}'s own attention "
                                      "(sinks, position biases or another form)")
    elif torch.is_grad_enabled() and q.requires_grad:
        select.fall_back("attention", "a step that asks for gradients (the kernels have no backward)")
        return None
    return terms


def attend_group(group, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None,
                 chunk: int | None, terms: tuple[float, float]) -> torch.Tensor | None:
    """This attend group's output [n, heads, queries, dv] through a Triton kernel, or None where none takes it."""
    from ster_dist.kernels.triton.decode import paged_decode
    from ster_dist.kernels.triton.extend import paged_extend

    if chunk is not None:
        select.fall_back("attention", "chunked attention (Llama 4's chunked layers)")
        return None
    if group.prefix:
        select.fall_back("attention", "a prefix LM's prompt read both ways")
        return None
    if keys.dtype != q.dtype:
        select.fall_back("attention", f"a {keys.dtype} cache under {q.dtype} queries")
        return None
    scale, softcap = terms
    mine = group.take(q)
    if mine.stride(-1) != 1:
        mine = mine.contiguous()
    if group.query_pos.shape[1] == 1:
        first, end = group.key_range(window, None)
        return paged_decode(mine[:, :, 0], keys, values, group.table, first, end, scale, softcap).unsqueeze(2)
    return paged_extend(mine, keys, values, group.table, group.starts, window or 0, scale, softcap)

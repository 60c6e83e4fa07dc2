"""Token dispatch over the expert-parallel group: each (token, chosen expert) pair travels to the
rank that holds the expert with `all_to_all_single`, and the expert's output travels back.

Split sizes are exchanged first: one all_to_all_single of per-expert counts, from
which both sides know every split (they are uneven, and a rank may send or
receive nothing) and the receiver knows which of its experts each row is for,
since rows travel sorted by expert. gloo runs all_to_all_single with uneven
splits but not the list form of all_to_all, so only the single form is used.
With one expert-parallel rank nothing moves and nothing is reordered: the rows are the (token, slot)
pairs in order, each with its expert's id, and the experts sort them as their computation needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ster_dist.parallel.ctx import ParallelCtx


@dataclass
class Dispatched:
    """What combine needs to bring outputs back: the send order and both sides' split sizes."""

    ctx: ParallelCtx
    # flat (token, slot) indices in the order they were sent; None: never reordered
    order: torch.Tensor | None
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank


def _exchange(
    ctx: ParallelCtx, data: torch.Tensor, out_rows: list[int], in_rows: list[int]
) -> torch.Tensor:
    if ctx.ep_size == 1:
        return data
    out = data.new_empty((sum(out_rows), *data.shape[1:]))
    dist.all_to_all_single(
        out,
        data.contiguous(),
        output_split_sizes=out_rows,
        input_split_sizes=in_rows,
        group=ctx.ep_group,
    )
    return out


def dispatch(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int, ctx: ParallelCtx, pairs: bool = False
) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """Send x [tokens, hidden]'s rows to the ranks holding their experts (ids [tokens, top_k]); with
    `pairs`,
    x is [tokens * top_k, hidden], a row of its own for each (token, slot) pair in (token, slot)
    order.

    Returns (received rows [m, hidden], each row's expert among this rank's (0-based) [m],
    the handle for combine)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    # nothing moves: the rows stay in (token, slot) order, which the experts sort as they need
    if ctx.ep_size == 1:
        rows = x if pairs else x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, x.shape[-1])
        return rows, flat, Dispatched(ctx, None, [rows.shape[0]], [rows.shape[0]])
    # by expert, hence by owning rank: blocks are contiguous
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=num_experts)
    blocks = [
        (r + 1) * num_experts // ctx.ep_size - r * num_experts // ctx.ep_size
        for r in range(ctx.ep_size)
    ]
    first, last = ctx.experts(num_experts)
    local = last - first
    if ctx.ep_size > 1:
        # counts[s, j]: rows rank s sends for this rank's j-th expert; blocks differ by at most one,
        # so
        # each rank receives its own block size from every sender
        counts = per_expert.new_empty(ctx.ep_size * local)
        dist.all_to_all_single(
            counts,
            per_expert,
            output_split_sizes=[local] * ctx.ep_size,
            input_split_sizes=blocks,
            group=ctx.ep_group,
        )
        counts = counts.view(ctx.ep_size, local)
    else:
        counts = per_expert.view(1, num_experts)
    sent = [int(c.sum()) for c in per_expert.split(blocks)]
    received = counts.sum(1).tolist()
    rows = _exchange(ctx, x[order if pairs else order // top_k], received, sent)
    local_ids = torch.repeat_interleave(
        torch.arange(local, device=counts.device).repeat(ctx.ep_size), counts.reshape(-1)
    )
    return rows, local_ids, Dispatched(ctx, order, sent, received)


def combine(y: torch.Tensor, handle: Dispatched) -> torch.Tensor:
    """The experts' outputs y [m, hidden] back to their senders, as [tokens * top_k, hidden] in
    (token, slot) order."""
    back = _exchange(handle.ctx, y, handle.sent, handle.received)
    if handle.order is None:  # one expert-parallel rank: the rows never left (token, slot) order
        return back
    out = torch.empty_like(back)
    out[handle.order] = back
    return out

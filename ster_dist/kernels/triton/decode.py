"""Paged decode attention in Triton: one query per sequence over its keys where a paged cache holds
them (model/paged.py: [blocks, block_size, kv_heads, width]), read through its block table, never
gathered.

Split over the key axis in two stages (SGLang's decode_attention.py, FlashDecoding): stage 1 gives
each (sequence, key head, split) program a contiguous share of the sequence's keys and all the query
heads that share that key head (GQA: the keys are read once for the group), and leaves a partial
output and its log-sum-exp; stage 2 merges a head's splits, with its attention sink's logit where it
has one. So one long sequence keeps many programs busy where one program per sequence would leave
the GPU idle.

A sequence attends positions [first, end): its window's first key (a window shorter than the context
starts mid-block) to its own position; scores are scaled by the layer's scale and soft-capped (cap
tanh(s / cap)) where a cap is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton.common import check, dot, pow2, tanh, upcast

# a split's least keys where the context allows: fewer and the merge costs more than it saves
KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


@triton.jit
def _split_attend(
    Q,
    K,
    V,
    Table,
    First,
    End,
    MidO,
    MidL,
    scale,
    softcap,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tn,
    stride_on,
    stride_oh,
    stride_os,
    stride_ln,
    stride_lh,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    first = tl.load(First + seq)
    end = tl.load(End + seq)
    share = tl.cdiv(end - first, SPLITS)
    lo = first + split * share
    hi = tl.minimum(lo + share, end)
    q = tl.load(
        Q + seq * stride_qn + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        block = tl.load(Table + seq * stride_tn + pos // PAGE, mask=pos_ok, other=0)
        at = pos % PAGE
        k = tl.load(
            K
            + block[:, None] * stride_kb
            + at[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=pos_ok[:, None] & (d[None, :] < D),
            other=0.0,
        )
        s = dot(q, tl.trans(k), UPCAST) * scale
        if SOFTCAP:
            s = softcap * tanh(s / softcap)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(
            V
            + block[:, None] * stride_vb
            + at[:, None] * stride_vt
            + kv_head * stride_vh
            + dv[None, :],
            mask=pos_ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST)
        m = m_new
    filled = total > 0  # a split past a short sequence's keys holds none: it leaves weight zero
    out = acc / tl.where(filled, total, 1.0)[:, None]
    lse = tl.where(filled, m + tl.log(tl.where(filled, total, 1.0)), float("-inf"))
    tl.store(
        MidO + seq * stride_on + heads[:, None] * stride_oh + split * stride_os + dv[None, :],
        out,
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )
    tl.store(MidL + seq * stride_ln + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits(
    MidO,
    MidL,
    Sinks,
    Out,
    stride_on,
    stride_oh,
    stride_os,
    stride_ln,
    stride_lh,
    stride_xn,
    stride_xh,
    DV: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SINKS: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    lse = tl.load(
        MidL + seq * stride_ln + head * stride_lh + s, mask=s < SPLITS, other=float("-inf")
    )
    o = tl.load(
        MidO + seq * stride_on + head * stride_oh + s[:, None] * stride_os + dv[None, :],
        mask=(s[:, None] < SPLITS) & (dv[None, :] < DV),
        other=0.0,
    )
    top = tl.max(lse, 0)
    if SINKS:  # one more logit in the softmax, with no value: it only takes a share of the weight
        sink = tl.load(Sinks + head).to(tl.float32)
        top = tl.maximum(top, sink)
    w = tl.exp(lse - top)
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(w[:, None] * o, 0) / total
    tl.store(
        Out + seq * stride_xn + head * stride_xh + dv, out.to(Out.dtype.element_ty), mask=dv < DV
    )


def splits_for(keys_reach: int) -> int:
    """Splits of a step whose tables reach `keys_reach` positions: about KEYS_PER_SPLIT keys each,
    at most MAX_SPLITS (from the host's table width, so choosing never reads the device)."""
    return max(1, min(MAX_SPLITS, -(-keys_reach // KEYS_PER_SPLIT)))


def paged_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """[n, heads, dv]: q [n, heads, d] attending, per sequence i, positions first[i] .. end[i] - 1
    of its keys and values ([blocks, block_size, kv_heads, d or dv]) through table[i] ([n, columns]
    block ids); softmax(cap tanh(q k^T scale / cap)) v, with sinks [heads] as extra logits where
    given."""
    check("q", q, 3)
    check("keys", keys, 4, (q.dtype,))
    check("values", values, 4, (q.dtype,))
    check("table", table, 2, (torch.int32, torch.int64))
    n, heads, d = q.shape
    _, page, kv_heads, dk = keys.shape
    dv = values.shape[3]
    if dk != d or values.shape[:3] != keys.shape[:3] or heads % kv_heads or table.shape[0] != n:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
            f"{tuple(values.shape)} and table {tuple(table.shape)} do not fit one another"
        )
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"paged_decode: sinks of shape {tuple(sinks.shape)}, not one per head ({heads})"
        )
    splits = splits or splits_for(table.shape[1] * page)
    group = heads // kv_heads
    mid_o = torch.empty((n, heads, splits, dv), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    out = torch.empty((n, heads, dv), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    _split_attend[(n, kv_heads, splits)](
        q,
        keys,
        values,
        table,
        first,
        end,
        mid_o,
        mid_l,
        float(scale),
        float(softcap or 1.0),
        q.stride(0),
        q.stride(1),
        *keys.stride()[:3],
        *values.stride()[:3],
        table.stride(0),
        *mid_o.stride()[:3],
        *mid_l.stride()[:2],
        GROUP=group,
        D=d,
        DV=dv,
        PAGE=page,
        SPLITS=splits,
        BLOCK_H=pow2(group),
        BLOCK_D=pow2(d),
        BLOCK_DV=pow2(dv),
        BLOCK_N=32,
        SOFTCAP=bool(softcap),
        UPCAST=upcast(q),
    )
    _merge_splits[(n, heads)](
        mid_o,
        mid_l,
        sinks if sinks is not None else mid_l,
        out,
        *mid_o.stride()[:3],
        *mid_l.stride()[:2],
        out.stride(0),
        out.stride(1),
        DV=dv,
        SPLITS=splits,
        BLOCK_S=pow2(splits, 2),
        BLOCK_DV=pow2(dv),
        SINKS=sinks is not None,
    )
    return out

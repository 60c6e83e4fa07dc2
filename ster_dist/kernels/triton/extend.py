"""Paged prefill/extend attention in Triton: a chunk's queries over the keys a paged cache holds for
their sequence, its cached prefix (a prefix-cache hit, earlier chunks of a chunked prefill) and the
chunk's own keys, already written (model/paged_step.py stores a step's keys before it attends),
causal inside the new part.

SGLang's extend_attention.py reads the prefix from the pool and the new keys from their own buffer;
here both lie in the cache, so one loop over the block table does: each program takes BLOCK_M
queries of one head, reads only the keys its queries may see (from the window's first to the last
query's own position) and keeps an online softmax; the masked upper triangle past the last query is
never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton.common import check, dot, pow2, tanh, upcast

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _extend_attend(
    Q,
    K,
    V,
    Table,
    Starts,
    Sinks,
    Out,
    scale,
    softcap,
    window,
    queries,
    stride_qn,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tn,
    stride_on,
    stride_oh,
    stride_ot,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    start = tl.load(Starts + seq)
    qpos = start + rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + seq * stride_qn + head * stride_qh + rows[:, None] * stride_qt + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )
    # one past the tile's last query's own key
    hi = start + tl.minimum((tile + 1) * BLOCK_M, queries)
    lo = 0
    if WINDOW:
        lo = tl.maximum(start + tile * BLOCK_M - window + 1, 0)
        lo = lo // BLOCK_N * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for first in range(lo, hi, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
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
        seen = (pos[None, :] <= qpos[:, None]) & pos_ok[None, :]
        if WINDOW:
            seen = seen & (qpos[:, None] - pos[None, :] < window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row none of whose keys this tile allows keeps m = -inf: its exps are taken from 0, not
        # NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
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
    if SINKS:  # one more logit with no value: it takes its share of the weight
        sink = tl.load(Sinks + head).to(tl.float32)
        total = total + tl.exp(sink - m)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        Out + seq * stride_on + head * stride_oh + rows[:, None] * stride_ot + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def paged_extend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    starts: torch.Tensor,
    window: int,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n, heads, queries, dv]: q [n, heads, queries, d], query j of sequence i at position
    starts[i] + j, over that sequence's keys and values at positions <= its own (within `window` of
    it, 0: no window) through table[i]; the keys of the queries' own positions must be in the cache
    already."""
    check("q", q, 4)
    check("keys", keys, 4, (q.dtype,))
    check("values", values, 4, (q.dtype,))
    check("table", table, 2, (torch.int32, torch.int64))
    n, heads, queries, d = q.shape
    _, page, kv_heads, dk = keys.shape
    dv = values.shape[3]
    if dk != d or values.shape[:3] != keys.shape[:3] or heads % kv_heads or table.shape[0] != n:
        raise ValueError(
            f"paged_extend: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
            f"{tuple(values.shape)} and table {tuple(table.shape)} do not fit one another"
        )
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"paged_extend: sinks of shape {tuple(sinks.shape)}, not one per head ({heads})"
        )
    out = torch.empty((n, heads, queries, dv), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    _extend_attend[(n, heads, triton.cdiv(queries, BLOCK_M))](
        q,
        keys,
        values,
        table,
        starts,
        sinks if sinks is not None else q,
        out,
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        queries,
        *q.stride()[:3],
        *keys.stride()[:3],
        *values.stride()[:3],
        table.stride(0),
        *out.stride()[:3],
        GROUP=heads // kv_heads,
        D=d,
        DV=dv,
        PAGE=page,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_D=pow2(d),
        BLOCK_DV=pow2(dv),
        SOFTCAP=bool(softcap),
        WINDOW=bool(window),
        SINKS=sinks is not None,
        UPCAST=upcast(q),
    )
    return out

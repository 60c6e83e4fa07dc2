"""MLA decode in Triton over the latent cache (model/mla.py: per position the normed latent
[kv_lora_rank] and the rotated shared key part [rope dim], one "head" each), with kv_b's key half
absorbed into the queries and its value half applied after (DeepSeek-V3/R1, Kimi-K2, GLM-4.7-Flash:
rank 512, rope 64, up to 128 heads a rank).

Scores are q_latent . latent + q_rot . k_rot; the output is the softmax's sum of latents, which the
caller maps through the value half. Each key tile's latent is read once and serves as both key and
value (FlashMLA's point), for BLOCK_H heads at a time; the key axis is split in two stages as in
decode.py, whose merge (with sinks) is reused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton.common import check, dot, pow2, upcast
from ster_dist.kernels.triton.decode import _merge_splits, splits_for

BLOCK_H = 16


@triton.jit
def _split_latent(
    QL,
    QR,
    L,
    R,
    Table,
    First,
    End,
    MidO,
    MidL,
    scale,
    heads,
    stride_qln,
    stride_qlh,
    stride_qrn,
    stride_qrh,
    stride_lb,
    stride_lt,
    stride_rb,
    stride_rt,
    stride_tn,
    stride_on,
    stride_oh,
    stride_os,
    stride_ln,
    stride_lh,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq, head_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    first = tl.load(First + seq)
    end = tl.load(End + seq)
    share = tl.cdiv(end - first, SPLITS)
    lo = first + split * share
    hi = tl.minimum(lo + share, end)
    q_lat = tl.load(
        QL + seq * stride_qln + h[:, None] * stride_qlh + r[None, :],
        mask=h_ok[:, None] & (r[None, :] < RANK),
        other=0.0,
    )
    q_rot = tl.load(
        QR + seq * stride_qrn + h[:, None] * stride_qrh + p[None, :],
        mask=h_ok[:, None] & (p[None, :] < ROPE),
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        block = tl.load(Table + seq * stride_tn + pos // PAGE, mask=pos_ok, other=0)
        at = pos % PAGE
        lat = tl.load(
            L + block[:, None] * stride_lb + at[:, None] * stride_lt + r[None, :],
            mask=pos_ok[:, None] & (r[None, :] < RANK),
            other=0.0,
        )
        rot = tl.load(
            R + block[:, None] * stride_rb + at[:, None] * stride_rt + p[None, :],
            mask=pos_ok[:, None] & (p[None, :] < ROPE),
            other=0.0,
        )
        s = (dot(q_lat, tl.trans(lat), UPCAST) + dot(q_rot, tl.trans(rot), UPCAST)) * scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        prob = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(prob, 1)
        # the latent is the value too
        acc = acc * alpha[:, None] + dot(prob.to(lat.dtype), lat, UPCAST)
        m = m_new
    filled = total > 0
    out = acc / tl.where(filled, total, 1.0)[:, None]
    lse = tl.where(filled, m + tl.log(tl.where(filled, total, 1.0)), float("-inf"))
    tl.store(
        MidO + seq * stride_on + h[:, None] * stride_oh + split * stride_os + r[None, :],
        out,
        mask=h_ok[:, None] & (r[None, :] < RANK),
    )
    tl.store(MidL + seq * stride_ln + h * stride_lh + split, lse, mask=h_ok)


def mla_decode(
    q_latent: torch.Tensor,
    q_rot: torch.Tensor,
    latents: torch.Tensor,
    rotated: torch.Tensor,
    table: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """[n, heads, rank]: the softmax-weighted sum of each sequence's latents at positions first ..
    end - 1, for q_latent [n, heads, rank] (q_nope through kv_b's key half) and q_rot [n, heads,
    rope]; latents [blocks, block_size, 1, rank] and rotated [blocks, block_size, 1, rope] read
    through table [n, columns]."""
    check("q_latent", q_latent, 3)
    for name, t in (("q_rot", q_rot), ("latents", latents), ("rotated", rotated)):
        check(name, t, t.dim() if name == "q_rot" else 4, (q_latent.dtype,))
    n, heads, rank = q_latent.shape
    _, page, one, cache_rank = latents.shape
    rope = rotated.shape[3]
    if (
        one != 1
        or cache_rank != rank
        or rotated.shape[:3] != latents.shape[:3]
        or tuple(q_rot.shape) != (n, heads, rope)
        or table.shape[0] != n
    ):
        raise ValueError(
            f"mla_decode: q_latent {tuple(q_latent.shape)}, q_rot {tuple(q_rot.shape)}, latents "
            f"{tuple(latents.shape)}, rotated {tuple(rotated.shape)} and table "
            f"{tuple(table.shape)} do not fit one another"
        )
    splits = splits or splits_for(table.shape[1] * page)
    mid_o = torch.empty((n, heads, splits, rank), dtype=torch.float32, device=q_latent.device)
    mid_l = torch.empty((n, heads, splits), dtype=torch.float32, device=q_latent.device)
    out = torch.empty((n, heads, rank), dtype=q_latent.dtype, device=q_latent.device)
    if n == 0:
        return out
    _split_latent[(n, triton.cdiv(heads, BLOCK_H), splits)](
        q_latent,
        q_rot,
        latents,
        rotated,
        table,
        first,
        end,
        mid_o,
        mid_l,
        float(scale),
        heads,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rot.stride(0),
        q_rot.stride(1),
        latents.stride(0),
        latents.stride(1),
        rotated.stride(0),
        rotated.stride(1),
        table.stride(0),
        *mid_o.stride()[:3],
        *mid_l.stride()[:2],
        RANK=rank,
        ROPE=rope,
        PAGE=page,
        SPLITS=splits,
        BLOCK_H=BLOCK_H,
        BLOCK_R=pow2(rank),
        BLOCK_P=pow2(rope),
        BLOCK_N=16,
        UPCAST=upcast(q_latent),
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
        DV=rank,
        SPLITS=splits,
        BLOCK_S=pow2(splits, 2),
        BLOCK_DV=pow2(rank),
        SINKS=sinks is not None,
    )
    return out

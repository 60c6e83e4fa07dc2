"""Fused mixture-of-experts feed-forward in Triton (the fused_moe design of vLLM and SGLang): each
token's (token, choice) pairs sorted by expert and each expert's run padded to BLOCK_M, so a program
multiplies BLOCK_M rows by one expert's weights; one kernel computes gate and up (read from their
own stacks) and applies SwiGLU, the next the down projection, scaled by each pair's router weight;
the pairs of a token are then summed.

Weights are stacked [experts, out, in] (moe/experts.py), in f32/bf16/f16 or FP8 e4m3 with one scale
per [128, 128] block (DeepSeek-V3's), the activations then quantized per token and group of 128
channels (fp8.quantize_groups) before each product. An expert no pair chose gets no program work:
its blocks never exist.

The sort is torch's on the device with no read back to the host: the padded layout is sized for the
worst case (every expert's run padded by BLOCK_M - 1), and programs past the real blocks return at
once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton.common import check, dot, upcast
from ster_dist.kernels.triton.fp8 import FP8, GROUP, quantize_groups

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


def align_by_expert(
    ids: torch.Tensor, experts: int, block: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids [worst-case padded length], each block's expert [blocks] or -1 past the last) for
    ids [pairs] (each pair's expert): pair ids grouped by expert, each expert's run padded with
    `pairs` (no pair) to a multiple of `block`."""
    pairs = ids.numel()
    ids = ids.reshape(-1).long()
    counts = torch.bincount(ids, minlength=experts)[:experts]
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first_pair = torch.cumsum(counts, 0) - counts
    order = torch.argsort(ids, stable=True)
    length = pairs + experts * (block - 1)
    length = -(-length // block) * block
    at = torch.arange(length, device=ids.device)
    expert = torch.searchsorted(ends, at, right=True).clamp(max=experts - 1)
    within = at - starts[expert]
    real = (within < counts[expert]) & (at < ends[-1])
    taken = order[(first_pair[expert] + within).clamp(max=max(pairs - 1, 0))] if pairs else at
    sorted_ids = torch.where(real, taken, torch.full_like(at, pairs))
    block_expert = torch.where(
        at[::block] < ends[-1], expert[::block], torch.full_like(at[::block], -1)
    )
    return sorted_ids, block_expert


@triton.jit
def _expert_product(
    A,
    AS,
    W,
    WS,
    U,
    US,
    Out,
    Sorted,
    BlockExpert,
    RouteWeights,
    pairs,
    N,
    K,
    topk,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    GATED: tl.constexpr,
    ROUTED: tl.constexpr,
    FP8W: tl.constexpr,
    ROWS_ARE_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WB_N: tl.constexpr,
    WB_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Out[pair] = A[row] W_e^T for one block of pairs and BLOCK_N outputs; GATED: W is the gate and
    U the up projection (the same strides), out silu(A W_e^T) * A U_e^T; ROUTED: times the pair's
    router weight."""
    block, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + block)
    if e < 0:
        return
    pair = tl.load(Sorted + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pair < pairs
    row = pair // topk if ROWS_ARE_TOKENS else pair
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_base = W + e.to(tl.int64) * stride_we
    u_base = U + e.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        k_ok = k < K
        a = tl.load(
            A + row[:, None] * stride_am + k[None, :],
            mask=pair_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + rn[None, :] * stride_wn + k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        # the K tile lies inside one block's columns: one activation and one weight scale per tile
        if FP8W:
            a_s = tl.load(AS + row * stride_asm + (kb * BLOCK_K) // WB_K, mask=pair_ok, other=0.0)
            w_s = tl.load(
                WS
                + e.to(tl.int64) * stride_wse
                + (rn // WB_N) * stride_wsn
                + (kb * BLOCK_K) // WB_K,
                mask=n_ok,
                other=0.0,
            )
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            acc += dot(a, w, UPCAST)
        if GATED:
            u = tl.load(
                u_base + rn[None, :] * stride_wn + k[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            if FP8W:
                u_s = tl.load(
                    US
                    + e.to(tl.int64) * stride_wse
                    + (rn // WB_N) * stride_wsn
                    + (kb * BLOCK_K) // WB_K,
                    mask=n_ok,
                    other=0.0,
                )
                acc_up += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
            else:
                acc_up += dot(a, u, UPCAST)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if ROUTED:
        acc = acc * tl.load(RouteWeights + pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(
        Out + pair[:, None] * stride_om + rn[None, :],
        acc.to(Out.dtype.element_ty),
        mask=pair_ok[:, None] & n_ok[None, :],
    )


def _launch(
    a,
    a_scale,
    w,
    w_scale,
    u,
    u_scale,
    out,
    sorted_ids,
    block_expert,
    route,
    pairs,
    n,
    topk,
    gated,
    tokens_rows,
    block,
):
    fp8 = w.dtype == FP8
    block_k = min(BLOCK_K, block[1]) if fp8 else BLOCK_K
    ws = w_scale if fp8 else w
    _expert_product[(block_expert.numel(), triton.cdiv(n, BLOCK_N))](
        a,
        a_scale if fp8 else a,
        w,
        ws,
        u,
        u_scale if fp8 else u,
        out,
        sorted_ids,
        block_expert,
        route if route is not None else a,
        pairs,
        n,
        a.shape[1],
        topk,
        a.stride(0),
        a_scale.stride(0) if fp8 else 0,
        w.stride(0),
        w.stride(1),
        ws.stride(0) if fp8 else 0,
        ws.stride(1) if fp8 else 0,
        out.stride(0),
        GATED=gated,
        ROUTED=route is not None,
        FP8W=fp8,
        ROWS_ARE_TOKENS=tokens_rows,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        WB_N=block[0],
        WB_K=block[1],
        UPCAST=upcast(a, w),
    )


def fused_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    scales: tuple[torch.Tensor, ...] | None = None,
    block: tuple[int, int] = (GROUP, GROUP),
) -> torch.Tensor:
    """[tokens, hidden] = sum over each token's k choices of weight * down_e(silu(gate_e x) * up_e
    x). x [tokens, hidden]; topk_ids, topk_weights [tokens, k]; gate, up [experts, inner, hidden]
    and down [experts, hidden, inner] of x's dtype, or FP8 with `scales` (gate's, up's, down's)
    [experts, out / 128, in / 128], one per [128, 128] block (or `block`: [rows, columns], columns a
    power of two of at least 16, the activations then quantized per group of as many channels)."""
    check("x", x, 2)
    fp8 = gate.dtype == FP8
    dtypes = (FP8,) if fp8 else (x.dtype,)
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        check(name, w, 3, dtypes)
    experts, inner, hidden = gate.shape
    if (
        hidden != x.shape[1]
        or up.shape != gate.shape
        or tuple(down.shape) != (experts, hidden, inner)
        or up.stride() != gate.stride()
    ):
        raise ValueError(
            f"fused_experts: x {tuple(x.shape)}, gate {tuple(gate.shape)}, up {tuple(up.shape)} "
            f"and down {tuple(down.shape)} do not fit one another"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"fused_experts: topk_ids {tuple(topk_ids.shape)} and weights "
            f"{tuple(topk_weights.shape)} for {x.shape[0]} tokens"
        )
    if fp8:
        for name, w, s in zip(("gate", "up", "down"), (gate, up, down), scales or (None,) * 3):
            want = (experts, triton.cdiv(w.shape[1], block[0]), triton.cdiv(w.shape[2], block[1]))
            if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
                got = None if s is None else (tuple(s.shape), s.dtype)
                raise ValueError(
                    f"fused_experts: FP8 {name} needs f32 scales of shape {want} (one per "
                    f"{list(block)} block), got {got}"
                )
        if (
            block[1] & (block[1] - 1)
            or block[1] < 16
            or (block[1] > BLOCK_K and block[1] % BLOCK_K)
        ):
            raise ValueError(
                f"fused_experts: FP8 blocks of {block[1]} columns: a power of two of at least 16 "
                "is what the kernel takes"
            )
        if scales[0].stride() != scales[1].stride():
            raise ValueError("fused_experts: gate's and up's scales must have the same strides")
    gate_s, up_s, down_s = scales if fp8 else (None, None, None)
    tokens, topk = topk_ids.shape
    pairs = tokens * topk
    out = torch.zeros((tokens, hidden), dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    sorted_ids, block_expert = align_by_expert(topk_ids, experts)
    a, a_scale = quantize_groups(x, block[1]) if fp8 else (x, None)
    h = torch.empty((pairs, inner), dtype=x.dtype, device=x.device)
    _launch(
        a,
        a_scale,
        gate,
        gate_s,
        up,
        up_s,
        h,
        sorted_ids,
        block_expert,
        None,
        pairs,
        inner,
        topk,
        True,
        True,
        block,
    )
    a, a_scale = quantize_groups(h, block[1]) if fp8 else (h, None)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _launch(
        a,
        a_scale,
        down,
        down_s,
        down,
        down_s,
        y,
        sorted_ids,
        block_expert,
        topk_weights.reshape(-1),
        pairs,
        hidden,
        topk,
        False,
        False,
        block,
    )
    return y.view(tokens, topk, hidden).sum(1).to(x.dtype)

"""FP8 (e4m3) products in Triton, DeepSeek-V3's recipe: activations quantized per token and group of
128 channels (one scale per row and group, the group's largest magnitude mapped to 448), weights
stored in [128, 128] blocks with one scale each (parallel/fp8.py's Fp8Weight with whole blocks), and
the product accumulated in f32 block by block of the reduction, each partial product scaled by its
row's and block's scales (DeepSeek's fp8_gemm, vLLM's w8a8_block_fp8_matmul).

`quantize_groups` rounds each value to FP8's grid itself (to nearest, ties to even, as torch's cast)
and then casts a value the cast keeps exactly: the interpreter's own f32 -> fp8 cast truncates, a
GPU's rounds, and so one code path gives torch's bits on both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ster_dist.kernels.triton.common import check, pow2

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128


@triton.jit
def round_e4m3(y):
    """y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as an f32."""
    a = tl.abs(y)
    exponent = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    exponent = tl.maximum(exponent, -6.0)  # below 2^-6 the subnormals' fixed step, 2^-9
    step = tl.exp2(exponent - 3.0)  # three mantissa bits
    t = a / step  # exact: a power of two
    f = tl.floor(t)
    rest = t - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    f = tl.where((rest > 0.5) | ((rest == 0.5) & (odd == 1.0)), f + 1.0, f)
    r = tl.minimum(f * step, 448.0)
    return tl.where(y < 0, -r, r)


@triton.jit
def _quantize(X, Q, S, cols, stride_x, stride_q, stride_s, G: tl.constexpr, BLOCK_G: tl.constexpr):
    row, group = tl.program_id(0), tl.program_id(1)
    c = group * G + tl.arange(0, BLOCK_G)
    ok = (tl.arange(0, BLOCK_G) < G) & (c < cols)
    x = tl.load(X + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
    tl.store(Q + row * stride_q + c, round_e4m3(x / scale).to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row * stride_s + group, scale)


def quantize_groups(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, cols] FP8, scales [rows, ceil(cols / group)] f32) of x [rows, cols]: x ~ q * scale
    per group."""
    check("x", x, 2)
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    s = torch.empty((rows, triton.cdiv(cols, group)), dtype=torch.float32, device=x.device)
    if x.numel():
        _quantize[(rows, s.shape[1])](
            x, q, s, cols, x.stride(0), q.stride(0), s.stride(0), G=group, BLOCK_G=pow2(group)
        )
    return q, s


@triton.jit
def _block_gemm(
    A,
    AS,
    W,
    WS,
    Out,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_wn,
    stride_wsn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WB_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # BLOCK_K is the scale group: one scale per row and weight block
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(
            A + rm[:, None] * stride_am + k[None, :],
            mask=(rm[:, None] < M) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            W + rn[None, :] * stride_wn + k[:, None],
            mask=(rn[None, :] < N) & (k[:, None] < K),
            other=0.0,
        )
        a_s = tl.load(AS + rm * stride_asm + kb, mask=rm < M, other=0.0)
        w_s = tl.load(WS + (rn // WB_N) * stride_wsn + kb, mask=rn < N, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    tl.store(
        Out + rm[:, None] * stride_om + rn[None, :],
        acc.to(Out.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def refuses_block(block: tuple[int, int]) -> str | None:
    """Why block_gemm cannot take weight blocks of [rows, columns], or None: the columns are a K
    tile (a power of two of at least 16, tl.dot's least) and the rows a whole number of output tiles
    of 16 to 64."""
    b0, b1 = block
    if b1 & (b1 - 1) or b1 < 16:
        return f"a block of {b1} columns is not a power of two of at least 16"
    if b0 & -b0 < 16:
        return f"a block of {b0} rows is not a multiple of 16"
    return None


def block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    block: tuple[int, int] = (GROUP, GROUP),
) -> torch.Tensor:
    """x [rows, K] (any float, quantized here per 1 x block[1] group) times weight^T, weight [N, K]
    FP8 with one scale per [block[0], block[1]] block (weight_scale [ceil(N / b0), ceil(K / b1)]):
    [rows, N] in out_dtype."""
    check("x", x, 2)
    check("weight", weight, 2, (FP8,))
    check("weight_scale", weight_scale, 2, (torch.float32,))
    (m, k), (n, k2) = x.shape, weight.shape
    b0, b1 = block
    if k2 != k or tuple(weight_scale.shape) != (triton.cdiv(n, b0), triton.cdiv(k, b1)):
        raise ValueError(
            f"block_gemm: x {tuple(x.shape)}, weight {tuple(weight.shape)} and its scales "
            f"{tuple(weight_scale.shape)} do not fit blocks of {block}"
        )
    if (reason := refuses_block(block)) is not None:
        raise ValueError(f"block_gemm: {reason}")
    a, a_s = quantize_groups(x, b1)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block_n = min(64, b0 & -b0)
    _block_gemm[(triton.cdiv(m, 16), triton.cdiv(n, block_n))](
        a,
        a_s,
        weight,
        weight_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_s.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=b1,
        WB_N=b0,
    )
    return out

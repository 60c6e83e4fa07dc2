"""Torch references the Triton kernels must equal, written for clarity, one sequence at a time (the
tests and bench/gpu_check.py compare each kernel with these)."""

from __future__ import annotations

import torch


def attend_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[heads, queries, dv] for q [heads, queries, d] over k, v [kv_heads, keys, d or dv] and
    allowed [queries, keys], in f32: softmax over the allowed keys (and a sink logit per head) of
    cap tanh(q k^T scale / cap)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(group, 0), v.float().repeat_interleave(group, 0)
    s = q.float() @ k.transpose(1, 2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=2)
    p = torch.softmax(s, dim=-1)
    return p[..., : v.shape[1]] @ v


def paged_keys(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """[kv_heads, length, width]: positions 0 .. length - 1 of one sequence from cache [blocks,
    page, kv, w]."""
    page = cache.shape[1]
    pos = torch.arange(length)
    return cache[blocks[pos // page], pos % page].transpose(0, 1)


def paged_decode_reference(
    q, keys, values, table, first, end, scale, softcap=0.0, sinks=None
) -> torch.Tensor:
    """What kernels/triton/decode.py's paged_decode computes: [n, heads, dv] in f32."""
    outs = []
    for i in range(q.shape[0]):
        length = int(end[i])
        k, v = paged_keys(keys, table[i], length), paged_keys(values, table[i], length)
        allowed = (torch.arange(length) >= int(first[i])).unsqueeze(0)
        outs.append(attend_reference(q[i].unsqueeze(1), k, v, allowed, scale, softcap, sinks)[:, 0])
    return torch.stack(outs)


def paged_extend_reference(q, keys, values, table, starts, window, scale, softcap=0.0, sinks=None):
    """What kernels/triton/extend.py's paged_extend computes: [n, heads, queries, dv] in f32, query
    j of sequence i at position starts[i] + j over the keys at or before it (within `window`, 0:
    none)."""
    outs = []
    for i in range(q.shape[0]):
        queries = q.shape[2]
        length = int(starts[i]) + queries
        k, v = paged_keys(keys, table[i], length), paged_keys(values, table[i], length)
        distance = (int(starts[i]) + torch.arange(queries)).unsqueeze(1) - torch.arange(
            length
        ).unsqueeze(0)
        allowed = (distance >= 0) & ((distance < window) if window else True)
        outs.append(attend_reference(q[i], k, v, allowed, scale, softcap, sinks))
    return torch.stack(outs)


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 [rows, cols], f32 scales [rows, groups]): each group of `group` columns scaled so its
    largest magnitude is 448, then cast (torch's rounding, to nearest even)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(
        rows, groups, group
    )
    scale = padded.abs().amax(-1).clamp(min=1e-12) / 448.0
    q = (padded / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(rows, -1)[:, :cols]
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q as f32, each [block[0], block[1]] block times its scale entry ([..., row blocks, column
    blocks])."""
    spread = scale.repeat_interleave(block[0], -2)[..., : q.shape[-2], :].repeat_interleave(
        block[1], -1
    )
    return q.float() * spread[..., : q.shape[-1]]


def experts_reference(
    x, topk_ids, topk_weights, gate_up, down, fp8_inner: bool = False
) -> torch.Tensor:
    """What kernels/triton/moe.py's fused_experts computes, token by token in f32 (weights already
    widened); fp8_inner: SwiGLU's output through FP8 groups of 128 before down, as FP8 experts take
    it."""
    inner = gate_up.shape[1] // 2
    out = torch.zeros(x.shape[0], down.shape[1])
    for t in range(x.shape[0]):
        for e, w in zip(topk_ids[t].tolist(), topk_weights[t].float()):
            g, u = (x[t].float() @ gate_up[e].float().T).split(inner)
            h = (torch.nn.functional.silu(g) * u).unsqueeze(0)
            if fp8_inner:
                h = dequantize_blocks(*quantize_groups_reference(h, 128), (1, 128))
            out[t] += w * h[0] @ down[e].float().T
    return out


def mla_decode_reference(q_latent, q_rot, latents, rotated, table, first, end, scale, sinks=None):
    """What kernels/triton/mla.py's mla_decode computes: [n, heads, rank] in f32, as attention whose
    keys are [latent, rotated] and whose values are the latents, one key head for all."""
    q = torch.cat((q_latent, q_rot), dim=-1)
    keys = torch.cat((latents, rotated), dim=-1)
    return paged_decode_reference(q, keys, latents, table, first, end, scale, 0.0, sinks)

"""A paged step's attention through the Triton kernels (`--kernels triton`, kernels/select.py):
decodes through the split-KV decode kernel (an MLA layer's through the latent one), a prompt's chunk
through the extend kernel, all reading the cache where its blocks hold it. What they cannot take (a
layer's own attention beyond softmax with scale and cap, Llama 4's chunks, a prefix LM's two-way
prompt, a cache of another dtype, a gradient asked for) is said once and left to torch's path
(model/paged_step.py)."""

from __future__ import annotations

import torch

from ster_dist.kernels import select


def triton_terms(fn, q) -> tuple | None:
    """(scale, soft cap or 0) where the Triton kernels may compute `fn`'s attention of q: Triton
    chosen and fn a layer's plain softmax attention (Attention.kernel_terms); ("latent", MLA's
    latent_terms) for an MLA layer's attention; None otherwise (said once where Triton is
    chosen)."""
    if select.chosen() != "triton":
        return None
    # MLA hands a partial of its _attend_latent
    mla = getattr(getattr(fn, "func", None), "__self__", None)
    if hasattr(mla, "latent_terms"):
        latent = mla.latent_terms()
        if latent is None:
            select.fall_back(
                "MLA decode",
                "an MLA layer whose indexer chooses its keys (DeepSeek Sparse Attention)",
            )
            return None
        return ("latent", latent)
    if not isinstance(q, torch.Tensor):
        return None
    kernel_terms = getattr(getattr(fn, "__self__", None), "kernel_terms", None)
    terms = kernel_terms(fn) if kernel_terms is not None else None
    if terms is None:
        select.fall_back(
            "attention",
            f"{type(getattr(fn, '__self__', fn)).__name__}'s own attention "
            "(sinks, position biases or another form)",
        )
    elif torch.is_grad_enabled() and q.requires_grad:
        select.fall_back(
            "attention", "a step that asks for gradients (the kernels have no backward)"
        )
        return None
    return terms


def attend_group(
    group,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int | None,
    chunk: int | None,
    terms: tuple[float, float],
) -> torch.Tensor | None:
    """This attend group's output [n, heads, queries, dv] through a Triton kernel, or None where
    none takes it."""
    from ster_dist.kernels.triton.decode import paged_decode
    from ster_dist.kernels.triton.extend import paged_extend

    if terms[0] == "latent":
        return _latent_decode(group, q, keys, values, window, chunk, terms[1])

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
        return paged_decode(
            mine[:, :, 0], keys, values, group.table, first, end, scale, softcap
        ).unsqueeze(2)
    return paged_extend(mine, keys, values, group.table, group.starts, window or 0, scale, softcap)


def _latent_decode(
    group,
    q: tuple,
    latents: torch.Tensor,
    rotated: torch.Tensor,
    window: int | None,
    chunk: int | None,
    terms: tuple,
) -> torch.Tensor | None:
    """An MLA layer's decodes through the Triton MLA decode: queries absorbed through kv_b's key
    half, the latent sums through its value half (model/mla.py's _absorbed, without gathering the
    cache)."""
    from ster_dist.kernels.triton.mla import mla_decode

    if group.query_pos.shape[1] != 1 or group.prefix or chunk is not None:
        select.fall_back("MLA decode", "an MLA prompt's chunk (its keys expanded from the latents)")
        return None
    scale, w_key, w_value, sinks = terms
    q_nope, q_rot = (part[:, :, 0] for part in group.take(q)[:2])
    if latents.dtype != q_nope.dtype or torch.is_grad_enabled() and q_nope.requires_grad:
        select.fall_back(
            "MLA decode", "a cache of another dtype than its queries, or a step asking gradients"
        )
        return None
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_key.to(q_nope.dtype)).contiguous()
    first, end = group.key_range(window, None)
    out = mla_decode(
        q_latent,
        q_rot.contiguous(),
        latents,
        rotated,
        group.table,
        first,
        end,
        scale,
        None if sinks is None else sinks.float(),
    )
    return torch.einsum("bhr,hvr->bhv", out, w_value.to(out.dtype)).unsqueeze(2)

"""Verifying a speculative draft against the model's own distribution, on rank 0.

A draft of k tokens is fed after a sequence's last token in one forward; the k + 1 rows of logits
that come back are the model's distributions at each drafted position and one past them. What a
request keeps:

- greedy: the drafts as long as each equals the argmax of its row, then that row's argmax (the
  correction, or past an all-accepted draft the next token): exactly the tokens one-at-a-time greedy
  decoding gives.
- sampled: Leviathan et al.'s rejection sampling (vLLM's rejection sampler): draft d at row j is
  kept with probability min(1, p_j(d) / q_j(d)); the first one refused is replaced by a draw from
  the normalised residual max(0, p_j - q_j), and a draft kept whole earns a draw from p_k. Every
  kept token is then distributed as the model alone would draw it. q is the drafter's distribution,
  or (None) a point mass on each draft, as the MTP drafter proposes its argmax.
"""

from __future__ import annotations

import torch

from ster_dist import kernels


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """(the drafts kept, then the token after them) and how many drafts were kept, for logits [k +
    1, vocab]."""
    best = kernels.argmax(logits).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return drafts[:kept] + [best[kept]], kept


def rejection_sample(
    target: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """(the drafts kept, then one drawn token) and how many drafts were kept, for the model's
    probabilities target [k + 1, vocab] and the drafter's draft_probs [k, vocab] (None: a point mass
    on each draft)."""
    k = len(drafts)
    if target.shape[0] != k + 1:
        raise ValueError(
            f"{k} drafts need {k + 1} rows of target probabilities, got {target.shape[0]}"
        )
    device = target.device
    uniforms = torch.rand(k, generator=generator, device=device) if k else None
    for j, d in enumerate(drafts):
        p = target[j, d]
        q = draft_probs[j, d] if draft_probs is not None else torch.ones((), device=device)
        if q > 0 and uniforms[j] * q < p:  # u < p / q, without dividing by a zero q
            continue
        point = draft_probs[j] if draft_probs is not None else _one_hot(d, target.shape[1], target)
        residual = (target[j] - point).clamp_min(0)
        total = residual.sum()
        # p == q everywhere leaves no residual, and then every draft is kept; guard against rounding
        # all the same
        residual = residual / total if total > 0 else target[j]
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))], j
    return drafts + [int(torch.multinomial(target[k], 1, generator=generator))], k


def _one_hot(token: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    point = torch.zeros(vocab, dtype=like.dtype, device=like.device)
    point[token] = 1
    return point

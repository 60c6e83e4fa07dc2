"""`ster tune evaluate`: loss and perplexity over completion tokens, with or without an adapter;
nothing written.

Examples are encoded as training encodes them (tune/data.py) and scored by the same summed NLL
(tune/loss.py) on the session's ranks, the adapter attached unmerged as `ster generate --adapter`
attaches it. Two means are reported: token-weighted (every completion token counts once: the
quantity training minimises) with its perplexity exp(loss), and per-example means (of each example's
own mean loss, and of each example's own perplexity).
"""

from __future__ import annotations

import math

import torch

from ster_dist.tune.data import Example, collate
from ster_dist.tune.loss import completion_nll
from ster_dist.workers.extension import RankExtension


class LossesOnRank(RankExtension):
    """Scores examples on one rank; it holds nothing between calls."""

    @torch.inference_mode()
    def losses(
        self, examples: list[Example], pad_id: int, batch_size: int
    ) -> list[tuple[float, int]] | None:
        """(summed NLL, completion tokens) per example, from the lead rank (every rank of the last
        pipeline stage computes the same logits; an earlier stage only hands its output on)."""
        out = []
        for start in range(0, len(examples), batch_size):
            inputs, valid, targets = collate(examples[start : start + batch_size], pad_id)
            if not self.model.ctx.last_stage:
                self.model(inputs, None, valid)
                continue
            nll, tokens = completion_nll(self.model, inputs, valid, targets)
            out += [(float(n), int(t)) for n, t in zip(nll.double(), tokens)]
        return self.first_rank_only(out)


def summarise(per_example: list[tuple[float, int]]) -> dict:
    total = sum(n for n, _ in per_example)
    tokens = sum(t for _, t in per_example)
    token_loss = total / tokens
    means = [n / t for n, t in per_example]
    return {
        "examples": len(per_example),
        "completion_tokens": tokens,
        "loss": token_loss,
        "perplexity": _exp(token_loss),
        "per_example_loss": sum(means) / len(means),
        "per_example_perplexity": sum(_exp(m) for m in means) / len(means),
    }


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf

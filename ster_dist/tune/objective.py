"""What a training run minimises, apart from how it is run: the one part `tune sft`, `tune dpo`,
`tune reward` and `tune grpo` do not share.

The training loop (tune/train.py) knows nothing of examples or losses. It asks the run's objective
how many units a step is averaged over (completion tokens for sft, pairs for preference objectives),
how a micro-batch of items becomes tensors (on the rank, where a sampling objective draws them from
the decoder), the micro-batch's summed loss with a vector of sums
beside it (the loss sum and the unit count first, then the objective's own), and, once those sums
are added over the data-parallel ranks, the step's report. An objective may also bring a trainable
head of its own (the reward head), trained and written beside the factors.
"""

from __future__ import annotations

import torch
from torch import nn

from ster_dist.tune.data import Example, collate
from ster_dist.tune.loss import completion_nll


class Objective:
    """The supervised objective: mean negative log-likelihood over every completion token of a
    step."""

    name = "sft"
    width = 2  # the sums a micro-batch hands back: (summed loss, units)

    def units(self, items: list) -> int:
        return sum(e.completion_tokens for e in items)

    def collate(self, items: list[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
        return collate(items, pad_id)

    def inputs(
        self, decoder, attached, items: list, pad_id: int, step: int
    ) -> tuple[torch.Tensor, ...]:
        """A micro-batch's tensors on the rank, before its forward: the items collated, or, for an
        objective that samples them (grpo), drawn from the policy as it stands at step `step`."""
        return self.collate(items, pad_id)

    def head(self, hidden_size: int, seed: int, std: float) -> nn.Module | None:
        """A trainable module beside the factors, or None."""
        return None

    def loss(
        self, decoder, attached, head, batch: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss over the micro-batch, float64 sums [width]); attached is already
        refreshed."""
        nll, tokens = completion_nll(decoder, *batch)
        return nll.sum(), torch.tensor(
            [float(nll.detach().sum()), float(tokens.sum())], dtype=torch.float64
        )

    def report(self, sums: torch.Tensor) -> dict:
        """A step's numbers from its sums over every rank and micro-batch."""
        return {"loss": float(sums[0] / sums[1]), "tokens": int(sums[1]), "units": int(sums[1])}


SFT = Objective()

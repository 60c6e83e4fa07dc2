"""Preference objectives over pairs (tune/pairs.py): DPO, IPO, and a Bradley-Terry reward model.

DPO (Rafailov et al.): loss = -log sigmoid(beta * h), h = (pi_c - ref_c) - (pi_r - ref_r), with pi
and ref each completion's summed log-probability under the trained model and under the frozen
reference. The reference is the same decoder with the adapters skipped (Attached.skipped), not a
second copy, and since LoRA's B starts at zero the first step has pi == ref exactly: h = 0 and the
loss is ln 2.

IPO (Azar et al.): loss = (h - 1 / (2 beta))^2 with pi and ref each completion's mean
log-probability per token, as TRL's IPO takes them; the first step's loss is 1 / (4 beta^2).

Both report what TRL's DPOTrainer logs: the implicit rewards beta * (pi - ref) of the chosen and the
rejected completion, their margin, and the share of pairs whose chosen reward is the higher.

Reward (Bradley-Terry): a head Linear(hidden, 1), no bias, as Transformers' sequence-classification
models hold it (`score`), reads the final hidden state of each sequence's last token (its
end-of-sequence token) and loss = -log sigmoid(r_c - r_r). The head starts at zero, so every reward
starts at zero and the first loss is ln 2; it is trained with the factors and written with them
(tune/writer.py). Its input is replicated on every tensor-parallel rank, so its gradient is summed
over them as a factor's is (tune/parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.tune.data import collate
from ster_dist.tune.loss import completion_nll
from ster_dist.tune.objective import Objective
from ster_dist.tune.pairs import Pair, collate_whole

METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


class _PairObjective(Objective):
    # (summed loss, pairs, summed chosen reward, summed rejected reward, pairs ranked right)
    width = 5

    def units(self, items: list[Pair]) -> int:
        return len(items)

    def report(self, sums: torch.Tensor) -> dict:
        pairs = float(sums[1])
        chosen, rejected = float(sums[2]) / pairs, float(sums[3]) / pairs
        return {
            "loss": float(sums[0]) / pairs,
            "pairs": int(pairs),
            "units": int(pairs),
            "reward_chosen": chosen,
            "reward_rejected": rejected,
            "reward_margin": chosen - rejected,
            "reward_accuracy": float(sums[4]) / pairs,
        }

    @staticmethod
    def _sums(losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        chosen, rejected = chosen.detach().double(), rejected.detach().double()
        return torch.stack(
            [
                losses.detach().double().sum(),
                torch.tensor(float(len(losses)), dtype=torch.float64),
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).double().sum(),
            ]
        )


class DirectPreference(_PairObjective):
    """DPO or IPO against the adapters-skipped reference."""

    def __init__(self, loss: str, beta: float):
        self.name, self.beta = loss, beta

    def collate(self, items: list[Pair], pad_id: int) -> tuple[torch.Tensor, ...]:
        """The chosen completions' rows, then the rejected ones': one forward scores both."""
        return collate([p.chosen for p in items] + [p.rejected for p in items], pad_id)

    def loss(self, decoder, attached, head, batch):
        with torch.no_grad(), attached.skipped():
            ref_nll, tokens = completion_nll(decoder, *batch)
        nll, _ = completion_nll(decoder, *batch)
        policy, reference = -nll.double(), -ref_nll.double()
        if self.name == "ipo":
            policy, reference = policy / tokens, reference / tokens
        ratio = policy - reference
        half = len(ratio) // 2
        h = ratio[:half] - ratio[half:]
        losses = (
            -F.logsigmoid(self.beta * h) if self.name == "dpo" else (h - 1 / (2 * self.beta)) ** 2
        )
        return losses.sum(), self._sums(losses, self.beta * ratio[:half], self.beta * ratio[half:])


class RewardModel(_PairObjective):
    """Bradley-Terry over a scalar head on the last token's final hidden state."""

    name = "reward"

    def head(self, hidden_size: int, seed: int, std: float) -> nn.Module:
        score = nn.Linear(hidden_size, 1, bias=False)
        with torch.no_grad():
            score.weight.copy_(
                torch.randn(1, hidden_size, generator=torch.Generator().manual_seed(seed)) * std
                if std
                else torch.zeros(1, hidden_size)
            )
        return score

    def collate(self, items: list[Pair], pad_id: int) -> tuple[torch.Tensor, ...]:
        return collate_whole([p.chosen for p in items] + [p.rejected for p in items], pad_id)

    def loss(self, decoder, attached, head, batch):
        scores = rewards(decoder, attached.ctx.sum_grad(head.weight), *batch)
        half = len(scores) // 2
        losses = -F.logsigmoid(scores[:half] - scores[half:])
        return losses.sum(), self._sums(losses, scores[:half], scores[half:])


def rewards(
    decoder, head_weight: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Each right-padded sequence's reward [batch] under a trained head (f32)."""
    hidden = decoder.final_hidden(ids, valid)
    last = hidden[torch.arange(len(ids)), valid.sum(-1) - 1]
    return F.linear(last, head_weight.to(last.dtype)).float().squeeze(-1)

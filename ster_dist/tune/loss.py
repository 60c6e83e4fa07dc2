"""Negative log-likelihood of completion tokens, per example, from the decoder's logits.

Training and evaluation share it, so the loss a run reports is the loss `ster tune evaluate` reads.
Logits are taken in f32 whatever the weights' precision, as Transformers' loss takes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.tune.data import IGNORE


def completion_nll(
    model, inputs: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed negative log-likelihood [batch], completion tokens [batch]) over right-padded
    rows."""
    logits = model(inputs, None, valid)
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    )
    counted = targets != IGNORE
    return nll.view(targets.shape).sum(-1), counted.sum(-1)

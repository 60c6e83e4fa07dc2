"""`steer optimize`: fit every layer x method on the first pairs, rank the candidates on the
held-out rest, publish the whole ranking, and refit the winner on every pair.

Ranking prefers holdout accuracy and breaks ties on holdout margin (the first candidate walked
wins an exact tie). Rows stay in the order the search walked them (layer, then caa / pca /
logistic), so two runs over the same layers diff line for line.
"""

from __future__ import annotations

import math

import torch

from ster_dist.errors import Refusal
from ster_dist.steer.artifact import Direction, finite
from ster_dist.steer.fit import METHODS, evaluate_direction, train_direction


def split(count: int, fraction: float) -> tuple[int, int]:
    """(fit pairs, holdout pairs): the holdout is `fraction` of the pairs rounded to whole pairs."""
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 < fraction < 1):
        raise Refusal("the held-out fraction must be above zero and below one")
    holdout = math.floor(fraction * count + 0.5)
    fit = count - holdout
    if holdout < 1 or fit < 1:
        raise Refusal(
            f"a held-out fraction of {fraction} over {count} contrastive pairs leaves {fit} pairs to "
            f"fit and {holdout} to rank on; both need at least one"
        )
    return fit, holdout


def rank_candidates(
    positive: dict[int, torch.Tensor],
    negative: dict[int, torch.Tensor],
    layers: list[int],
    fit: int,
) -> tuple[list[dict], int]:
    """Every (layer, method) fitted on pairs [:fit] and scored on [fit:]; returns rows and the
    winner."""
    rows, best = [], None
    for layer in layers:
        for method in METHODS:
            direction = train_direction(positive[layer][:fit], negative[layer][:fit], method)
            accuracy, margin = evaluate_direction(
                positive[layer][fit:], negative[layer][fit:], direction
            )
            rows.append(
                {
                    "layer": layer,
                    "method": method,
                    "holdout_accuracy": finite(accuracy),
                    "holdout_margin": finite(margin),
                    "selected": False,
                }
            )
            if best is None or (accuracy, margin) > (
                rows[best]["holdout_accuracy"],
                rows[best]["holdout_margin"],
            ):
                best = len(rows) - 1
    rows[best]["selected"] = True
    return rows, best


def refit(
    positive: dict[int, torch.Tensor], negative: dict[int, torch.Tensor], layer: int, method: str
) -> Direction:
    direction = train_direction(positive[layer], negative[layer], method)
    accuracy, margin = evaluate_direction(positive[layer], negative[layer], direction)
    return Direction(layer, direction, finite(accuracy), finite(margin))

"""`ster vector curve`: how many pairs a direction needs (Ster's guide/steering.md, "Pair count").

The last `holdout` fraction of the set is held out as `vector optimize` holds it out; the method
is fitted at every layer on the first N pairs of the rest for every N in `sizes`, and every fit is
scored on the same held-out pairs. Per layer, `enough` is the smallest size that reached the best
held-out accuracy any size reached there.
"""

from __future__ import annotations

import torch

from ster_dist.errors import Refusal
from ster_dist.steer.artifact import finite
from ster_dist.steer.fit import evaluate_direction, train_direction


def check_sizes(sizes: list[int], fit: int, held: int) -> None:
    for size in sizes:
        if size < 1:
            raise Refusal(
                f"a size of {size} pairs fits nothing; every size needs at least one pair"
            )
        if size > fit:
            raise Refusal(
                f"a size of {size} pairs does not fit in the {fit} pairs left to fit on after "
                f"holding out {held}"
            )


def curve(
    positive: dict[int, torch.Tensor],
    negative: dict[int, torch.Tensor],
    layers: list[int],
    method: str,
    sizes: list[int],
    fit: int,
) -> tuple[list[dict], list[dict]]:
    """(points, enough): one point per size and layer, and the smallest best size per layer."""
    points, enough = [], []
    for layer in layers:
        held_pos, held_neg = positive[layer][fit:], negative[layer][fit:]
        rows = []
        for size in sizes:
            direction = train_direction(positive[layer][:size], negative[layer][:size], method)
            accuracy, margin = evaluate_direction(held_pos, held_neg, direction)
            rows.append(
                {
                    "size": size,
                    "layer": layer,
                    "holdout_accuracy": finite(accuracy),
                    "holdout_margin": finite(margin),
                }
            )
        best = max(row["holdout_accuracy"] for row in rows)
        smallest = min(row["size"] for row in rows if row["holdout_accuracy"] == best)
        enough.append({"layer": layer, "size": smallest, "holdout_accuracy": best})
        points.extend(rows)
    return points, enough

"""Fitting a direction from matched positive / negative activation rows, and scoring one.

Three estimators (Ster's, by the same names): caa is the mean of positive - negative; pca is the
leading principal direction of the centred pairwise differences, signed to agree with their mean;
logistic is the weight of a logistic probe (positives 1, negatives 0; full-batch gradient descent,
300 steps, rate 0.1 decayed by 1 / (1 + 0.01 step), L2 1e-4, zero start, no bias). Every result is
unit-normalised, so `--strength` is the whole magnitude and strengths compare across methods.

Scoring: a pair's margin is (p - n) . d; accuracy is the share of pairs with a margin above zero
and the margin reported is their mean. Arithmetic is in float64 (a 2048-term dot in f32 loses its
low bits); directions are handed back as f32.
"""

from __future__ import annotations

import torch

from ster_dist.errors import Refusal

METHODS = ("caa", "pca", "logistic")
ALIASES = {"mean-difference": "caa", "probe": "logistic"}


def canonical_method(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise Refusal(f'unknown training method "{name}"; expected caa, pca, or logistic')
    return name


def _check(positive: torch.Tensor, negative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if positive.dim() != 2 or positive.shape[0] == 0 or positive.shape[0] != negative.shape[0]:
        raise Refusal(
            "training requires the same non-zero number of positive and negative examples"
        )
    if positive.shape[1] == 0:
        raise Refusal("activation vectors are empty")
    if negative.shape[1] != positive.shape[1] or not (
        positive.isfinite().all() and negative.isfinite().all()
    ):
        raise Refusal("activation vectors must have one finite, consistent width")
    return positive.double(), negative.double()


def _unit(vector: torch.Tensor) -> torch.Tensor:
    norm = vector.norm()
    if not torch.isfinite(norm) or norm <= torch.finfo(torch.float32).eps:
        raise Refusal(
            "training produced a zero or non-finite direction; use pairs that differ in the trait"
        )
    return vector / norm


def caa(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    return (positive - negative).mean(0)


def pca(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    differences = positive - negative
    mean = differences.mean(0)
    centred = differences - mean
    # With one pair (or identical differences) nothing varies, so no principal direction exists;
    # the mean difference is then the only direction the data states.
    if centred.abs().max() <= 1e-12 * max(1.0, float(differences.abs().max())):
        return mean
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    leading = vh[0]
    return -leading if torch.dot(leading, mean) < 0 else leading


def logistic(
    positive: torch.Tensor,
    negative: torch.Tensor,
    steps: int = 300,
    rate: float = 0.1,
    l2: float = 1e-4,
) -> torch.Tensor:
    rows = torch.cat([positive, negative])
    labels = torch.cat([torch.ones(len(positive)), torch.zeros(len(negative))]).double()
    weights = torch.zeros(rows.shape[1], dtype=torch.float64)
    for step in range(steps):
        error = torch.sigmoid(rows @ weights) - labels
        gradient = rows.T @ error / len(rows)
        weights = weights - rate / (1.0 + 0.01 * step) * (gradient + l2 * weights)
    return weights


def train_direction(positive: torch.Tensor, negative: torch.Tensor, method: str) -> torch.Tensor:
    """A unit direction [hidden] (f32) from rows [pairs, hidden] of each side."""
    positive, negative = _check(positive, negative)
    raw = {"caa": caa, "pca": pca, "logistic": logistic}[canonical_method(method)](
        positive, negative
    )
    return _unit(raw).float()


def evaluate_direction(
    positive: torch.Tensor, negative: torch.Tensor, direction: torch.Tensor
) -> tuple[float, float]:
    """(accuracy, mean margin) of `direction` over matched pairs."""
    positive, negative = _check(positive, negative)
    if direction.numel() != positive.shape[1]:
        raise Refusal(
            f"direction width {direction.numel()} does not match activation width {positive.shape[1]}; "
            "use a direction from the same model"
        )
    margins = (positive - negative) @ direction.double().reshape(-1)
    return float((margins > 0).double().mean()), float(margins.mean())

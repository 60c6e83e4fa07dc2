"""Temperature scaling of decisions (Guo et al. 2017): one scalar T for a model, the calibrated
probabilities softmax(logits / T) over each decision's options, where a decision's logits are its
orders' averaged log-probabilities (answer.mean_log_probs, the numbers decide's softmax reads).

T is fitted by golden-section search on log T over [-3, 3], minimising the mean negative
log-likelihood of the labelled answers. The NLL is convex in 1/T, so it has one minimum along
log T (or falls towards a bound) and the search finds it deterministically: a fixed tolerance, a
bounded number of steps, no randomness. Dividing by a positive T keeps every argmax, so accuracy
is the same before and after; NLL, ECE and Brier are what move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ster_dist.decide.answer import argmax, log_softmax

LOG_T_BOUNDS = (-3.0, 3.0)
T_MIN, T_MAX = math.exp(LOG_T_BOUNDS[0]), math.exp(LOG_T_BOUNDS[1])
TOLERANCE = 1e-6  # the width of the final log T bracket
MAX_STEPS = 200  # about 34 steps reach the tolerance; the cap only guards the loop
ECE_BINS = 15  # equal-width confidence bins, as Guo et al. report ECE


@dataclass(frozen=True)
class Decision:
    logits: list[float]  # canonical option order
    label: int  # the right option's canonical index


@dataclass(frozen=True)
class Fit:
    temperature: float
    log_temperature: float
    steps: int
    # the minimum lies at an end of [-3, 3]: these decisions want a T beyond the range
    at_bound: bool


def nll(decisions: list[Decision], temperature: float) -> float:
    return -sum(log_softmax(d.logits, temperature)[d.label] for d in decisions) / len(decisions)


def metrics(decisions: list[Decision], temperature: float = 1.0) -> dict:
    """nll, accuracy, ece (ECE_BINS equal-width bins of the top probability) and brier (the squared
    distance to the one-hot answer, summed over options), each a mean over the decisions."""
    # count, confidence, correct
    correct, brier, bins = 0, 0.0, [[0, 0.0, 0] for _ in range(ECE_BINS)]
    for d in decisions:
        probs = [math.exp(v) for v in log_softmax(d.logits, temperature)]
        top = argmax(probs)
        hit = int(top == d.label)
        correct += hit
        brier += sum((p - (i == d.label)) ** 2 for i, p in enumerate(probs))
        # (lo, hi] bins; a confidence of exactly 0 cannot occur (the top of n options is at least
        # 1/n)
        index = min(ECE_BINS - 1, max(0, math.ceil(probs[top] * ECE_BINS) - 1))
        bins[index][0] += 1
        bins[index][1] += probs[top]
        bins[index][2] += hit
    n = len(decisions)
    ece = sum(abs(hits - confidence) for count, confidence, hits in bins if count) / n
    return {
        "nll": nll(decisions, temperature),
        "accuracy": correct / n,
        "ece": ece,
        "brier": brier / n,
        "decisions": n,
    }


def fit(decisions: list[Decision]) -> Fit:
    """The T minimising nll(decisions, T) within TOLERANCE of log T, by golden-section search."""

    def cost(u: float) -> float:
        return nll(decisions, math.exp(u))

    shrink = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = LOG_T_BOUNDS
    c, d = b - shrink * (b - a), a + shrink * (b - a)
    fc, fd = cost(c), cost(d)
    steps = 0
    while b - a > TOLERANCE and steps < MAX_STEPS:
        if fc <= fd:  # the minimum is in [a, d]: d becomes the right end, c the new right probe
            b, d, fd = d, c, fc
            c = b - shrink * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + shrink * (b - a)
            fd = cost(d)
        steps += 1
    # an end that never moved means the minimum is within the tolerance of the bound: report the
    # bound
    low, high = LOG_T_BOUNDS
    u = low if a == low else high if b == high else (a + b) / 2.0
    return Fit(math.exp(u), u, steps, a == low or b == high)

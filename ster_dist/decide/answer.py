"""From answer-letter logits to answers (Ster's arithmetic).

Each order's row (in canonical option order, whatever letters the options wore) is normalised on
its own, the log-probabilities are averaged over the orders, and one softmax at the temperature
gives the probabilities. Normalising per row first is what cancels a letter preference: over all
cyclic orders every option wears the favoured letter once, so the favour adds the same amount to
every option's mean and the softmax removes it, while the content survives in every order.
"""

from __future__ import annotations

import math

from ster_dist.decide.prompt import LABELS
from ster_dist.decide.request import Question, text_of


def log_softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [v / temperature for v in row]
    top = max(scaled)
    norm = top + math.log(sum(math.exp(v - top) for v in scaled))
    return [v - norm for v in scaled]


def softmax(row: list[float], temperature: float = 1.0) -> list[float]:
    return [math.exp(v) for v in log_softmax(row, temperature)]


def log_sum_exp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def mean_log_probs(rows: list[list[float]]) -> list[float]:
    """The orders' log-probabilities averaged: the logits a decision's softmax (and a calibration's
    temperature) is applied to."""
    mean = [0.0] * len(rows[0])
    for row in rows:
        for i, value in enumerate(log_softmax(row)):
            mean[i] += value / len(rows)
    return mean


def probabilities(rows: list[list[float]], temperature: float = 1.0) -> list[float]:
    return softmax(mean_log_probs(rows), temperature)


def confidence(probs: list[float]) -> float:
    """1 - entropy / ln(n): 1 with all mass on one option, 0 when spread evenly."""
    if len(probs) < 2:
        return 1.0
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    return min(1.0, max(0.0, 1.0 - entropy / math.log(len(probs))))


def argmax(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def answer(question: Question, probs: list[float]) -> dict:
    if question.type == "choice":
        names = question.names()
        return {
            "type": "choice",
            "choice": names[argmax(probs)],
            "probabilities": dict(zip(names, probs)),
            "confidence": confidence(probs),
        }
    if question.type == "score":
        return {
            "type": "score",
            "score": sum(level * p for level, p in enumerate(probs)),
            "legend": {str(i): text_of(d) for i, d in enumerate(question.criteria)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": confidence(probs),
        }
    return {"type": "noul", "noul": probs[0]}


def explanation(question: Question, rows: list[list[float]], orders: list[list[int]]) -> dict:
    """Per order, the letter each canonical option wore and its probability in that order alone."""
    shown = []
    for row, order in zip(rows, orders):
        letters = [LABELS[order.index(option)] for option in range(len(order))]
        shown.append({"letters": letters, "probabilities": softmax(row)})
    return {"options": question.options(), "orders": shown}

"""`steer evaluate`: how well an artifact's directions order a pair set (per layer: accuracy and
mean projection margin, read at the final token as training reads), and, with `--strengths`, how
hard to push it.

Strength selection is Ster's: each strength is added with the artifact to the frozen model and
every pair is scored twice, the steered model's log-probability of each side (summed over its
tokens after the first) minus the unsteered model's. A pair is ordered when steering raised its
positive side more than its negative side; its shift is the difference. The pick is the largest
share ordered, the larger mean shift breaking a tie (the first named wins an exact tie).
"""

from __future__ import annotations

import math

import torch

from ster_dist.errors import Refusal
from ster_dist.model.cache import left_pad
from ster_dist.steer.artifact import SteeringArtifact
from ster_dist.steer.attach import attach
from ster_dist.steer.fit import evaluate_direction
from ster_dist.steer.pairs import PairSet
from ster_dist.steer.text import encode_response
from ster_dist.workers.extension import RankExtension


def score_layers(
    artifact: SteeringArtifact, positive: dict[int, torch.Tensor], negative: dict[int, torch.Tensor]
) -> list[dict]:
    rows = []
    for vector in artifact.vectors:
        accuracy, margin = evaluate_direction(
            positive[vector.layer], negative[vector.layer], vector.values
        )
        rows.append({"layer": vector.layer, "accuracy": accuracy, "margin": margin})
    return rows


@torch.inference_mode()
def sequence_logprobs(model, rows: list[list[int]], pad_id: int = 0) -> list[float] | None:
    """Per row, the log-probability of its tokens after the first given the ones before them (None
    on a pipeline stage but the last: it holds no logits)."""
    ids, pos, valid = left_pad(rows, pad_id)
    logits = model(ids, pos, valid)
    if logits is None:
        return None
    logits = logits[:, :-1].float()
    token = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    scored = valid[:, :-1] & valid[:, 1:]
    return (token.double() * scored).sum(-1).tolist()


@torch.inference_mode()
def token_logprobs(
    model, row: list[int], top: int
) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """For each token of `row` after the first: its log-probability given the ones before, and the
    `top` most likely (id, log-probability) there (None on a pipeline stage but the last). One row
    at a time: the logits of a whole batch of long prompts would be rows x length x vocabulary
    floats."""
    ids, pos, valid = left_pad([row], 0)
    logits = model(ids, pos, valid)
    if logits is None:
        return None
    logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
    if top:
        values, indices = logprobs.topk(top, dim=-1)
        best = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        best = [[] for _ in chosen]
    return list(zip(chosen, best))


class LogprobsOnRank(RankExtension):
    """Scores sequences on one rank (every rank holds the same gathered logits)."""

    def logprobs(self, rows: list[list[int]], pad_id: int) -> list[float] | None:
        return self.first_rank_only(sequence_logprobs(self.model, rows, pad_id))

    def token_logprobs(self, rows: list[list[int]], top: int) -> list | None:
        return self.first_rank_only([token_logprobs(self.model, row, top) for row in rows])


def check_strength_options(strengths, batch_size, max_sequence) -> list[float]:
    if batch_size is None:
        raise Refusal("--strengths needs --batch-size; Ster assumes none")
    if max_sequence is None:
        raise Refusal("--strengths needs --max-sequence; Ster assumes none")
    if not strengths:
        raise Refusal("strength selection needs at least one strength to measure")
    for value in strengths:
        if not math.isfinite(value):
            raise Refusal(f"strength selection needs finite strengths, not {value}")
    if batch_size < 1:
        raise Refusal("strength selection requires batch size of at least one")
    if max_sequence < 1:
        raise Refusal("strength selection requires sequence limit of at least one")
    return [float(s) for s in strengths]


def encode_sides(
    tokenizer, pairs: PairSet, chat_template: str, limit: int, progress
) -> list[tuple[int, list[int], list[int]]]:
    """(pair index, positive ids, negative ids) for the pairs within `limit` tokens."""
    kept = []
    for index, (positive, negative) in enumerate(pairs.pairs):
        sides = [encode_response(tokenizer, text, chat_template) for text in (positive, negative)]
        for name, ids in zip(("positive", "negative"), sides):
            if len(ids) < 2:
                raise Refusal(
                    f"pair {index} {name} side encodes to one token, so there is nothing to predict; "
                    "lengthen it"
                )
        longest = max(len(s) for s in sides)
        if longest > limit:
            progress(f"skipping pair {index}: {longest} tokens exceed the {limit} token limit")
            continue
        kept.append((index, sides[0], sides[1]))
    if not kept:
        raise Refusal(
            f"every pair is longer than the {limit}-token sequence limit, so there is nothing to "
            "score; raise --max-sequence"
        )
    return kept


def _pair_scores(group, kept, batch_size: int, pad_id: int) -> list[tuple[float, float]]:
    out = []
    for start in range(0, len(kept), batch_size):
        rows = []
        for _, positive, negative in kept[start : start + batch_size]:
            rows += [positive, negative]
        values = group.on(LogprobsOnRank).logprobs(rows, pad_id)[group.lead]
        out += list(zip(values[0::2], values[1::2]))
    return out


def strength_report(
    group,
    tokenizer,
    pairs: PairSet,
    artifact: SteeringArtifact,
    strengths: list[float],
    batch_size: int,
    max_sequence: int,
    chat_template: str,
    pad_id: int,
    progress,
) -> dict:
    kept = encode_sides(tokenizer, pairs, chat_template, max_sequence, progress)
    progress(f"scoring {len(kept)} pairs under the unsteered model")
    reference = _pair_scores(group, kept, batch_size, pad_id)
    candidates = []
    for strength in strengths:
        detach = attach(group, artifact, strength)
        try:
            steered = _pair_scores(group, kept, batch_size, pad_id)
        finally:
            detach()
        shifts = [(sp - rp) - (sn - rn) for (sp, sn), (rp, rn) in zip(steered, reference)]
        row = {
            "strength": strength,
            "ordered": sum(s > 0 for s in shifts) / len(shifts),
            "mean_shift": sum(shifts) / len(shifts),
            "selected": False,
        }
        progress(
            f"strength {strength}: {row['ordered']:.3f} of pairs ordered, mean shift {row['mean_shift']:.4f}"
        )
        candidates.append(row)
    best = 0
    for i, row in enumerate(candidates):
        lead = candidates[best]
        if row["ordered"] > lead["ordered"] or (
            row["ordered"] == lead["ordered"] and row["mean_shift"] > lead["mean_shift"]
        ):
            best = i
    candidates[best]["selected"] = True
    return {
        "method": artifact.method,
        "layers": artifact.layers,
        "pairs": len(pairs.pairs),
        "scored_pairs": len(kept),
        "skipped_long": len(pairs.pairs) - len(kept),
        "selected_strength": candidates[best]["strength"],
        "candidates": candidates,
    }

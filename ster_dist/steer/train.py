"""`steer train`'s work: read both sides of every pair at the final token of every selected layer
(one batched pass captures all layers at once), fit one direction per layer, score it on the same
pairs, and build the artifact."""

from __future__ import annotations

import torch

from ster_dist.steer.artifact import FINGERPRINT, Direction, SteeringArtifact, finite
from ster_dist.steer.capture import last_token_rows
from ster_dist.steer.fit import evaluate_direction, train_direction
from ster_dist.steer.pairs import PairSet
from ster_dist.steer.text import encode_prompt


def read_pairs(
    group,
    tokenizer,
    pairs: PairSet,
    layers: list[int],
    chat_template: str,
    pad_id: int,
    batch_size: int,
    on_batch=None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """({layer: positive rows}, {layer: negative rows}), rows in pair order."""
    sides = [
        encode_prompt(tokenizer, text, chat_template) for text in pairs.positives + pairs.negatives
    ]
    rows = last_token_rows(group, sides, layers, pad_id, batch_size, on_batch)
    n = len(pairs.pairs)
    return {l: r[:n] for l, r in rows.items()}, {l: r[n:] for l, r in rows.items()}


def fit_layers(
    positive: dict[int, torch.Tensor],
    negative: dict[int, torch.Tensor],
    layers: list[int],
    method: str,
) -> list[Direction]:
    out = []
    for layer in layers:
        direction = train_direction(positive[layer], negative[layer], method)
        accuracy, margin = evaluate_direction(positive[layer], negative[layer], direction)
        out.append(Direction(layer, direction, finite(accuracy), finite(margin)))
    return out


def build_artifact(
    model: str,
    revision: str | None,
    pairs: PairSet,
    method: str,
    hidden_size: int,
    vectors: list[Direction],
    precision: str,
    chat: str,
    fingerprint: str | None = None,
) -> SteeringArtifact:
    """`fingerprint`: the model's weights fingerprint (shard/fingerprint.py), recorded in the
    metadata so the artifact is matched to those weights wherever they are loaded from."""
    metadata = {FINGERPRINT: fingerprint} if fingerprint else {}
    return SteeringArtifact(
        model=model,
        model_revision=revision,
        trait_name=pairs.trait_name,
        method=method,
        hidden_size=hidden_size,
        vectors=vectors,
        precision=precision,
        chat_template=chat,
        metadata=metadata,
    ).validate()

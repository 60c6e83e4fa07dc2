"""Ster's contrastive pair set (`{"trait_name": ..., "pairs": [{"positive", "negative"}]}`) and
the prompt set (`{"prompts": [...]}`): read and checked whole before any model work."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ster_dist.errors import Refusal
from ster_dist.inputs import read_bytes


@dataclass(frozen=True)
class PairSet:
    trait_name: str
    pairs: tuple[tuple[str, str], ...]  # (positive, negative), in file order

    @property
    def positives(self) -> list[str]:
        return [p for p, _ in self.pairs]

    @property
    def negatives(self) -> list[str]:
        return [n for _, n in self.pairs]

    def label(self) -> str:
        return self.trait_name.strip() or "(unnamed)"


def _read(path: str, what: str):
    data = read_bytes(path, f"failed to read {what}")
    try:
        return json.loads(data)
    except RecursionError:  # json.loads' depth limit, reached by a file of ordinary size
        raise Refusal(
            f"invalid {what} JSON in {path}: its arrays or objects nest too deeply; flatten it"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refusal(f"invalid {what} JSON in {path}: {getattr(exc, 'msg', exc)}") from None


def load_pairs(path: str) -> PairSet:
    data = _read(path, "pair set")
    if not isinstance(data, dict) or not isinstance(data.get("pairs"), list):
        raise Refusal(
            f'invalid pair set JSON in {path}: expected {{"trait_name": "...", "pairs": '
            '[{"positive": "...", "negative": "..."}]}'
        )
    unknown = set(data) - {"trait_name", "pairs"}
    if unknown:
        raise Refusal(
            f"invalid pair set JSON in {path}: unknown field {min(unknown)!r}; "
            "a pair set holds trait_name and pairs"
        )
    trait = data.get("trait_name", "")
    if not isinstance(trait, str):
        raise Refusal(f"invalid pair set JSON in {path}: trait_name must be a string")
    pairs = []
    for index, pair in enumerate(data["pairs"]):
        if (
            not isinstance(pair, dict)
            or set(pair) != {"positive", "negative"}
            or not all(isinstance(pair[k], str) for k in pair)
        ):
            raise Refusal(
                f"invalid pair set JSON in {path}: pair {index} must be exactly "
                '{"positive": "...", "negative": "..."}'
            )
        pairs.append((pair["positive"], pair["negative"]))
    if not pairs:
        raise Refusal(f"pair set {path} contains no pairs; add at least one matched pair")
    if any(not p.strip() or not n.strip() for p, n in pairs):
        raise Refusal(
            f"pair set {path} contains an empty positive or negative prompt; fill both sides"
        )
    return PairSet(trait, tuple(pairs))


def load_prompts(path: str) -> list[str]:
    data = _read(path, "prompt")
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise Refusal(f'invalid prompt JSON in {path}: expected {{"prompts": ["...", ...]}}')
    if not prompts:
        raise Refusal("prompt set contains no prompts; add at least one")
    if any(not p.strip() for p in prompts):
        raise Refusal(f"prompt must not be empty: {path} holds a blank prompt")
    return prompts

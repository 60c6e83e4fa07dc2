"""Writing Ster's pair sets (`ster pairs add | remove | edit | merge`): no model is loaded.

Every write leaves what Ster leaves: the set validated as every reader validates it (steer/pairs.py)
before anything is written, then pretty JSON (serde's two-space layout) with a trailing newline,
written beside the target and renamed. Refusals are Ster's sentences (guide/pair-sets.md).
"""

from __future__ import annotations

from pathlib import Path

from ster_dist.atomic import replacing
from ster_dist.errors import Refusal
from ster_dist.steer.pairs import PairSet, load_pairs
from ster_dist.steer.ster_json import dumps


def pair_document(pairs: PairSet) -> dict:
    return {
        "trait_name": pairs.trait_name,
        "pairs": [
            {"positive": positive, "negative": negative} for positive, negative in pairs.pairs
        ],
    }


def save_pairs(path: str, pairs: PairSet) -> None:
    """Validated (as load_pairs reads it back), then written whole."""
    if not pairs.pairs:
        raise Refusal(f"pair set {path} contains no pairs")
    if any(not p.strip() or not n.strip() for p, n in pairs.pairs):
        raise Refusal(
            f"pair set {path} contains an empty positive or negative prompt; fill both sides"
        )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with replacing(target) as handle:
        handle.write(dumps(pair_document(pairs), pretty=True) + "\n")


def add_pair(path: str, positive: str, negative: str, trait: str | None) -> PairSet:
    """Append one pair, creating the file (and its parent) when it does not exist."""
    current = load_pairs(path) if Path(path).exists() else PairSet("", ())
    pairs = PairSet(
        current.trait_name if trait is None else trait, current.pairs + ((positive, negative),)
    )
    save_pairs(path, pairs)
    return pairs


def _index(pairs: PairSet, index: int) -> None:
    if not 0 <= index < len(pairs.pairs):
        raise Refusal(f"pair index {index} is outside the set's 0..{len(pairs.pairs) - 1} range")


def remove_pair(path: str, index: int) -> PairSet:
    current = load_pairs(path)
    _index(current, index)
    pairs = PairSet(current.trait_name, current.pairs[:index] + current.pairs[index + 1 :])
    save_pairs(path, pairs)  # removing the last pair is refused here, the file untouched
    return pairs


def edit_pair(
    path: str, index: int, positive: str | None, negative: str | None, trait: str | None
) -> PairSet:
    if positive is None and negative is None and trait is None:
        raise Refusal("pairs edit changes nothing without --positive, --negative or --trait")
    current = load_pairs(path)
    _index(current, index)
    old_positive, old_negative = current.pairs[index]
    changed = (
        old_positive if positive is None else positive,
        old_negative if negative is None else negative,
    )
    pairs = PairSet(
        current.trait_name if trait is None else trait,
        current.pairs[:index] + (changed,) + current.pairs[index + 1 :],
    )
    save_pairs(path, pairs)
    return pairs


def merge_pairs(sources: list[str], trait: str, output: str) -> tuple[PairSet, list[PairSet]]:
    """Every pair of every source, in the order named, under `trait`."""
    if len(sources) < 2:
        raise Refusal(f"pairs merge needs at least two pair sets and got {len(sources)}")
    if not trait.strip():
        raise Refusal("pairs merge needs the trait name the merged set is fitted for")
    read = [load_pairs(source) for source in sources]
    merged = PairSet(trait, tuple(pair for pairs in read for pair in pairs.pairs))
    save_pairs(output, merged)
    return merged, read

"""Hashed n-gram embeddings read from a normalised config (config.py's n-gram part;
model/ngram_embedding.py computes them): LongCat-Flash-Lite's families state `ngram_embedding` from
emb_neighbor_num, emb_split_num and ngram_vocab_size_ratio (families/longcat.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ster_dist.config.keys import Keys
from ster_dist.errors import Refusal


@dataclass(frozen=True)
class NgramConfig:
    """Tables (order - 2) * splits + j for orders 2 .. neighbors and splits j, each `rows` tall."""

    # the longest n-gram: the token and neighbors - 1 before it
    neighbors: int
    rows: tuple[int, ...]  # per table, its height (the hash's modulus)
    # tokens after which a run restarts (the config's eos_token_id)
    breaks: tuple[int, ...]


def ngram_config(keys: Keys, hidden: int) -> NgramConfig | None:
    """The n-gram part of a normalised config; None where it states no ngram_embedding."""
    stated = keys.get("ngram_embedding")
    if stated is None:
        return None
    ngram = NgramConfig(
        int(stated["neighbors"]),
        tuple(int(r) for r in stated["rows"]),
        tuple(int(t) for t in stated["breaks"]),
    )
    if (
        ngram.neighbors < 2
        or not ngram.rows
        or len(ngram.rows) % (ngram.neighbors - 1)
        or hidden % len(ngram.rows)
    ):
        raise Refusal(
            f"invalid model config {keys.path}: {len(ngram.rows)} n-gram tables over orders 2 to "
            f"{ngram.neighbors} do not split hidden_size {hidden} evenly; state emb_neighbor_num >= 2 and "
            f"emb_split_num with hidden_size divisible by emb_split_num * (emb_neighbor_num - 1)"
        )
    return ngram

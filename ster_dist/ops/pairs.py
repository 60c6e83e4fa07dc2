"""pairs add | remove | edit | merge as plain functions: each answers the set it wrote."""

from __future__ import annotations

from ster_dist.schema.pairs import (
    PairsAddRequest,
    PairsEditRequest,
    PairsMergeRequest,
    PairsRemoveRequest,
)


def _answer(path: str, pairs) -> dict:
    return {"pairs": str(path), "trait_name": pairs.trait_name, "pair_count": len(pairs.pairs)}


def add(request: PairsAddRequest) -> dict:
    from ster_dist.steer.pair_files import add_pair

    return _answer(
        request.pairs, add_pair(request.pairs, request.positive, request.negative, request.trait)
    )


def remove(request: PairsRemoveRequest) -> dict:
    from ster_dist.steer.pair_files import remove_pair

    return _answer(request.pairs, remove_pair(request.pairs, request.index))


def edit(request: PairsEditRequest) -> dict:
    from ster_dist.steer.pair_files import edit_pair

    return _answer(
        request.pairs,
        edit_pair(request.pairs, request.index, request.positive, request.negative, request.trait),
    )


def merge(request: PairsMergeRequest) -> dict:
    from ster_dist.steer.pair_files import merge_pairs

    merged, sources = merge_pairs(request.pairs, request.trait, request.output)
    return {
        **_answer(request.output, merged),
        "sources": [
            {"pairs": path, "trait_name": s.trait_name, "pair_count": len(s.pairs)}
            for path, s in zip(request.pairs, sources)
        ],
    }

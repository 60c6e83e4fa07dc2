"""pairs add | remove | edit | merge: Ster's pair-set authoring commands; they load no model."""

from __future__ import annotations

from ster_dist.schema.base import Request, field

SET_HELP = 'the pair set ({"trait_name": ..., "pairs": [{"positive", "negative"}]})'


class PairsAddRequest(Request):
    command = ("pairs", "add")
    summary = "append one pair, creating the set (and its directory) when it does not exist"

    pairs: str = field(help=SET_HELP)
    positive: str = field(help="the positive side")
    negative: str = field(help="the negative side")
    trait: str | None = field(None, help="set or replace the set's trait name")


class PairsRemoveRequest(Request):
    command = ("pairs", "remove")
    summary = "remove the pair at a zero-based index"

    pairs: str = field(help=SET_HELP)
    index: int = field(ge=0, help="the pair's zero-based index")


class PairsEditRequest(Request):
    command = ("pairs", "edit")
    summary = "change the sides given of one pair, or the set's trait name"

    pairs: str = field(help=SET_HELP)
    index: int = field(ge=0, help="the pair's zero-based index")
    positive: str | None = field(None, help="the new positive side")
    negative: str | None = field(None, help="the new negative side")
    trait: str | None = field(None, help="the new trait name")


class PairsMergeRequest(Request):
    command = ("pairs", "merge")
    summary = "write one set out of several, every pair in the order the sets were named"

    pairs: list[str] = field(
        help="a pair set; repeat the flag for each (two or more)", cli={"append": True}
    )
    trait: str = field(help="the trait name the merged set is fitted for")
    output: str = field(help="the merged pair set to write")

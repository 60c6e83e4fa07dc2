"""MTP speculative decoding across ranks: greedy output with drafts at TP=2 and EP=2 (the MTP layer sharded like
any decoder layer, drafts made alike on every rank) equals greedy output without drafts on one rank, token for
token, for prompts of mixed length batched together (tests/test_speculative.py has the checkpoint)."""

from __future__ import annotations

import pytest

from ster_dist.workers.spawn import SpawnGroup
from tests.test_speculative import counted, run, with_mtp


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("deepseek_mtp"))


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_greedy_with_drafts_across_ranks_equals_one_rank_without(deepseek, tp, ep):
    want, _ = run(deepseek, 0)
    with SpawnGroup(tp * ep, ep=ep) as group:
        got, stats = run(deepseek, 2, group=group)
    assert got == want
    counted(stats)

"""MTP speculative decoding across ranks: greedy output with drafts at TP=2 and EP=2 (the MTP layer
sharded like any decoder layer, drafts made alike on every rank) equals greedy output without drafts
on one rank, token for token, for prompts of mixed length batched together
(tests/engine/test_speculative.py has the checkpoint); likewise MiMo's layer (stored apart, the
model's head scoring it) at TP=2 and GLM-4.5's sparse one at EP=2, echoing layers whose drafts are
accepted (tests/engine/test_speculative_families.py has those)."""

from __future__ import annotations

import pytest

from ster_dist.workers.spawn import SpawnGroup
from tests.engine.test_speculative import counted, run, with_mtp
from tests.engine.test_speculative_families import with_mimo_mtp


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


@pytest.mark.parametrize("family, tp, ep", [("mimo", 2, 1), ("glm4_moe", 1, 2)])
def test_other_families_drafts_across_ranks_equal_one_rank_without(tmp_path, family, tp, ep):
    directory = (
        with_mimo_mtp(tmp_path, echo=True)
        if family == "mimo"
        else with_mtp(tmp_path, echo=True, family=family)
    )
    want, _ = run(directory, 0)
    with SpawnGroup(tp * ep, ep=ep) as group:
        got, stats = run(directory, 2, group=group)
    assert got == want
    counted(stats)
    assert stats["accepted_tokens"] > 0

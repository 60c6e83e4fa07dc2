"""bench/serving.py's reading of alternating rounds: which round stands for a backend, and the
engine's ratio to each other backend taken round by round (the machine's speed drifts between
rounds, so a ratio of two figures from the same round is the steadier reading of issue 15's ratio
targets)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import serving  # bench/serving.py


def _run(**tok_s: float) -> dict:
    return {"rates": {rate: {"output_throughput": x} for rate, x in tok_s.items()}}


def test_a_backends_median_round_is_picked_by_its_first_rate_and_a_failed_round_counts_lowest():
    done = [_run(inf=90.0), {"rates": {}}, _run(inf=110.0), _run(inf=100.0)]
    assert serving.median_round([done[0], done[2], done[3]]) is done[3]
    assert serving.median_round(done[:3]) is done[0]  # the failed round ranks below 90
    assert serving.median_round(done) is done[0]  # of an even count, the lower middle


def test_the_engines_ratio_to_each_backend_is_taken_within_each_round():
    rounds = {
        "llama-server": [{"inf": 50.0, "4": 30.0}, {"inf": 60.0}],
        "ster-engine": [{"inf": 100.0, "4": 45.0}, {"inf": 90.0}],
        "hf-cb": [{"inf": 25.0}, {}],
    }
    ratios = serving.round_ratios(rounds)
    assert set(ratios) == {"llama-server", "hf-cb"}
    assert ratios["llama-server"] == [{"inf": 2.0, "4": 1.5}, {"inf": 1.5}]
    # a round the other backend has no figure for is left empty
    assert ratios["hf-cb"] == [{"inf": 4.0}, {}]


def test_no_engine_rounds_give_no_ratios():
    assert serving.round_ratios({"hf-cb": [{"inf": 25.0}]}) == {}
    assert serving.round_ratios({}) == {}

"""Left padding of a whole-batch forward (model/cache.py): positions skip the padding; an empty
prompt is refused. Sampling's rules are the engine's (tests/engine/test_engine_sampling.py)."""

from __future__ import annotations

import pytest

from ster_dist.errors import Refusal
from ster_dist.model.cache import left_pad


def test_left_padding_positions_skip_the_padding():
    ids, positions, valid = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert valid.tolist() == [[True, True, True], [False, False, True]]
    assert positions[1, -1].item() == 0 and positions[0].tolist() == [0, 1, 2]


def test_empty_prompt_is_refused():
    with pytest.raises(Refusal, match="encodes to no tokens"):
        left_pad([[1], []])

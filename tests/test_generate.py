"""Sampling and batching rules of ster_dist.generate."""

from __future__ import annotations

import pytest
import torch

from ster_dist.errors import Refusal
from ster_dist.generate import Sampling, left_pad, sample


def test_left_padding_positions_skip_the_padding():
    ids, positions, valid = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert valid.tolist() == [[True, True, True], [False, False, True]]
    assert positions[1, -1].item() == 0 and positions[0].tolist() == [0, 1, 2]


def test_zero_temperature_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    assert sample(logits, Sampling(temperature=0), torch.Generator()).tolist() == [1, 0]


def test_top_p_never_draws_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, -1)
    drawn = sample(logits, Sampling(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}  # 0.5 alone is below 0.7, so the token crossing p (0.3) stays
    share = (drawn == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.03


def test_same_seed_same_draws_and_other_seeds_differ():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    sampling = Sampling(temperature=1.0)
    first = sample(logits, sampling, torch.Generator().manual_seed(3))
    assert torch.equal(first, sample(logits, sampling, torch.Generator().manual_seed(3)))
    assert not torch.equal(first, sample(logits, sampling, torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": -2}, "--max-new-tokens"), ({"temperature": -1}, "--temperature"), ({"top_p": 1.5}, "--top-p"),
])
def test_bad_sampling_is_refused(kwargs, message):
    with pytest.raises(Refusal, match=message):
        Sampling(**kwargs).check()


def test_empty_prompt_is_refused():
    with pytest.raises(Refusal, match="encodes to no tokens"):
        left_pad([[1], []])

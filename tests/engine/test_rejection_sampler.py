"""The speculative verifier alone (engine/rejection.py): greedy keeps exactly the agreeing prefix,
and the rejection sampler's first token is distributed as the model's own distribution, counted over
many draws on a small vocabulary, for a point-mass draft (as the MTP drafter proposes) and for a
drafter with a distribution."""

from __future__ import annotations

import torch

from ster_dist.engine.rejection import rejection_sample, verify_greedy
from ster_dist.engine.sampling import Sampler, SamplingParams

DRAWS = 8000


def test_greedy_keeps_the_agreeing_prefix_then_the_models_token():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])  # argmax 1, 0, 2
    assert verify_greedy(logits, [1, 0]) == ([1, 0, 2], 2)
    assert verify_greedy(logits, [1, 2]) == ([1, 0], 1)
    assert verify_greedy(logits, [2, 0]) == ([1], 0)


def _counts(draw, vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab)
    for _ in range(DRAWS):
        counts[draw()] += 1
    return counts / DRAWS


def _close(observed: torch.Tensor, expected: torch.Tensor) -> None:
    # four standard errors of a frequency over DRAWS draws, at worst 0.5 / sqrt(DRAWS) each
    assert (observed - expected).abs().max() < 4 * 0.5 / DRAWS**0.5, (observed, expected)


def test_the_first_token_follows_the_target_for_a_point_mass_draft():
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(2, 5, generator=g), -1)
    for draft in (int(target[0].argmax()), int(target[0].argmin())):
        freq = _counts(lambda draft=draft: rejection_sample(target, [draft], None, g)[0][0], 5)
        _close(freq, target[0])


def test_every_position_follows_the_target_with_a_drafter_distribution():
    """Two drafts drawn from q; the kept tokens and the draw after them, position by position,
    follow p (the second position given the first: here p's rows do not depend on it, so its
    marginal is p's second row)."""
    g = torch.Generator().manual_seed(1)
    target = torch.softmax(torch.randn(3, 4, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(2, 4, generator=g) * 2, -1)
    first, second = torch.zeros(4), torch.zeros(4)
    seconds = 0
    for _ in range(DRAWS):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        out, kept = rejection_sample(target, drafts, q, g)
        assert len(out) == kept + 1 and out[:kept] == drafts[:kept]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            seconds += 1
    _close(first / DRAWS, target[0])
    assert seconds > DRAWS // 4
    assert (second / seconds - target[1]).abs().max() < 4 * 0.5 / seconds**0.5


def test_the_samplers_target_distribution_is_what_it_draws_from():
    """Sampler.target_probs under temperature and top_k is the distribution Sampler.sample draws
    from."""
    sampler = Sampler(seed=0)
    params = SamplingParams(temperature=0.7, top_k=3, seed=5)
    sampler.add("a", params, [1])
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(2))
    probs = sampler.target_probs(logits, "a")[0]
    assert (probs > 0).sum() == 3
    freq = _counts(lambda: int(sampler.sample(logits, ["a"])[0][0]), 6)
    _close(freq, probs)

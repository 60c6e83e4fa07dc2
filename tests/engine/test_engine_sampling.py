"""The engine's sampler: per-request parameters, their checks, and the batched draw.

References are computed independently: Transformers' logits processors for repetition penalty,
top_k, top_p and min_p; the OpenAI formula for presence and frequency; log_softmax for logprobs;
and a hand-rolled exponential race for the seeded-draw contract.
"""

import math
import zlib

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ster_dist.engine.sampling import (
    Logprobs,
    Sampler,
    SamplingParams,
    _apply_penalties,
    _apply_top_k_top_p,
)
from ster_dist.errors import Refusal

VOCAB = 50
# The determinism contract on each device there is: CUDA generators draw differently from CPU
# ones, but each must still be independent of the batch.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def step_logits(seq: str, step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Fixed logits for one sequence at one step, whatever else is in the batch."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{seq}/{step}".encode()))
    return torch.randn(vocab, generator=g) * 3


def draw_counts(params: SamplingParams, logits: torch.Tensor, draws: int = 4000) -> torch.Tensor:
    """How often each token is drawn over `draws` unseeded rows sharing one seeded sampler."""
    sampler = Sampler(seed=1234)
    ids = [f"r{i}" for i in range(draws)]
    for seq in ids:
        sampler.add(seq, params, [])
    tokens, _ = sampler.sample(logits.expand(draws, -1).clone(), ids)
    return torch.bincount(tokens, minlength=logits.numel())


# ---- greedy ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype, device):
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    before = logits.clone()
    sampler = Sampler(seed=0)
    ids = [f"s{i}" for i in range(7)]
    for seq in ids:
        sampler.add(seq, SamplingParams(), [1, 2, 3])
    tokens, logprobs = sampler.sample(logits, ids)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert logprobs == [None] * 7
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_tiny_temperature_is_greedy_and_greedy_rows_ignore_filters():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(seed=0)
    sampler.add("a", SamplingParams(temperature=1e-7, seed=5), [])
    sampler.add("b", SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5), [])
    sampler.add("c", SamplingParams(temperature=1.0, seed=3), [])
    tokens, _ = sampler.sample(logits, ["a", "b", "c"])
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()


# ---- temperature, top_k, top_p, min_p ------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_the_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draws = 6000
    counts = draw_counts(SamplingParams(temperature=temperature), logits, draws)
    expected = torch.softmax(logits / temperature, -1) * draws
    kept = expected >= 5  # chi-square needs enough expected counts per cell; pool the rest
    observed = torch.cat([counts[kept].double(), counts[~kept].sum().double().reshape(1)])
    wanted = torch.cat([expected[kept].double(), expected[~kept].sum().double().reshape(1)])
    if wanted[-1] < 5:
        observed, wanted = observed[:-1], wanted[:-1]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi2 < 25.0, (counts.tolist(), expected.tolist())  # df <= 5: p < 1e-4 would be 25.7


def test_top_k_keeps_only_k():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    counts = draw_counts(SamplingParams(temperature=5.0, top_k=4), logits)
    assert set(counts.nonzero().flatten().tolist()) == set(logits.topk(4).indices.tolist())


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.81), logits)
    assert counts[:3].gt(0).all() and counts[3] == 0  # 0.5 + 0.3 < 0.81: 0.15 crosses it
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.45), logits)
    assert counts[0] == counts.sum()
    counts = draw_counts(SamplingParams(temperature=1.0, top_p=0.55), logits)
    assert counts[:2].gt(0).all() and counts[2:].sum() == 0


def test_min_p_drops_tokens_below_a_share_of_the_top():
    logits = torch.tensor([0.6, 0.3, 0.06, 0.04]).log()
    counts = draw_counts(SamplingParams(temperature=1.0, min_p=0.15), logits)
    assert counts[:2].gt(0).all() and counts[2:].sum() == 0


def test_filters_match_transformers_warpers():
    gen = torch.Generator().manual_seed(3)
    settings = [
        (0, 1.0, 0.0),
        (5, 1.0, 0.0),
        (0, 0.7, 0.0),
        (8, 0.9, 0.0),
        (0, 1.0, 0.2),
        (3, 0.5, 0.05),
        (VOCAB + 9, 0.3, 0.0),
    ]
    for top_k, top_p, min_p in settings:
        logits = torch.randn(1, VOCAB, generator=gen) * 2
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
        ours = logits.clone()
        if min_p:
            ours = MinPLogitsWarper(min_p)(None, ours)  # min_p comes first, as vLLM; checked below
        _apply_top_k_top_p(ours, [params])
        theirs = logits.clone()
        if min_p:
            theirs = MinPLogitsWarper(min_p)(None, theirs)
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        assert torch.equal(ours.isinf(), theirs.isinf()), (top_k, top_p, min_p)


def test_min_p_matches_transformers_through_the_sampler():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    counts = draw_counts(SamplingParams(temperature=1.0, min_p=0.1), logits, 3000)
    survivors = ~MinPLogitsWarper(0.1)(None, logits.unsqueeze(0)).isinf()[0]
    assert counts[~survivors].sum() == 0
    assert counts.gt(0).sum() >= min(int(survivors.sum()), 2)


# ---- penalties -----------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    """Greedy decoding over fixed per-step logits: our tokens and the Transformers loop agree."""
    prompt = [3, 7, 7, 11, 40]
    params = SamplingParams(repetition_penalty=penalty)
    sampler = Sampler(seed=0)
    sampler.add("a", params, prompt)
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    history = list(prompt)
    for step in range(12):
        logits = step_logits("a", step)
        ours, _ = sampler.sample(logits.unsqueeze(0), ["a"])
        processed = processor(torch.tensor([history]), logits.unsqueeze(0).clone())
        assert ours.item() == processed.argmax(-1).item()
        history.append(ours.item())
    # and the processed logits themselves, on a penalized batch of two
    other = Sampler(seed=0)
    other.add("x", params, prompt)
    other.add("y", SamplingParams(repetition_penalty=2.0), [0, 1])
    scores = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    ours = scores.clone()
    _apply_penalties(ours, [0, 1], [other._requests["x"], other._requests["y"]])
    assert torch.allclose(ours[0], processor(torch.tensor([prompt]), scores[:1].clone())[0])
    assert torch.allclose(
        ours[1],
        RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1]]), scores[1:].clone())[0],
    )


def test_presence_and_frequency_follow_the_openai_formula():
    presence, frequency = 0.8, 0.5
    sampler = Sampler(seed=0)
    sampler.add(
        "a", SamplingParams(presence_penalty=presence, frequency_penalty=frequency), [4, 4, 9]
    )
    outputs: list[int] = []
    for step in range(100):  # past the 64 ids a request's buffer starts with
        logits = step_logits("a", step) / 6
        expected = logits.clone()
        for token in set(outputs):  # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence
            expected[token] -= outputs.count(token) * frequency + presence
        token, _ = sampler.sample(logits.unsqueeze(0), ["a"])
        assert token.item() == expected.argmax().item()
        outputs.append(token.item())
    assert len(set(outputs)) > 1  # the penalties did push the argmax around
    assert sampler.output_ids("a") == outputs


def test_penalties_only_touch_their_rows():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(seed=0)
    sampler.add("plain", SamplingParams(), [int(logits[0].argmax())])
    sampler.add("pen", SamplingParams(repetition_penalty=100.0), [int(logits[1].argmax())])
    sampler.add("plain2", SamplingParams(), [])
    tokens, _ = sampler.sample(logits, ["plain", "pen", "plain2"])
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert tokens[1] != logits[1].argmax()


# ---- the seeded-draw contract --------------------------------------------------------------

SEEDED = {
    "s1": SamplingParams(temperature=0.9, seed=11),
    "s2": SamplingParams(temperature=1.3, seed=22, top_k=10, top_p=0.9, min_p=0.02),
    "s3": SamplingParams(
        temperature=0.7,
        seed=33,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    ),
}
OTHERS = {
    "u1": SamplingParams(temperature=1.0),
    "g1": SamplingParams(),
    "u2": SamplingParams(temperature=0.5, top_k=3, frequency_penalty=1.0),
    "s9": SamplingParams(temperature=1.1, seed=11),  # the same seed as s1: still its own generator
}


def run_steps(
    batches: list[list[str]], steps: int = 6, device: str = "cpu"
) -> dict[str, list[int]]:
    """Sample every step with each batch (a list of seq ids, in row order); tokens per seq."""
    sampler = Sampler(seed=99)
    every = {**SEEDED, **OTHERS}
    seqs = sorted({s for batch in batches for s in batch})
    for seq in seqs:
        sampler.add(seq, every[seq], [1, 2, 3])
    out: dict[str, list[int]] = {s: [] for s in seqs}
    for step in range(steps):
        for batch in batches:
            logits = torch.stack([step_logits(s, step) for s in batch]).to(device)
            tokens, _ = sampler.sample(logits, batch)
            for seq, token in zip(batch, tokens.tolist()):
                out[seq].append(token)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_draw_the_same_alone_batched_and_reordered(device):
    alone = {s: run_steps([[s]], device=device)[s] for s in SEEDED}
    everyone = list(SEEDED) + list(OTHERS)
    batched = run_steps([everyone], device=device)
    reordered = run_steps([everyone[::-1]], device=device)
    split = run_steps([["u1", "s3"], ["s2", "g1", "s1", "s9"], ["u2"]], device=device)
    for seq in SEEDED:
        assert alone[seq] == batched[seq] == reordered[seq] == split[seq], seq
    assert len(set(alone["s1"])) > 1  # the generator moved on between steps


@pytest.mark.parametrize("device", DEVICES)
def test_a_seeded_row_is_the_exponential_race_on_its_own_generator(device):
    """The contract spelled out: q ~ Exp(1) from Generator(seed), token = argmax(softmax(l/T) /
    q)."""
    params = SamplingParams(temperature=0.8, seed=2024)
    sampler = Sampler(seed=0)
    sampler.add("a", params, [])
    sampler.add("b", SamplingParams(temperature=1.0), [])
    reference = torch.Generator(device=device).manual_seed(2024)
    for step in range(8):
        logits = step_logits("a", step).to(device)
        both = torch.stack([step_logits("b", step).to(device), logits])
        tokens, _ = sampler.sample(both, ["b", "a"])
        q = torch.empty(VOCAB, device=device).exponential_(generator=reference)
        assert tokens[1].item() == (torch.softmax(logits / 0.8, -1) / q).argmax().item()


def test_unseeded_requests_get_fresh_randomness():
    logits = torch.zeros(1, VOCAB)
    draws = set()
    for _ in range(6):
        sampler = Sampler()
        sampler.add("a", SamplingParams(temperature=1.0), [])
        draws.add(sampler.sample(logits, ["a"])[0].item())
    assert len(draws) > 1


# ---- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_the_raw_logits(device):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)).to(
        device, torch.bfloat16
    )
    sampler = Sampler(seed=0)
    sampler.add(
        "a",
        SamplingParams(logprobs=5, repetition_penalty=1.5, temperature=2.0, seed=1),
        list(range(10)),
    )
    sampler.add("b", SamplingParams(), [])
    sampler.add("c", SamplingParams(logprobs=0), [])
    tokens, logprobs = sampler.sample(logits, ["a", "b", "c"])
    raw = logits.float().log_softmax(-1)
    a, b, c = logprobs
    assert b is None and isinstance(a, Logprobs) and isinstance(c, Logprobs)
    assert a.token_id == tokens[0].item() and math.isclose(
        a.logprob, raw[0, a.token_id].item(), abs_tol=1e-6
    )
    assert [i for i, _ in a.top] == raw[0].topk(5).indices.tolist()
    assert all(math.isclose(v, raw[0, i].item(), abs_tol=1e-6) for i, v in a.top)
    assert [v for _, v in a.top] == sorted((v for _, v in a.top), reverse=True)
    assert c.top == [] and c.token_id == tokens[2].item() == raw[2].argmax().item()
    assert math.isclose(c.logprob, raw[2].max().item(), abs_tol=1e-6)


def test_logprob_ties_break_by_lower_id():
    logits = torch.zeros(1, VOCAB)
    logits[0, [30, 4, 17, 9]] = 5.0
    sampler = Sampler(seed=0)
    sampler.add("a", SamplingParams(logprobs=6), [])
    _, (entry,) = sampler.sample(logits, ["a"])
    assert [i for i, _ in entry.top] == [4, 9, 17, 30, 0, 1]
    assert entry.token_id == 4  # argmax takes the first maximum too


# ---- bookkeeping ---------------------------------------------------------------------------


def test_add_remove_and_unknown_sequences():
    sampler = Sampler(seed=0)
    sampler.add("a", SamplingParams(), [])
    with pytest.raises(ValueError):
        sampler.add("a", SamplingParams(), [])
    with pytest.raises(KeyError, match="never added"):
        sampler.sample(torch.zeros(1, VOCAB), ["b"])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, VOCAB), ["a"])
    with pytest.raises(Refusal, match="top-p"):
        sampler.add("c", SamplingParams(top_p=0.0), [])
    sampler.remove("a")
    sampler.remove("a")  # removing twice is harmless: a finished request may be aborted too
    assert "a" not in sampler and len(sampler) == 0


# ---- check() -------------------------------------------------------------------------------

BAD = [
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -1),
    ("top_k", 2.0),
    ("min_p", 1.5),
    ("min_p", -0.01),
    ("seed", 2**64),
    ("seed", "7"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("logprobs", 21),
    ("logprobs", -1),
    ("stop", ("",)),
    ("stop", ("x",) * 17),
    ("stop", ("y" * 513,)),
    ("stop", (3,)),
    ("stop_token_ids", (-1,)),
    ("ignore_eos", "yes"),
    ("logits_of", (-1,)),
    ("logits_of", (1.0,)),
    ("logits_of", (0,) * 1025),
]


@pytest.mark.parametrize("field,value", BAD)
def test_check_refuses_in_one_line_naming_the_field(field, value):
    with pytest.raises(Refusal) as refused:
        SamplingParams(**{field: value}).check()
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"--{field.replace('_', '-')} ")
    with pytest.raises(Refusal, match=rf"^request\.{field} "):
        SamplingParams(**{field: value}).check(name=lambda f: f"request.{f}")


def test_check_accepts_the_edges():
    edges = SamplingParams(
        max_tokens=0,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        seed=-(2**63),
        stop=("a" * 512,) * 16,
        stop_token_ids=(0,),
        repetition_penalty=1e-3,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
        logits_of=(0,) * 1024,
    )
    assert edges.check() is edges
    assert SamplingParams(logits_of=[3, 4]).logits_of == (3, 4)  # JSON lists stand for tuples
    assert SamplingParams(stop="END", stop_token_ids=[5]).check() == SamplingParams(
        stop=("END",), stop_token_ids=(5,)
    )

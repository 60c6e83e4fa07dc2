"""Decisions: Ster's request refusals and rendering; probabilities equal to the softmax over letter
logits Transformers computes on the same renderings (read whole, no shared cache), read through the
token engine at one rank and at TP=2 on a real gloo group; the state served from the prefix cache
for every rendering after the first; every cyclic order cancels a letter bias planted in the head;
and `ster decide` end to end."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from ster_dist.cli import main
from ster_dist.decide.answer import log_softmax, probabilities, softmax
from ster_dist.decide.prompt import LABELS, orders, render
from ster_dist.decide.request import parse_request
from ster_dist.decide.run import decide, label_tokens, read, shared_prefix
from ster_dist.engine.loop import EngineConfig, TokenEngine
from ster_dist.errors import Refusal
from ster_dist.resolve import resolve
from ster_dist.steer.text import encode_prompt
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.tiny_models import BASE_CONFIG, TINY, perturb_norms
from tests.tiny_tokenizer import build_tiny_tokenizer

REQUEST = {
    "state": "My running shoes arrived in the wrong size. Can I swap them for a size 10?",
    "model": "ignored",
    "questions": {
        "department": {
            "type": "choice",
            "instructions": "Which team should handle this?",
            "criteria": {
                "shipping": "Delivery status",
                "returns": "Exchanges, refunds",
                "billing": None,
            },
        },
        "frustration": {
            "type": "score",
            "instructions": "How frustrated is the customer?",
            "criteria": ["Calm", "Frustrated but civil", {"level": "angry"}],
        },
        "is_urgent": {
            "type": "noul",
            "instructions": "Does this convey urgency?",
            "criteria": {"true": "needs an answer today"},
        },
    },
}


def quiet(*args, **kwargs):
    pass


def make_tiny(variant: str, directory, seed: int = 0):
    """tests/tiny_models' checkpoint with room for a decision's rendering: Ster's header alone is
    about a hundred tokens of the tiny tokenizer, past the 128 positions the shared sizes give."""
    import transformers

    config_cls, model_cls, kwargs = TINY[variant]
    config = getattr(transformers, config_cls)(
        **{**BASE_CONFIG, **kwargs, "max_position_embeddings": 512}
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    perturb_norms(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    build_tiny_tokenizer(directory)
    return model


def test_rendering_is_sters_byte_for_byte():
    request = parse_request(REQUEST)
    question = request.questions[0]
    assert [q.id for q in request.questions] == ["department", "frustration", "is_urgent"]
    assert question.options() == [
        "billing",
        "returns: Exchanges, refunds",
        "shipping: Delivery status",
    ]
    assert request.questions[2].options() == ["yes: needs an answer today", "no"]
    assert request.questions[1].options()[2] == '{\n  "level": "angry"\n}'
    assert (
        orders(3, 0) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
        and orders(3, 1) == [[0, 1, 2]]
        and len(orders(3, 9)) == 3
    )
    assert render(request, question, question.options(), [1, 2, 0]) == (
        "Decide the question below about the state. Reply with the letter of the one option that fits best.\n\n"
        "State:\nMy running shoes arrived in the wrong size. Can I swap them for a size 10?\n\n"
        "Question: Which team should handle this?\n\n"
        "Options:\nA. returns: Exchanges, refunds\nB. shipping: Delivery status\nC. billing\n\nAnswer:"
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(state="  "), "a decide request has an empty state"),
        (lambda r: r.update(questions={}), "a decide request needs at least one question"),
        (
            lambda r: r["questions"].update({" ": r["questions"].pop("is_urgent")}),
            "a decide request has a question with an empty id",
        ),
        (
            lambda r: r["questions"]["is_urgent"].update(instructions=""),
            "question 'is_urgent' has empty instructions",
        ),
        (
            lambda r: r["questions"]["department"].update(criteria={"a": None}),
            "choice question 'department' needs at least two options",
        ),
        (
            lambda r: r["questions"]["department"].update(
                criteria={chr(97 + i) * 2: None for i in range(27)}
            ),
            "choice question 'department' has 27 options; Ster labels at most 26",
        ),
        (
            lambda r: r["questions"]["department"].update(criteria={"": None, "b": None}),
            "choice question 'department' has an option with an empty name \"\"",
        ),
        (
            lambda r: r["questions"]["frustration"].update(criteria=["calm"]),
            "score question 'frustration' needs at least two levels",
        ),
        (
            lambda r: r["questions"]["frustration"].update(criteria=["calm", None, "x"]),
            "score question 'frustration' has an empty description at level 1",
        ),
        (
            lambda r: r["questions"]["is_urgent"].update(type="maybe"),
            "needs a type of choice, score or noul",
        ),
    ],
)
def test_request_refusals(edit, message):
    request = json.loads(json.dumps(REQUEST))
    edit(request)
    with pytest.raises(Refusal, match=message):
        parse_request(request, "req.json")


def test_every_cyclic_order_cancels_a_letter_bias_exactly():
    content = [0.3, -1.2, 2.0, 0.7]
    bias = [5.0, -2.0, 0.5, 3.0]  # by letter position
    rows = [[content[o] + bias[order.index(o)] for o in range(4)] for order in orders(4, 0)]
    assert probabilities(rows) == pytest.approx(softmax(content), abs=1e-12)
    single = [[content[o] + bias[o] for o in range(4)]]
    assert probabilities(single) != pytest.approx(softmax(content), abs=1e-3)


def test_shared_prefix_leaves_every_row_a_token():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert shared_prefix([[1, 2], [1, 2, 3]]) == 1


def engine_on(group, tokenizer, **config) -> TokenEngine:
    """A fresh token engine over a loaded group (its prefix cache empty); one per group at a
    time."""
    cfg = group.rank.loaded.cfg if isinstance(group, LocalGroup) else config.pop("cfg")
    return TokenEngine(
        group,
        cfg,
        tokenizer,
        cfg.eos_token_ids or (2,),
        EngineConfig(**{"kv_cache_memory": 8 << 20, **config}),
    )


def _renderings(tokenizer, request, permutations, mode):
    """Every rendering's tokens and letter spellings, in decide's order."""
    rows, labels = [], []
    for question in request.questions:
        options = question.options()
        for order in orders(len(options), permutations):
            rows.append(encode_prompt(tokenizer, render(request, question, options, order), mode))
            labels.append([label_tokens(tokenizer, LABELS[p]) for p in range(len(options))])
    return rows, labels


def _hf_probabilities(reference, tokenizer, request, permutations, mode):
    """Ster's arithmetic on Transformers' logits, every rendering read whole."""
    out = {}
    for question in request.questions:
        options = question.options()
        rows, per_order = [], []
        for order in orders(len(options), permutations):
            ids = encode_prompt(tokenizer, render(request, question, options, order), mode)
            with torch.no_grad():
                logits = reference(torch.tensor([ids])).logits[0, -1].double()
            letters = [
                float(torch.logsumexp(logits[label_tokens(tokenizer, LABELS[p])], 0))
                for p in range(len(options))
            ]
            canonical = [letters[order.index(o)] for o in range(len(options))]
            rows.append(canonical)
            per_order.append([math.exp(v) for v in log_softmax(canonical)])
        out[question.id] = (probabilities(rows), per_order)
    return out


def _probs(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"], 1 - answer["noul"]]
    probs = answer["probabilities"]
    return [probs[k] for k in sorted(probs, key=lambda k: int(k) if k.isdigit() else k)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    reference = make_tiny("llama", directory)
    group = LocalGroup()
    group.call("load", resolve(str(directory)), "f32", "cpu")
    yield directory, reference, Tokenizer.from_directory(directory), group
    group.close()


@pytest.mark.parametrize("permutations, mode", [(0, "auto"), (1, "auto"), (2, "off")])
def test_probabilities_equal_transformers_letter_softmax(llama, permutations, mode):
    _, reference, tokenizer, group = llama
    request = parse_request(REQUEST)
    cfg = group.rank.loaded.cfg
    # a small step budget: the renderings prefill in chunks and share steps
    with engine_on(group, tokenizer, max_step_tokens=48) as engine:
        result = decide(engine, tokenizer, cfg, request, permutations, mode, True, quiet)
    want = _hf_probabilities(reference, tokenizer, request, permutations, mode)
    for qid, answer in result["answers"].items():
        assert _probs(answer) == pytest.approx(want[qid][0], abs=1e-5), qid
        shown = [o["probabilities"] for o in result["explain"][qid]["orders"]]
        assert len(shown) == len(want[qid][1])
        for got, expected in zip(shown, want[qid][1]):
            assert got == pytest.approx(expected, abs=1e-5)
    department = result["answers"]["department"]
    assert department["choice"] == max(
        department["probabilities"], key=department["probabilities"].get
    )
    frustration = result["answers"]["frustration"]
    assert frustration["score"] == pytest.approx(
        sum(int(k) * p for k, p in frustration["probabilities"].items())
    )
    assert frustration["legend"]["2"] == '{\n  "level": "angry"\n}'
    usage = result["usage"]
    rows, _ = _renderings(tokenizer, request, permutations, mode)
    assert usage["output_tokens"] == 0 and usage["forward_passes"] == len(rows) == (
        8 if permutations == 0 else 3 if permutations == 1 else 6
    )
    assert usage["input_tokens"] < sum(len(r) for r in rows)  # the prefix cache served the state


def test_the_state_comes_from_the_prefix_cache_after_the_first_rendering(llama):
    """The first rendering is read alone, so every later one finds the shared prefix's whole blocks
    cached; the engine's counters and decide's usage agree on what was computed."""
    _, _, tokenizer, group = llama
    request = parse_request(REQUEST)
    rows, labels = _renderings(tokenizer, request, 0, "auto")
    block = 16
    aligned = shared_prefix(rows) // block * block
    assert aligned >= 4 * block  # the header and the state: several whole blocks
    with engine_on(group, tokenizer, block_size=block) as engine:
        readings = read(engine, rows, labels)
        stats = engine.stats()["kv_blocks"]
    cached = [finished.cached_tokens for _, finished in readings]
    assert cached[0] == 0 and all(c >= aligned for c in cached[1:]), cached
    assert stats["prefix_queries"] == sum(len(r) for r in rows) and stats["prefix_hits"] == sum(
        cached
    )
    with engine_on(group, tokenizer, block_size=block) as engine:
        usage = decide(engine, tokenizer, group.rank.loaded.cfg, request, 0, "auto", False, quiet)[
            "usage"
        ]
        stats = engine.stats()["kv_blocks"]
    assert stats["prefix_hits"] >= (len(rows) - 1) * aligned
    assert usage["input_tokens"] == stats["prefix_queries"] - stats["prefix_hits"]
    assert usage["forward_passes"] == len(rows)


def test_an_adapter_goes_to_decides_requests_only(llama):
    """An adapter registered with the engine reads as the same adapter attached to the whole model,
    leaves nothing attached, and its blocks are keyed apart from plain ones (no hits across)."""
    from ster_dist.adapters.attach import attach

    _, _, tokenizer, group = llama
    model, cfg = group.rank.loaded.model, group.rank.loaded.cfg
    g = torch.Generator().manual_seed(4)
    params = dict(model.named_parameters())
    sites = [
        {
            "param": f"layers.{layer}.attn.{proj}.weight",
            "a": torch.randn(4, cfg.hidden_size, generator=g) * 0.3,
            "b": torch.randn(params[f"layers.{layer}.attn.{proj}.weight"].shape[0], 4, generator=g)
            * 0.3,
            "scale": 1.0,
        }
        for layer in range(cfg.num_layers)
        for proj in ("q", "v")
    ]
    request = parse_request(REQUEST)
    with engine_on(group, tokenizer) as engine:
        plain = decide(engine, tokenizer, cfg, request, 0, "auto", False, quiet)
        engine.add_adapter("a", sites)
        adapted = decide(engine, tokenizer, cfg, request, 0, "auto", False, quiet, adapter="a")
    assert not any(getattr(m, "adapters", None) for m in model.modules())
    detach = attach(model, sites)
    try:
        with engine_on(group, tokenizer) as engine:
            whole = decide(engine, tokenizer, cfg, request, 0, "auto", False, quiet)
    finally:
        detach()
    # the plain blocks served none of it
    assert adapted["usage"] == whole["usage"] == plain["usage"]
    for qid in whole["answers"]:
        assert _probs(adapted["answers"][qid]) == pytest.approx(
            _probs(whole["answers"][qid]), abs=1e-7
        ), qid
    # the tiny model is near uniform over letters: the adapter moves it by about 1e-3
    assert any(
        _probs(adapted["answers"][q]) != pytest.approx(_probs(plain["answers"][q]), abs=1e-4)
        for q in plain["answers"]
    )


def test_a_question_past_the_context_is_refused(llama):
    _, _, tokenizer, group = llama
    request = parse_request({**REQUEST, "state": "word " * 600})
    with (
        engine_on(group, tokenizer) as engine,
        pytest.raises(
            Refusal, match=r"question 'department' renders to \d+ tokens, past the 512 this model"
        ),
    ):
        decide(engine, tokenizer, group.rank.loaded.cfg, request, 0, "off", False, quiet)


def test_permutations_cancel_a_letter_bias_planted_in_the_head(tmp_path):
    """Phi's head has a bias: add 6 to every spelling of "A" and the single-order answer follows the
    letter, while the all-orders answer equals the unbiased model's."""
    plain_dir, biased_dir = tmp_path / "plain", tmp_path / "biased"
    reference = make_tiny("phi", plain_dir)
    tokenizer = Tokenizer.from_directory(plain_dir)
    with torch.no_grad():
        reference.lm_head.bias[label_tokens(tokenizer, "A")] += 6.0
    reference.save_pretrained(biased_dir, safe_serialization=True)
    build_tiny_tokenizer(biased_dir)
    request = parse_request(REQUEST)
    answers = {}
    for name, directory in (("plain", plain_dir), ("biased", biased_dir)):
        with LocalGroup() as group:
            group.call("load", resolve(str(directory)), "f32", "cpu")
            cfg = group.rank.loaded.cfg
            with engine_on(group, tokenizer) as engine:
                for permutations in (0, 1):
                    answers[name, permutations] = decide(
                        engine, tokenizer, cfg, request, permutations, "auto", False, quiet
                    )["answers"]
    for qid in answers["plain", 0]:
        unbiased = _probs(answers["plain", 0][qid])
        assert _probs(answers["biased", 0][qid]) == pytest.approx(unbiased, abs=1e-6), qid
        # one order: the option shown under A (canonical option 0) takes the mass
        assert _probs(answers["biased", 1][qid])[0] > 0.9 > _probs(answers["plain", 1][qid])[0]


def test_decide_at_tp2_equals_one_rank(llama):
    directory, _, tokenizer, local = llama
    request = parse_request(REQUEST)
    cfg = local.rank.loaded.cfg
    with engine_on(local, tokenizer) as engine:
        want = decide(engine, tokenizer, cfg, request, 0, "auto", False, quiet)
    with SpawnGroup(2) as group:
        group.call("load", resolve(str(directory)), "f32", "cpu")
        with engine_on(group, tokenizer, cfg=cfg) as engine:
            got = decide(engine, tokenizer, cfg, request, 0, "auto", False, quiet)
    assert got["usage"] == want["usage"]
    for qid in want["answers"]:
        assert _probs(got["answers"][qid]) == pytest.approx(_probs(want["answers"][qid]), abs=1e-6)


def test_decide_cli_prints_and_writes_the_response(llama, tmp_path, capsys, monkeypatch):
    directory = llama[0]
    request = tmp_path / "req.json"
    request.write_text(json.dumps(REQUEST))
    output = tmp_path / "out" / "answer.json"
    code = main(
        [
            "decide",
            "--model",
            str(directory),
            "--request",
            str(request),
            "--output",
            str(output),
            "--permutations",
            "1",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    response = json.loads(out)
    assert json.loads(output.read_text()) == response
    assert list(response) == [
        "model",
        "revision",
        "chat_template",
        "precision",
        "temperature",
        "calibration",
        "permutations",
        "answers",
        "usage",
    ]
    assert response["chat_template"] == "applied" and response["permutations"] == 1
    assert "reading the state once" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({**REQUEST, "state": ""})))
    code = main(["decide", "--model", str(directory), "--request", "-"])
    assert code == 2 and "a decide request has an empty state" in capsys.readouterr().err
    code = main(["decide", "--model", str(directory), "--request", str(tmp_path / "missing.json")])
    assert code == 2 and "failed to read" in capsys.readouterr().err

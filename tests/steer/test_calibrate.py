"""Calibration (`ster calibrate`, `ster decide --calibration`): the fitted temperature equals a
brute-force grid minimisation of the NLL computed here from decide's own raw scores; accuracy is
unchanged by scaling; the control metrics are those of the held-out items; decide's calibrated
probabilities equal softmax(logits / T) over its raw scores; the same fit at TP=2 and at EP=2 on a
tiny MoE as at one rank; the fit as a job through the job queue; and every refusal, each before
any weight is read."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from ster_dist.cli import main
from ster_dist.decide import calibration, temperature
from ster_dist.decide.answer import log_softmax, softmax
from ster_dist.decide.calibrate import calibrate
from ster_dist.decide.labelled import load_labelled, split
from ster_dist.decide.request import parse_request
from ster_dist.decide.run import decide
from ster_dist.errors import Refusal
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.steer.test_decide import REQUEST, engine_on, make_tiny

ITEMS = 10  # every 5th held out: 8 items (24 decisions) fit, 2 (6 decisions) check
GRID = 60001  # log T from -3 to 3 in steps of 1e-4
# the tiny model is near uniform over letters; a larger head spreads its options
HEAD_SCALE = 1000.0


def quiet(*args, **kwargs):
    pass


def tiny_decider(variant: str, directory):
    """A tiny checkpoint whose head is scaled up, so its decisions are not all a coin toss and the
    best temperature lies inside e^-3..e^3 rather than at an end."""
    model = make_tiny(variant, directory)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    model.save_pretrained(directory, safe_serialization=True)
    return Tokenizer.from_directory(directory)


def item_request(i: int) -> dict:
    request = json.loads(json.dumps(REQUEST))  # a copy: edits must not reach test_decide's request
    request["state"] = f"Ticket {i}, from customer {i * 7 % 11}: " + REQUEST["state"]
    return request


def logits_of(explained: dict) -> list[float]:
    """A question's logits from decide's raw scores: its orders' log-probabilities averaged."""
    orders = [o["probabilities"] for o in explained["orders"]]
    return [sum(math.log(p[i]) for p in orders) / len(orders) for i in range(len(orders[0]))]


def label_value(question, index: int):
    if question.type == "choice":
        return question.names()[index]
    return index if question.type == "score" else index == 0


def probs_of(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["noul"], 1 - answer["noul"]]
    probs = answer["probabilities"]
    return [probs[k] for k in sorted(probs, key=lambda k: int(k) if k.isdigit() else k)]


def brute_force(decisions: list[tuple[list[float], int]]) -> tuple[float, float]:
    """(log T, NLL) at the grid point with the least mean NLL."""
    u = torch.linspace(*temperature.LOG_T_BOUNDS, GRID, dtype=torch.float64)
    beta = torch.exp(-u)[:, None, None]
    total = torch.zeros_like(u)
    for width in {len(z) for z, _ in decisions}:  # decisions of one option count in one product
        same = [(z, y) for z, y in decisions if len(z) == width]
        # [grid, decisions, options]
        scaled = beta * torch.tensor([z for z, _ in same], dtype=torch.float64)[None]
        labels = torch.tensor([y for _, y in same])
        total += (torch.logsumexp(scaled, 2) - scaled[:, torch.arange(len(same)), labels]).sum(1)
    best = int(torch.argmin(total))
    return float(u[best]), float(total[best]) / len(decisions)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The model, its raw decisions per item (read by decide at T=1 with --explain) and the labelled
    file: most labels the model's own choice, every third the runner-up, so it is neither always
    right nor always wrong."""
    root = tmp_path_factory.mktemp("calibrate")
    directory = root / "llama"
    tokenizer = tiny_decider("llama", directory)
    group = LocalGroup()
    group.call("load", resolve(str(directory)), "f32", "cpu")
    raw, lines = [], []
    with engine_on(group, tokenizer) as engine:
        for i in range(ITEMS):
            request = parse_request(item_request(i))
            result = decide(
                engine, tokenizer, group.rank.loaded.cfg, request, 0, "auto", True, quiet
            )
            labels, decisions = {}, []
            for j, question in enumerate(request.questions):
                logits = logits_of(result["explain"][question.id])
                ranked = sorted(range(len(logits)), key=lambda k: -logits[k])
                index = ranked[1] if (i + j) % 3 == 0 else ranked[0]
                labels[question.id] = label_value(question, index)
                decisions.append((logits, index))
            raw.append(decisions)
            lines.append(json.dumps({**item_request(i), "labels": labels}))
    labelled = root / "labelled.jsonl"
    labelled.write_text("\n".join(lines) + "\n")
    yield {
        "dir": directory,
        "tokenizer": tokenizer,
        "group": group,
        "raw": raw,
        "labelled": labelled,
        "root": root,
    }
    group.close()


@pytest.fixture(scope="module")
def fitted(llama):
    """`ster calibrate` on the command line: its printed result and the artifact it wrote."""
    output = llama["root"] / "out" / "calibration.json"
    code = main(
        [
            "calibrate",
            "--model",
            str(llama["dir"]),
            "--decisions",
            str(llama["labelled"]),
            "--output",
            str(output),
        ]
    )
    assert code == 0
    return json.loads(output.read_text())


def split_raw(raw: list) -> tuple[list, list]:
    fit = [d for i, item in enumerate(raw, 1) if i % 5 for d in item]
    held = [d for i, item in enumerate(raw, 1) if not i % 5 for d in item]
    return fit, held


# -- the arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed, sharpness", [(0, 0.4), (1, 1.0), (2, 3.0), (3, 12.0), (4, 0.02)])
def test_golden_section_equals_a_brute_force_grid_on_made_up_decisions(seed, sharpness):
    """Labels drawn from softmax(sharpness * logits): the best T is about 1 / sharpness, inside the
    range or (0.02: far too flat a model) beyond it, where both searches stop at the bound."""
    g = torch.Generator().manual_seed(seed)
    decisions = []
    for n in range(60):
        logits = (torch.randn(2 + n % 4, generator=g, dtype=torch.float64) * 2).tolist()
        label = int(torch.multinomial(torch.tensor(softmax(logits, 1 / sharpness)), 1, generator=g))
        decisions.append((logits, label))
    fit = temperature.fit([temperature.Decision(z, y) for z, y in decisions])
    best_u, best_nll = brute_force(decisions)
    assert fit.log_temperature == pytest.approx(best_u, abs=1e-4 + temperature.TOLERANCE)
    assert (
        temperature.nll([temperature.Decision(z, y) for z, y in decisions], fit.temperature)
        <= best_nll + 1e-12
    )
    assert fit.steps <= 40 and fit.at_bound == (sharpness == 0.02)
    before = temperature.metrics([temperature.Decision(z, y) for z, y in decisions], 1.0)
    after = temperature.metrics([temperature.Decision(z, y) for z, y in decisions], fit.temperature)
    assert after["accuracy"] == before["accuracy"] and after["nll"] <= before["nll"]


def test_metrics_by_hand():
    decisions = [
        temperature.Decision([math.log(0.7), math.log(0.3)], 0),
        temperature.Decision([math.log(0.2), math.log(0.8)], 0),
    ]
    m = temperature.metrics(decisions)
    assert m["accuracy"] == 0.5 and m["decisions"] == 2
    assert m["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.2)) / 2)
    assert m["brier"] == pytest.approx(((0.3**2 + 0.3**2) + (0.8**2 + 0.8**2)) / 2)
    # 0.7 falls in bin (0.667, 0.733], 0.8 in (0.733, 0.8]: |1 - 0.7| and |0 - 0.8|, each half the
    # weight
    assert m["ece"] == pytest.approx((0.3 + 0.8) / 2)


# -- the fit on a real model ---------------------------------------------------------------------


def test_the_fitted_temperature_is_the_brute_force_minimum_of_decides_own_scores(llama, fitted):
    fit, held = split_raw(llama["raw"])
    best_u, _ = brute_force(fit)
    assert fitted["format"] == "ster-calibration/1" and fitted["model"] == str(llama["dir"])
    # a real minimum, not a clipped one
    assert not fitted["search"]["at_bound"] and -2.9 < best_u < 2.9
    assert fitted["log_temperature"] == pytest.approx(best_u, abs=1e-4 + temperature.TOLERANCE)
    assert fitted["temperature"] == pytest.approx(math.exp(fitted["log_temperature"]))
    assert (
        fitted["items"] == {"fit": 8, "control": 2} and fitted["control_from"] == "every 5th item"
    )
    assert (
        fitted["before"]["decisions"] == len(fit) == 24
        and fitted["control"]["after"]["decisions"] == 6
    )
    # scaling never moves an argmax: accuracy is the same on both splits, NLL falls where it was
    # fitted
    right = sum(max(range(len(z)), key=lambda k: z[k]) == y for z, y in fit)
    assert (
        fitted["after"]["accuracy"]
        == fitted["before"]["accuracy"]
        == pytest.approx(right / len(fit))
    )
    assert fitted["control"]["after"]["accuracy"] == fitted["control"]["before"]["accuracy"]
    assert fitted["after"]["nll"] < fitted["before"]["nll"]
    t = fitted["temperature"]
    for name, decisions in (("after", fit), ("control", held)):
        want = -sum(log_softmax(z, t)[y] for z, y in decisions) / len(decisions)
        got = fitted[name]["nll"] if name == "after" else fitted["control"]["after"]["nll"]
        assert got == pytest.approx(want, rel=1e-6)
    assert fitted["ece_bins"] == temperature.ECE_BINS and fitted["chat_template"] == "applied"


def test_decide_with_the_calibration_scales_decides_raw_scores(llama, fitted, tmp_path, capsys):
    request = tmp_path / "req.json"
    request.write_text(json.dumps(item_request(3)))
    artifact = llama["root"] / "out" / "calibration.json"
    capsys.readouterr()
    code = main(
        [
            "decide",
            "--model",
            str(llama["dir"]),
            "--request",
            str(request),
            "--explain",
            "--calibration",
            str(artifact),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    response = json.loads(out)
    assert response["temperature"] == fitted["temperature"] and response["calibration"] == str(
        artifact
    )
    for qid, answer in response["answers"].items():
        logits = logits_of(response["explain"][qid])  # explain's per-order probabilities stay raw
        assert probs_of(answer) == pytest.approx(
            softmax(logits, fitted["temperature"]), abs=1e-9
        ), qid
        assert probs_of(answer) != pytest.approx(softmax(logits), abs=1e-3)


def test_tp2_fits_what_one_rank_fits(llama):
    items = load_labelled(str(llama["labelled"]), "--decisions")
    fit_items, held, _ = split(items, None, 5, "labelled", "--control")
    cfg = llama["group"].rank.loaded.cfg
    with engine_on(llama["group"], llama["tokenizer"]) as engine:
        one = calibrate(engine, llama["tokenizer"], cfg, fit_items, held, 1, "auto", quiet)
    with SpawnGroup(2) as group:
        group.call("load", resolve(str(llama["dir"])), "f32", "cpu")
        with engine_on(group, llama["tokenizer"], cfg=cfg) as engine:
            tp2 = calibrate(engine, llama["tokenizer"], cfg, fit_items, held, 1, "auto", quiet)
    assert tp2["temperature"] == pytest.approx(one["temperature"], rel=1e-4)
    for name in ("before", "after"):
        assert tp2[name]["accuracy"] == one[name]["accuracy"]
        assert tp2[name]["nll"] == pytest.approx(one[name]["nll"], rel=1e-5)
    assert tp2["control"]["after"]["nll"] == pytest.approx(one["control"]["after"]["nll"], rel=1e-4)


def test_calibrate_as_a_job_through_the_queue_writes_what_the_command_line_writes(llama, fitted):
    from ster_dist.api import Engine

    output = llama["root"] / "queued" / "calibration.json"
    with Engine(str(llama["dir"])) as engine:
        queued = engine.calibrate(decisions=str(llama["labelled"]), output=str(output))
    assert queued["temperature"] == fitted["temperature"] and queued["output"] == str(output)
    assert json.loads(output.read_text()) == fitted


@pytest.mark.slow  # a MoE checkpoint of its own and two spawned ranks: about 40 s on two busy cores
def test_ep2_on_a_tiny_moe_fits_what_one_rank_fits(tmp_path, llama):
    directory = tmp_path / "mixtral"
    tokenizer = tiny_decider("mixtral", directory)
    # labels made for another model: still a fit
    items = load_labelled(str(llama["labelled"]), "--decisions")
    fit_items, held, _ = split(items, None, 5, "labelled", "--control")
    results = []
    with LocalGroup() as local:
        local.call("load", resolve(str(directory)), "f32", "cpu")
        cfg = local.rank.loaded.cfg
        with engine_on(local, tokenizer) as engine:
            results.append(calibrate(engine, tokenizer, cfg, fit_items, held, 1, "auto", quiet))
    with SpawnGroup(2, ep=2) as group:
        group.call("load", resolve(str(directory)), "f32", "cpu")
        with engine_on(group, tokenizer, cfg=cfg) as engine:
            results.append(calibrate(engine, tokenizer, cfg, fit_items, held, 1, "auto", quiet))
    one, ep2 = results
    assert ep2["temperature"] == pytest.approx(one["temperature"], rel=1e-4)
    for split_name in ("before", "after"):
        assert ep2[split_name]["nll"] == pytest.approx(one[split_name]["nll"], rel=1e-5)
        assert ep2[split_name]["accuracy"] == one[split_name]["accuracy"]


# -- refusals ------------------------------------------------------------------------------------


def good_items(n: int = 10) -> list[dict]:
    return [
        {
            **item_request(i),
            "labels": {"department": "returns", "frustration": 1, "is_urgent": False},
        }
        for i in range(n)
    ]


def write_jsonl(path, items) -> str:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return str(path)


def _label(i, qid, value):
    def edit(items):
        items[i]["labels"][qid] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda items: items.clear(),
            r"--decisions \S+ is empty: write one decide request with its labels per line",
        ),
        (lambda items: items[2].pop("labels"), r"line 3 has no labels: add \"labels\""),
        (
            lambda items: items[1]["labels"].pop("frustration"),
            r"line 2: question 'frustration' has no label",
        ),
        (
            _label(0, "department", "refunds"),
            r"label \"refunds\" of question 'department' is not among its options \(billing, returns, shipping\)",
        ),
        (
            _label(0, "frustration", 3),
            r"label 3 of score question 'frustration' is not among its levels; .* 0 to 2",
        ),
        (
            _label(0, "is_urgent", "yes"),
            r"label \"yes\" of noul question 'is_urgent' is not among its options",
        ),
        (
            _label(4, "sarcasm", True),
            r"line 5: labels name question 'sarcasm', which it does not ask",
        ),
        (
            lambda items: items[0]["questions"]["frustration"].update(
                criteria=["calm", "angry", "calm"]
            ),
            r"score question 'frustration' lists the level \"calm\" twice",
        ),
        (lambda items: items[0].update(state=""), r"a decide request has an empty state"),
        (lambda items: items.append("just text"), r"line 11 is not a decide request with labels"),
        (
            lambda items: items.__delitem__(slice(3, None)),
            r"has 3 items, so holding out every 5th leaves no control",
        ),
        (
            lambda items: items.__delitem__(slice(2, None)),
            r"has 6 labelled decisions, 6 once every 5th item is held out as the control; calibration fits on at least 8",
        ),
    ],
)
def test_labelled_file_refusals(tmp_path, edit, message):
    items = good_items()
    edit(items)
    path = write_jsonl(tmp_path / "labelled.jsonl", items)
    with pytest.raises(Refusal, match=message):
        split(load_labelled(path, "--decisions"), None, 5, path, "--control")


def test_a_repeated_option_and_broken_json_are_refused(tmp_path):
    path = tmp_path / "labelled.jsonl"
    line = json.dumps(good_items(1)[0]).replace(
        '"billing": null', '"billing": null, "billing": "twice"'
    )
    path.write_text(line + "\n")
    with pytest.raises(
        Refusal, match=r"line 1 repeats the key \"billing\" in one object .* keep one"
    ):
        load_labelled(str(path), "--decisions")
    path.write_text("[" + json.dumps(good_items(1)[0]) + ",]")
    with pytest.raises(Refusal, match=r"--decisions \S+ is not JSON"):
        load_labelled(str(path), "--decisions")
    path.write_text(json.dumps(good_items(12)))  # a JSON array reads as the lines do
    assert len(load_labelled(str(path), "--decisions")) == 12


def test_command_line_refusals_come_before_any_weight(tmp_path, capsys):
    """The model directory is empty: every refusal below is reached before anything reads it."""
    # an empty directory: a path that names nothing is refused first, as a misspelling (resolve.py)
    (tmp_path / "no-model").mkdir()
    model = str(tmp_path / "no-model")
    good = write_jsonl(tmp_path / "good.jsonl", good_items(12))
    bad = write_jsonl(
        tmp_path / "bad.jsonl", good_items(12)[:-1] + [{**good_items(1)[0], "labels": {}}]
    )
    out = str(tmp_path / "cal.json")
    cases = [
        (["--decisions", bad, "--output", out], "line 12 has no labels"),
        (
            ["--decisions", good, "--output", out, "--control", good, "--control-every", "3"],
            "--control-every holds items of --decisions out, and --control gives the control instead",
        ),
        (
            ["--decisions", good, "--output", out, "--control-every", "1"],
            "--control-every must be 2 or more",
        ),
        (
            ["--decisions", "-", "--output", out],
            "--decisions is '-', but labelled decisions are read from a file",
        ),
        (["--decisions", good, "--output", good], "--output .* is an input"),
        (
            ["--decisions", good, "--output", out, "--control", bad],
            "--control .* line 12 has no labels",
        ),
    ]
    for argv, message in cases:
        code = main(["calibrate", "--model", model, *argv])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err), (message, err)


def artifact(**changes) -> dict:
    base = {
        "format": "ster-calibration/1",
        "product": "ster",
        "model": "MODEL",
        "model_revision": None,
        "precision": "f32",
        "chat_template": "applied",
        "permutations": 0,
        "temperature": 0.5,
    }
    return {**base, **changes}


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model": "someone/else"},
            r'was fitted for model "someone/else", current model is ".*": load the model',
        ),
        ({"format": "ster-steering/1"}, r'has format "ster-steering/1", not ster-calibration/1'),
        (
            {"format": "ster-calibration/2"},
            r"is ster-calibration/2; this build reads ster-calibration/1 only",
        ),
        ({"temperature": 25.0}, r"has temperature 25.0, outside the e\^-3..e\^3 \(0.0498..20.09\)"),
        ({"temperature": 0.01}, r"has temperature 0.01, outside"),
        ({"temperature": "hot"}, r"has temperature \"hot\", not a finite number"),
        ({"format": None}, r"is not a Ster calibration artifact"),
    ],
)
def test_decide_refuses_a_calibration_before_any_weight(llama, tmp_path, capsys, changes, message):
    request = tmp_path / "req.json"
    request.write_text(json.dumps(REQUEST))
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(artifact(**{"model": str(llama["dir"]), **changes})))
    capsys.readouterr()
    code = main(
        [
            "decide",
            "--model",
            str(llama["dir"]),
            "--request",
            str(request),
            "--calibration",
            str(path),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err), err
    assert "loading" not in err
    path.write_text("{not json")
    assert (
        main(
            [
                "decide",
                "--model",
                str(llama["dir"]),
                "--request",
                str(request),
                "--calibration",
                str(path),
            ]
        )
        == 2
    )
    assert "is not JSON" in capsys.readouterr().err


def test_the_artifact_is_written_whole_and_reads_back(tmp_path):
    path = tmp_path / "a" / "cal.json"
    calibration.save(artifact(), str(path))
    assert calibration.load(str(path), "--calibration") == artifact()
    with pytest.raises(Refusal, match="outside"):
        calibration.save(artifact(temperature=100.0), str(tmp_path / "b.json"))
    assert not (tmp_path / "b.json").exists()
    assert calibration.warnings(artifact(), "bf16", "applied", 0) == [
        (
            "warning: this temperature was fitted with precision f32 and this run reads decisions with bf16, so its "
            "probabilities are scaled by a fit made on other numbers"
        )
    ]

"""Ster's files read and written exactly: the steering artifact (the docs' own document, byte for
byte), the activation artifact `extract --format ster-json` writes (against Transformers' hidden
states), Ster's example pair and prompt sets, and an artifact matched to its model by its
weights."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.steer.artifact import load_artifact
from ster_dist.steer.pairs import load_pairs, load_prompts
from ster_dist.steer.ster_json import F32, dumps, format_float
from ster_dist.tokenizer import Tokenizer
from ster_dist.load.toy import make_toy_model
from tests.steer.test_capture import hf_residual
from tests.tiny_models import make_tiny

DOCS = Path(__file__).parents[1] / "data" / "ster_docs"


def _run(capsys, *argv) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_the_docs_steering_artifact_reads_and_writes_back_byte_for_byte(tmp_path):
    document = json.loads((DOCS / "steering-artifact.json").read_text())
    artifact = load_artifact(str(DOCS / "steering-artifact.json"))
    assert artifact.vectors[0].layer == 2 and artifact.metadata == {} and artifact.precision is None
    out = tmp_path / "calm.ster.json"
    artifact.save(out)
    # Ster's compact serde text of that document, with 0.14's newer fields after metadata
    want = json.dumps({**document, "precision": None, "chat_template": None}, separators=(",", ":"))
    assert out.read_text() == want
    assert '"values":[0.14712493,0.16871634,-0.061927322]' in want  # the f32 digits the docs show


@pytest.mark.parametrize(
    "bits",
    [
        0x3E16A7F0,
        0x3F800000,
        0x33D6BF95,
        0x7F7FFFFF,
        0x00000001,
        0xBD7DA6A5,
        0x4B189680,
        0x358637BD,
    ],
)
def test_f32_text_is_the_shortest_that_reads_back_as_ryu_formats_it(bits):
    value = struct.unpack("<f", struct.pack("<I", bits))[0]
    text = format_float(value, single=True)
    assert (
        struct.unpack("<f", struct.pack("<f", float(text)))[0] == value
    )  # reads back to the same f32
    assert (
        "+" not in text and "e-0" not in text and len(text.replace("-", "").replace(".", "")) <= 12
    )
    # Ryu: plain decimal from 1e-6 up to below 1e13, an exponent past that, `.0` on integral values
    assert {
        0x3F800000: "1.0",
        0x4B189680: "10000000.0",
        0x358637BD: "0.000001",
        0x33D6BF95: "1e-7",
        0x7F7FFFFF: "3.4028235e38",
        0x00000001: "1e-45",
    }.get(bits, text) == text


def test_compact_and_pretty_text_is_serde_json(tmp_path):
    value = {"a": [F32(0.1), 1, None, "é\n"], "b": {}, "c": [], "d": 0.00001}
    assert dumps(value) == '{"a":[0.1,1,null,"é\\n"],"b":{},"c":[],"d":0.00001}'
    assert dumps(value, pretty=True) == json.dumps(value, indent=2, ensure_ascii=False).replace(
        "1e-05", "0.00001"
    )


def test_the_docs_pair_and_prompt_sets_read():
    pairs = load_pairs(str(DOCS / "pairs.json"))
    assert pairs.trait_name == "calm" and len(pairs.pairs) == 8
    assert pairs.positives[0] == "the sea is calm and quiet tonight ."
    assert (
        load_prompts(str(DOCS / "prompts.json"))[1]
        == "thunder rolls loud over the harbor tonight ."
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        ("NaN", "layer 2 contains a non-finite value"),
        ("Infinity", "layer 2 contains a non-finite value"),
    ],
)
def test_non_finite_values_are_refused_on_read(tmp_path, edit, message):
    text = (DOCS / "steering-artifact.json").read_text().replace("0.16871634", edit)
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(Refusal, match=message):
        load_artifact(str(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama_ster_json")
    return directory, make_tiny("llama", directory)


def test_extract_ster_json_writes_the_activation_artifact(llama, tmp_path, capsys):
    directory, reference = llama
    out = tmp_path / "acts.json"
    code, result, err = _run(
        capsys,
        "extract",
        "--model",
        directory,
        "--input",
        DOCS / "prompts.json",
        "--output",
        out,
        "--layers",
        "0,1",
        "--format",
        "ster-json",
        "--chat-template",
        "off",
    )
    assert code == 0, err
    text = out.read_text()
    document = json.loads(text)
    assert list(document) == [
        "schema_version",
        "product",
        "model",
        "model_revision",
        "hidden_size",
        "records",
    ]
    assert (
        document["product"] == "ster"
        and document["model"] == str(directory)
        and result["format"] == "ster-json"
    )
    prompts = load_prompts(str(DOCS / "prompts.json"))
    assert [r["prompt"] for r in document["records"]] == prompts
    tokenizer = Tokenizer.from_directory(directory)
    for record, prompt in zip(document["records"], prompts):
        assert list(record["layers"]) == ["0", "1"]
        want = hf_residual(reference, tokenizer.encode(prompt))
        for layer, values in record["layers"].items():
            assert len(values) == document["hidden_size"]
            assert torch.allclose(torch.tensor(values), want[int(layer)][-1], rtol=1e-4, atol=1e-4)
    assert (
        dumps(json.loads(text, parse_float=lambda s: F32(float(s)))) == text
    )  # f32 digits, compact


def test_extract_ster_json_refuses_every_position(llama, tmp_path, capsys):
    directory, _ = llama
    code, _, err = _run(
        capsys,
        "extract",
        "--model",
        directory,
        "--input",
        DOCS / "prompts.json",
        "--output",
        tmp_path / "a.json",
        "--format",
        "ster-json",
        "--positions",
        "all",
    )
    assert code == 2 and "ster-json holds the final token of each prompt only" in err


def test_an_artifact_is_matched_to_its_model_by_the_weights_not_the_path(tmp_path, capsys):
    """A copy of the weights elsewhere is the same model; another model at the same path is not."""
    model = tmp_path / "model"
    make_toy_model(model, layers=2, hidden=64, seed=0)
    vector = tmp_path / "calm.ster.json"
    code, _, err = _run(
        capsys,
        "vector",
        "train",
        "--model",
        model,
        "--pairs",
        DOCS / "pairs.json",
        "--layers",
        "1",
        "--output",
        vector,
    )
    assert code == 0, err
    assert json.loads(vector.read_text())["metadata"]["weights_fingerprint"].startswith("sha256:")
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    evaluate = ("vector", "evaluate", "--pairs", DOCS / "pairs.json", "--vector", vector)
    code, report, err = _run(capsys, *evaluate, "--model", moved)
    assert code == 0, err  # another path, the same weights
    shutil.rmtree(model)
    # another model (one more layer) at the same path
    make_toy_model(model, layers=3, hidden=64, seed=1)
    code, _, err = _run(capsys, *evaluate, "--model", model)
    assert code == 2 and "artifact was trained for model" in err

"""Bad input is refused before any weight is read: every case runs against a model directory whose
weights file is empty (unreadable), so a refusal that names the input proves the input was checked
first; a load would have failed on the weights instead."""

from __future__ import annotations

import json
import shutil

import pytest

from ster_dist.cli import main
from ster_dist.load.toy import make_toy_model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    toy = root / "toy"
    make_toy_model(toy, layers=2, hidden=64, seed=0)
    model = root / "no-weights"
    model.mkdir()
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        shutil.copy(toy / name, model / name)
    (model / "model.safetensors").write_bytes(b"")
    (root / "not-json.json").write_text("prompts: [oops")
    (root / "prompts.json").write_text(json.dumps({"prompts": ["a"]}))
    (root / "outdir").mkdir()
    return root


CASES = [
    (["generate", "--prompts", "{root}/not-json.json", "--output", "{root}/a.json"], "is not JSON"),
    (["generate", "--prompts", "{root}/missing.json", "--output", "{root}/a.json"], "--prompts"),
    (["generate", "--prompt", "x", "--system", "{root}/missing.txt"], "--system"),
    (
        ["generate", "--prompt", "x", "--vector", "{root}/missing.json", "--strength", "1"],
        "missing.json",
    ),
    (["generate", "--prompt", "x", "--vector", "{root}/missing.json"], "--vector needs --strength"),
    (
        ["generate", "--prompts", "{root}/prompts.json", "--output", "{root}/outdir"],
        "is a directory",
    ),
    (["generate", "--prompt", "x", "--adapter", "{root}/missing-adapter"], "missing-adapter"),
    (
        ["extract", "--input", "{root}/missing.json", "--output", "{root}/h.safetensors"],
        "missing.json",
    ),
    (["extract", "--input", "{root}/prompts.json", "--output", "{root}/outdir"], "is a directory"),
    (
        ["steer", "train", "--pairs", "{root}/missing.json", "--output", "{root}/v.json"],
        "missing.json",
    ),
    (
        ["steer", "train", "--pairs", "{root}/prompts.json", "--output", "{root}/outdir"],
        "is a directory",
    ),
    (["decide", "--request", "{root}/missing.json"], "missing.json"),
    (["decide", "--request", "{root}/prompts.json", "--output", "{root}/outdir"], "is a directory"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_refused_before_the_weights(files, capsys, argv, message):
    argv = [a.format(root=files) for a in argv]
    command = argv[:2] if argv[0] == "steer" else argv[:1]
    code = main([*command, "--model", str(files / "no-weights"), *argv[len(command) :]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert message in err[-1] and "model.safetensors" not in err[-1], err[-1]
    assert not any("loading" in line for line in err), err  # no load was started


# Issue 19: no command writes over what it reads (extract --output MODEL/model.safetensors replaced
# the weights)
OVERWRITES = [
    (
        ["extract", "--input", "{root}/prompts.json", "--output", "{model}/model.safetensors"],
        "--output {model}/model.safetensors is the model's own file (--model {model}); write somewhere else",
    ),
    (
        ["extract", "--input", "{root}/prompts.json", "--output", "{root}/prompts.json"],
        "--output {root}/prompts.json is an input (--input {root}/prompts.json); write somewhere else",
    ),
    (
        [
            "steer",
            "train",
            "--pairs",
            "{root}/prompts.json",
            "--output",
            "{model}/model.safetensors",
        ],
        "--output {model}/model.safetensors is the model's own file (--model {model})",
    ),
    (
        ["steer", "train", "--pairs", "{root}/prompts.json", "--output", "{root}/prompts.json"],
        "is an input (--pairs {root}/prompts.json)",
    ),
    (
        ["decide", "--request", "{root}/prompts.json", "--output", "{model}/model.safetensors"],
        "is the model's own file (--model {model})",
    ),
    (
        ["decide", "--request", "{root}/prompts.json", "--output", "{root}/prompts.json"],
        "is an input (--request {root}/prompts.json)",
    ),
    (
        ["generate", "--prompts", "{root}/prompts.json", "--output", "{model}/model.safetensors"],
        "is the model's own file (--model {model})",
    ),
    (
        ["generate", "--prompts", "{root}/prompts.json", "--output", "{root}/prompts.json"],
        "is an input (--prompts {root}/prompts.json)",
    ),
    (
        ["generate", "--prompts", "{root}/prompts.json", "--output", "{root}/prompts-link.json"],
        "--output {root}/prompts-link.json is an input (--prompts {root}/prompts.json)",
    ),
]


@pytest.mark.parametrize(
    "argv,message", OVERWRITES, ids=[f"{c[0][0]}-{i}" for i, c in enumerate(OVERWRITES)]
)
def test_an_output_onto_an_input_is_refused_and_the_input_is_untouched(
    files, capsys, argv, message
):
    model = files / "no-weights"
    link = files / "prompts-link.json"
    if not link.is_symlink():
        link.symlink_to(files / "prompts.json")  # the same file by another name
    before = {
        path: path.read_bytes() for path in (model / "model.safetensors", files / "prompts.json")
    }
    argv = [a.format(root=files, model=model) for a in argv]
    command = argv[:2] if argv[0] == "steer" else argv[:1]
    code = main([*command, "--model", str(model), *argv[len(command) :]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert message.format(root=files, model=model) in err[-1], err[-1]
    assert not any("loading" in line for line in err), err
    assert {path: path.read_bytes() for path in before} == before

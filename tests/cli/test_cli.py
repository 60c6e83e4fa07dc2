"""The `ster` command line end to end on a toy checkpoint: JSON on stdout, refusals as one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ster_dist.cli import main
from ster_dist.families.names import FAMILY_NAMES
from ster_dist.families.registry import SPECS


def run(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy") / "model"
    assert main(["toy-model", str(directory)]) == 0
    return directory


def test_families_lists_the_gate_with_derived_status(capsys):
    code, out, _ = run(capsys, "families")
    assert code == 0
    assert [row["family"] for row in out["families"]] == list(FAMILY_NAMES)
    status = {row["family"]: row["status"] for row in out["families"]}
    assert {f for f, s in status.items() if s != "refused"} == set(SPECS)
    assert sum(out["counts"].values()) == 131


def test_inspect_model_reads_no_weights(capsys, toy):
    code, out, _ = run(capsys, "inspect-model", "--model", str(toy), "--revision", "v1")
    assert code == 0
    assert out["family"] == "llama" and out["model_revision"] == "v1"
    assert out["files"] == ["model.safetensors"]
    assert out["config"]["num_layers"] == 2


def test_generate_is_deterministic_under_a_seed(capsys, toy):
    args = [
        "generate",
        "--model",
        str(toy),
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--seed",
        "7",
    ]
    code, first, err = run(capsys, *args)
    assert code == 0, err
    _, second, _ = run(capsys, *args)
    assert first["text"] == second["text"]
    assert first["completion_tokens"] == 6 and first["chat_template"] == "on"
    assert first["model_revision"] is None and first["precision"] == "f32"
    # NDJSON events only
    assert all("event" in json.loads(line) for line in err.strip().splitlines())


def test_prompt_set_answers_each_prompt_in_order(capsys, toy, tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["one", "two three four", "five six"]}))
    out_file = tmp_path / "answers.json"
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(toy),
        "--prompts",
        str(prompts),
        "--output",
        str(out_file),
        "--max-new-tokens",
        "4",
        "--chat-template",
        "off",
    )
    assert code == 0, err
    answers = json.loads(out_file.read_text())
    assert [r["prompt"] for r in answers["results"]] == ["one", "two three four", "five six"]
    for result in answers["results"]:
        _, single, _ = run(
            capsys,
            "generate",
            "--model",
            str(toy),
            "--prompt",
            result["prompt"],
            "--max-new-tokens",
            "4",
            "--chat-template",
            "off",
        )
        assert single["text"] == result["text"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "--prompt", "x", "--max-new-tokens", "-1"],
            "--max-new-tokens must be zero or more",
        ),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p must lie in (0, 1]"),
        (["generate"], "give exactly one of --prompt TEXT or --prompts FILE"),
        (["generate", "--prompt", "x", "--strength", "1"], "--strength scales a steering vector"),
    ],
)
def test_refusals_are_one_line(capsys, toy, argv, message):
    command, rest = argv[0], argv[1:]
    model = ["--model", str(toy)] if command == "generate" else []
    code, out, err = run(capsys, command, *model, *rest)
    assert code == 2 and out is None
    last = err.strip().splitlines()[-1]
    assert message in last and "Traceback" not in err


def test_refusal_from_a_real_process_has_no_traceback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "plamo2"}))
    proc = subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", "inspect-model", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    said = [
        line for line in proc.stderr.splitlines() if not line.startswith('{"event": "progress"')
    ]
    # the refusal, beside the progress events
    assert len(said) == 1 and "Traceback" not in proc.stderr
    assert said[0].startswith('model architecture "plamo2" is unsupported by this ster_dist build')


def test_toy_model_again_is_a_no_op_another_is_refused_and_force_replaces(capsys, tmp_path):
    directory = tmp_path / "toy"
    code, made, _ = run(capsys, "toy-model", str(directory))
    assert code == 0 and "unchanged" not in made
    weights = (directory / "model.safetensors").stat().st_mtime_ns
    code, again, err = run(capsys, "toy-model", str(directory))
    assert code == 0 and again["unchanged"] is True and "nothing to do" in err
    assert (directory / "model.safetensors").stat().st_mtime_ns == weights  # not rewritten
    code, _, err = run(capsys, "toy-model", str(directory), "--layers", "3")
    assert code == 2 and "exists and is not empty" in err and "--force" in err
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == 2
    code, replaced, _ = run(capsys, "toy-model", str(directory), "--layers", "3", "--force")
    assert code == 0 and replaced["replaced"] is True and replaced["output"] == str(directory)
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]  # no staging directory left behind


def test_help_shows_every_flag_with_its_meaning_and_default(capsys):
    with pytest.raises(SystemExit) as shown:
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert shown.value.code == 0
    from ster_dist.schema import GenerateRequest

    for name, info in GenerateRequest.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in out and info.description.split()[0] in out, name
    assert "(default: 64)" in out and "{auto,on,off}" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as shown:
        main(["--version"])
    assert shown.value.code == 0 and capsys.readouterr().out.startswith("ster_dist ")


def test_a_bad_flag_is_one_line(capsys):
    code, out, err = run(
        capsys, "generate", "--model", "m", "--prompt", "x", "--max-new-tokens", "ten"
    )
    assert code == 2 and out is None and err.count("\n") == 1 and "--max-new-tokens" in err


def test_outputs_take_the_process_umask(tmp_path):
    """Every output file gets the mode the umask gives a new file (some used to be 0600)."""
    script = (
        "import os, sys; os.umask(0o027); from ster_dist.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    toy, prompts = tmp_path / "toy", tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["one"]}))
    for argv in (
        ["toy-model", str(toy)],
        [
            "generate",
            "--model",
            str(toy),
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "a.json"),
            "--max-new-tokens",
            "2",
        ],
    ):
        done = subprocess.run(
            [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
    for path in (
        tmp_path / "a.json",
        toy / "config.json",
        toy / "model.safetensors",
        toy / ".ster-made.json",
    ):
        assert path.stat().st_mode & 0o777 == 0o640, (path, oct(path.stat().st_mode))
    assert toy.stat().st_mode & 0o777 == 0o750

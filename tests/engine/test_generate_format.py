"""`ster generate --format text`: the answer's text alone on stdout, the same text `ster generate`
records; refused with --prompts; a job's record is the same JSON whatever the format."""

from __future__ import annotations

import json

import pytest

from ster_dist.cli import main
from tests.cli_run import cli_generate, make_toy


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def test_format_text_prints_the_answer_alone(toy, capsys):
    argv = [f"--model={toy}", "--prompt=hello there", "--max-new-tokens=6"]
    want = cli_generate(*argv)
    capsys.readouterr()
    assert main(["generate", *argv, "--format", "text"]) == 0
    out, err = capsys.readouterr()
    assert out == want["text"] + "\n" and want["text"], err
    assert main(["generate", *argv, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == want


def test_format_text_with_prompts_is_refused(toy, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["a", "b"]}))
    code = main(
        [
            "generate",
            "--model",
            toy,
            "--prompts",
            str(prompts),
            "--output",
            str(tmp_path / "o.json"),
            "--format",
            "text",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == (
        "--format text prints one answer's text; use it with --prompt (the answers "
        "to --prompts go to its output file)"
    )
    assert main(["generate", "--model", toy, "--prompt", "a", "--format", "yaml"]) == 2
    assert (
        "argument --format: invalid choice: 'yaml' (choose from 'json', 'text')"
        in capsys.readouterr().err
    )


def test_a_job_records_the_same_json_whatever_the_format(toy):
    from ster_dist.api import Engine

    with Engine(toy) as engine:
        text = engine.generate("hello there", max_new_tokens=6, format="text")
        plain = engine.generate("hello there", max_new_tokens=6)
    assert text == plain

"""Helpers the tune tests (test_tune_preference.py, test_tune_grpo*.py) share: JSONL input files,
the command line run in-process, a `ster tune grpo` command line, a base model that stops early, and
the relative difference of two tensors."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from ster_dist.cli import main
from tests.tiny_models import BASE_CONFIG, random_ids

EOS = BASE_CONFIG["eos_token_id"]


def write_jsonl(path: Path, rows: list) -> Path:
    """One line per row: a string as written (a malformed line on purpose), anything else as
    JSON."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_cli(capsys, *argv) -> tuple[int, dict | None, str]:
    """(exit code, the JSON result on success, stderr) of `ster argv...` run in this process."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else None), captured.err


def quiet_cli(*argv) -> dict:
    """The JSON result of `ster argv...` run in this process, its progress kept off the test's
    output; a failure fails the test with what the command said."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    assert code == 0, stderr.getvalue()
    return json.loads(stdout.getvalue())


def grpo_argv(root: Path, output: Path, *flags) -> list[str]:
    """`ster tune grpo` on root/base and root/prompts.jsonl into `output`, seeded, four prompts a
    step; the caller's `flags` add the rest."""
    return [
        "tune",
        "grpo",
        "--model",
        str(root / "base"),
        "--prompts",
        str(root / "prompts.jsonl"),
        "--output",
        str(output),
        "--seed",
        "0",
        "--batch-size",
        "4",
        *flags,
    ]


def plant_early_stops(model, directory: Path) -> None:
    """Push the head's end-of-sequence row along the mean final hidden state of `model` (the
    Transformers model saved at `directory`), and save that head there: most tokens now end the
    text, so a length reward has room to rise."""
    from safetensors.torch import load_file, save_file

    with torch.no_grad():
        mean = (
            model(random_ids(20), output_hidden_states=True).hidden_states[-1].flatten(0, 1).mean(0)
        )
        head = model.lm_head.weight.clone()
        head[EOS] += 40 * mean / mean.dot(mean)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = head.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def trains_as_the_rank(got: dict, reference: dict) -> None:
    """Two steps: the first is the identity either way; the second is sampled under the first step's
    factors."""
    assert len(got["steps"]) == 2
    assert got["losses"][0] == 0.0 and got["steps"][0]["kl"] == 0.0
    for ours, theirs in zip(got["steps"], reference["steps"]):
        for key in ("reward", "completion_length", "tokens", "completions"):
            assert ours[key] == theirs[key], key
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5, abs=1e-7)
    assert got["steps"][1]["kl"] == pytest.approx(reference["steps"][1]["kl"], rel=1e-4)
    assert got["steps"][1]["kl"] > 0

"""What a person mistypes, refused in one line that names the fix, before anything starts: an
unknown flag with the closest known one, a bare model name that is no directory here with the
closest directory (no Hub request), a `serve --host` beyond loopback without a key; each in a fresh
interpreter that never imports torch or Ray, timed (CPU seconds, which a busy machine does not
inflate) with a generous bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ster_dist.cli import main, parse, refuse_early
from tests.hub_server import serving

REPO = Path(__file__).resolve().parents[2]


def refusal(capsys, *argv) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    lines = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["generate", "--modle", "m", "--prompt", "hi"],
            "ster generate: unknown flag --modle; did you mean `--model`?",
        ),
        (
            ["generate", "--model", "m", "--promt=hi"],
            "ster generate: unknown flag --promt; did you mean `--prompt`?",
        ),
        (
            ["steer", "train", "--modle", "m"],
            "ster steer train: unknown flag --modle; did you mean `--model`?",
        ),
        (
            ["plan", "--model", "m", "--gpu-memroy", "80"],
            "ster plan: unknown flag --gpu-memroy; did you mean `--gpu-memory`?",
        ),
    ],
)
def test_an_unknown_flag_is_named_with_the_closest_known_one(capsys, argv, words):
    assert refusal(capsys, *argv).startswith(words)


def test_a_flag_s_unambiguous_prefix_and_a_value_like_a_flag_still_parse():
    request = parse(["generate", "--mod", "m", "--prompt", "--modle is a typo"])
    assert (request.model, request.prompt) == ("m", "--modle is a typo")


def test_a_bare_name_beside_a_directory_is_refused_with_it_before_any_hub_request(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "toy").mkdir()
    monkeypatch.chdir(tmp_path)
    with serving(monkeypatch, tmp_path) as hub:
        message = refusal(capsys, "generate", "--model", "toyy", "--prompt", "hi")
        assert hub.requests == []
    assert message.startswith("no directory toyy here, and a Hub id names its owner (owner/name")
    assert "did you mean ./toy?" in message


def test_an_owner_name_hub_id_passes_the_early_check_untouched(tmp_path, monkeypatch):
    """Left to the Hub (test_resolve_local's test_missing_path_falls_through_to_the_hub resolves
    one)."""
    (tmp_path / "toy").mkdir()
    monkeypatch.chdir(tmp_path)
    with serving(monkeypatch, tmp_path) as hub:
        for model in ("someone/toyy", "HuggingFaceTB/SmolLM2-135M-Instruct"):
            refuse_early(parse(["generate", "--model", model, "--prompt", "hi"]))
        assert hub.requests == []  # the check lists a directory, and asks nothing of the network


# a fresh interpreter: the refusal's CPU time, and whether torch or Ray were imported on the way to
# it
TIMED = """
import json, sys, time
from ster_dist.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "cpu": time.process_time(),
                  "started": sorted(m for m in ("torch", "ray", "uvicorn") if m in sys.modules)}))
"""


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["serve", "--model", "models/smollm2", "--host", "0.0.0.0"],
            "--host 0.0.0.0 listens beyond this machine",
        ),
        (
            ["generate", "--model", "models/smolm2", "--prompt", "hi", "--tp", "2"],
            "did you mean models/smollm2?",
        ),
        (["chat", "--model", "smollm", "--max-new-tokens", "4"], "did you mean ./smollm2?"),
        (["generate", "--modle", "models/smollm2", "--prompt", "hi"], "did you mean `--model`?"),
    ],
)
def test_argument_refusals_come_before_torch_or_ray_in_well_under_a_second(tmp_path, argv, words):
    (tmp_path / "models" / "smollm2").mkdir(parents=True)
    (tmp_path / "smollm2").mkdir()
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", TIMED, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["code"] == 2 and words in done.stderr, done.stderr
    assert result["started"] == []  # nothing heavy was even imported
    # about 0.3 s measured; the bound is generous, not a benchmark
    assert result["cpu"] < 1.5, result

"""Generation through the token engine from the outside: `ster generate --stream` prints the answer
as it comes, `Engine.generate(stream=True)` yields it, and the sampling flags (stop strings and
tokens, logprobs, penalties, top-k / min-p) reach the engine and its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ster_dist.errors import Refusal
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


def test_stream_prints_the_answer_on_stdout_as_it_comes(toy):
    whole = cli_generate(
        f"--model={toy}", "--prompt=tell me", "--max-new-tokens=12", "--chat-template=off"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "generate",
            f"--model={toy}",
            "--prompt=tell me",
            "--max-new-tokens=12",
            "--chat-template=off",
            "--stream",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == whole["text"] + "\n"
    # every line of stderr is still one JSON event, and the text never went there
    assert all(
        isinstance(json.loads(line), dict) for line in done.stderr.splitlines() if line.strip()
    )


def test_engine_generate_stream_yields_the_same_text(toy):
    from ster_dist.api import Engine

    with Engine(toy) as engine:
        pieces = list(
            engine.generate("tell me", stream=True, max_new_tokens=12, chat_template="off")
        )
        whole = engine.generate("tell me", max_new_tokens=12, chat_template="off")
        with pytest.raises(Refusal, match="one prompt"):
            engine.generate(["a", "b"], stream=True)
    assert len(pieces) > 1 and "".join(pieces) == whole["text"]


def test_stop_string_ends_the_answer_before_it(toy):
    free = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=24",
        "--chat-template=off",
        "--ignore-eos",
    )
    stop = next(
        word for word in free["text"].split() if len(word) >= 2 and free["text"].index(word) > 0
    )
    cut = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=24",
        "--chat-template=off",
        "--ignore-eos",
        f"--stop={stop}",
        "--stop=never-seen-text",
    )
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == free["text"][: free["text"].index(stop)]
    assert cut["sampling"]["stop"] == [stop, "never-seen-text"]


def test_stop_token_ids_and_logprobs(toy):
    free = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=10",
        "--chat-template=off",
        "--ignore-eos",
        "--logprobs=3",
    )
    assert len(free["logprobs"]) == free["completion_tokens"] == 10
    first = free["logprobs"][0]
    assert len(first["top"]) == 3 and first["top"][0][1] >= first["top"][1][1] >= first["top"][2][1]
    assert first["logprob"] == pytest.approx(first["top"][0][1])  # greedy picks the likeliest
    # each token's text beside its id, as Transformers' tokenizer decodes that token alone
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(toy)
    for lp in free["logprobs"]:
        assert lp["text"] == reference.decode([lp["token"]], skip_special_tokens=False)
        assert [alt[2] for alt in lp["top"]] == [
            reference.decode([alt[0]], skip_special_tokens=False) for alt in lp["top"]
        ]
    assert "".join(lp["text"] for lp in free["logprobs"]) == free["text"]
    token = free["logprobs"][4]["token"]
    cut = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=10",
        "--chat-template=off",
        "--ignore-eos",
        f"--stop-token-ids={token}",
    )
    assert cut["finish_reason"] == "stop"
    first_at = [lp["token"] for lp in free["logprobs"]].index(token)
    assert cut["completion_tokens"] == first_at + 1


def test_penalties_and_filters_change_sampling_and_are_recorded(toy):
    base = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=16",
        "--chat-template=off",
        "--ignore-eos",
    )
    penalized = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=16",
        "--chat-template=off",
        "--ignore-eos",
        "--repetition-penalty=3",
        "--frequency-penalty=2",
    )
    assert (
        penalized["sampling"]["repetition_penalty"] == 3
        and penalized["sampling"]["frequency_penalty"] == 2
    )
    assert penalized["text"] != base["text"]
    top1 = cli_generate(
        f"--model={toy}",
        "--prompt=count",
        "--max-new-tokens=16",
        "--chat-template=off",
        "--ignore-eos",
        "--temperature=1.5",
        "--top-k=1",
        "--seed=4",
    )
    assert top1["text"] == base["text"]  # top-k 1 samples the argmax whatever the temperature


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-p=2"], "--min-p"),
        (["--stream", "--prompts=x.json", "--output=o.json"], "--stream"),
        (["--kv-cache-memory=lots"], "--kv-cache-memory takes a size"),
        (["--logprobs=21"], "--logprobs"),
    ],
)
def test_bad_engine_flags_are_refused_in_one_line(toy, argv, message):
    argv = [a for a in argv]
    if not any(a.startswith("--prompts") for a in argv):
        argv.append("--prompt=hi")
    with pytest.raises(Refusal, match=message) as refused:
        cli_generate(f"--model={toy}", *argv)
    assert "\n" not in str(refused.value)

"""`ster chat` end to end: a real `python -m ster_dist.cli chat` process on the toy checkpoint (its
chat template is ChatML), its turns piped on stdin. The first answer is `ster generate`'s with the
chat template on; a later turn is Transformers' greedy generation over the whole conversation
rendered by its own tokenizer; /reset, --system, --vector and --adapter answer as `ster generate`
with the same settings; a turn past the model's positions and a model with no chat template are
refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ster_dist.errors import Refusal
from tests.cli_run import cli_generate, make_toy

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 8


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> str:
    return make_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def hello(toy) -> dict:
    """`ster generate`'s greedy answer to "hello" through the chat template: a fresh chat's first
    answer."""
    return cli_generate(
        f"--model={toy}", "--prompt=hello", "--chat-template=on", f"--max-new-tokens={TOKENS}"
    )


def ster_chat(
    toy: str, turns: list[str], *flags, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "chat",
            f"--model={toy}",
            f"--max-new-tokens={TOKENS}",
            *map(str, flags),
        ],
        input="".join(t + "\n" for t in turns),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def totals(done: subprocess.CompletedProcess) -> dict:
    """The chat's totals: the last line of its stderr."""
    return json.loads(done.stderr.strip().splitlines()[-1])


def transformers_answer(toy: str, messages: list[dict]) -> str:
    """Transformers' own greedy answer to the conversation, rendered by its own tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy)
    model = AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS, do_sample=False
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_conversation_reset_and_a_refused_turn(toy, hello):
    question = "what is the sea"
    too_long = "hello " * 600  # past the toy's 512 positions
    done = ster_chat(
        toy, ["hello", question, "/reset", "hello", too_long, question, "/exit", "never read"]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first = hello["text"]
    second = transformers_answer(
        toy,
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": question},
        ],
    )
    # turn 1 is generate's; turn 2 is Transformers' over the conversation; /reset starts afresh; the
    # refused turn is dropped, so the last answer continues the reset conversation as turn 2 did
    assert done.stdout == "".join(a + "\n" for a in (first, second, first, second))
    refused = [line for line in done.stderr.splitlines() if "positions" in line]
    assert (
        len(refused) == 1
        and "this turn is dropped" in refused[0]
        and not refused[0].startswith("{")
    ), refused
    summary = totals(done)
    assert summary["turns"] == 4 and summary["prompt_tokens"] > 4 * hello["prompt_tokens"]
    assert 2 * hello["completion_tokens"] < summary["completion_tokens"] <= 4 * TOKENS


def test_a_compiling_chat_warms_before_its_first_turn_and_answers_as_generate(toy, hello):
    # the suite runs eager (tests/conftest.py); this chat compiles, as a user's does
    done = ster_chat(toy, ["hello"], "--max-step-tokens=32", env={"STER_ENFORCE_EAGER": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == hello["text"] + "\n"
    lines = done.stderr.splitlines()
    warmed = [
        i for i, line in enumerate(lines) if "warmed the compiled steps for 1 to 32 tokens" in line
    ]
    # nothing compiled later
    assert warmed and not any("compiled" in line for line in lines[warmed[0] + 1 :]), lines


def test_the_system_message_leads_the_conversation(toy, tmp_path):
    system = "You are a helpful assistant. Answer briefly."
    (tmp_path / "system.txt").write_text(system)
    want = cli_generate(
        f"--model={toy}",
        "--prompt=hello",
        "--chat-template=on",
        f"--max-new-tokens={TOKENS}",
        f"--system={tmp_path / 'system.txt'}",
    )
    done = ster_chat(toy, ["hello"], f"--system={system}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == want["text"] + "\n"
    assert totals(done) == {
        "turns": 1,
        "prompt_tokens": want["prompt_tokens"],
        "completion_tokens": want["completion_tokens"],
    }


def _vector(toy: str, path: Path) -> list[str]:
    from ster_dist.steer.artifact import Direction, SteeringArtifact

    hidden = json.loads((Path(toy) / "config.json").read_text())["hidden_size"]
    values = torch.randn(hidden, generator=torch.Generator().manual_seed(3))
    SteeringArtifact(
        model=toy,
        model_revision=None,
        trait_name="t",
        method="caa",
        hidden_size=hidden,
        vectors=[Direction(1, values / values.norm(), 1.0, 0.0)],
    ).save(path)
    return [f"--vector={path}", "--strength=8"]


def _adapter(toy: str, path: Path) -> list[str]:
    from tests.steer.test_merge import peft_adapter

    peft_adapter(Path(toy), path, ["q_proj", "down_proj"], r=4, lora_alpha=8)
    return [f"--adapter={path}"]


@pytest.mark.parametrize("modifier", [_vector, _adapter], ids=["vector", "adapter"])
def test_a_vector_or_an_adapter_answers_as_generate_does(toy, hello, tmp_path, modifier):
    flags = modifier(toy, tmp_path / "modifier")
    want = cli_generate(
        f"--model={toy}",
        "--prompt=hello",
        "--chat-template=on",
        f"--max-new-tokens={TOKENS}",
        *flags,
    )
    done = ster_chat(toy, ["hello"], *flags)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == want["text"] + "\n"
    assert want["text"] != hello["text"]  # the modifier did something


def test_a_model_without_a_chat_template_is_refused_before_its_weights_load(toy, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(toy, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    done = ster_chat(str(base), ["hello"])
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ster chat needs a chat template;") and str(base) in last
    assert "loading" not in done.stderr and "Traceback" not in done.stderr


def test_vector_and_strength_come_together(toy, tmp_path):
    from ster_dist.cli import parse

    with pytest.raises(Refusal, match="--vector needs --strength"):
        parse(["chat", f"--model={toy}", f"--vector={tmp_path / 'v.json'}"])
    with pytest.raises(Refusal, match="--strength scales a steering vector"):
        parse(["chat", f"--model={toy}", "--strength=1"])


class _Terminal:
    """An output whose first answer text is interrupted as it is written (Ctrl-C landing
    mid-answer)."""

    def __init__(self):
        self.text, self.interrupted = "", False

    def write(self, text: str) -> None:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        self.text += text

    def flush(self) -> None:
        pass


def test_an_interrupt_cancels_the_answer_and_at_the_prompt_ends_the_chat(toy, hello):
    import io

    from ster_dist.chat import chat
    from ster_dist.schema import ChatRequest

    def lines():
        yield "hello\n"  # interrupted mid-answer: dropped
        yield "hello\n"  # answered as a fresh first turn
        raise KeyboardInterrupt  # at the prompt: the chat ends

    assert hello["text"]  # an answer to interrupt
    out, err = _Terminal(), io.StringIO()
    request = ChatRequest.parse({"model": toy, "max_new_tokens": TOKENS}, cli=True)
    summary = chat(request, lines(), out, err)
    assert out.interrupted and out.text == "\n" + hello["text"] + "\n"
    assert summary == {
        "turns": 1,
        "prompt_tokens": hello["prompt_tokens"],
        "completion_tokens": hello["completion_tokens"],
    }
    assert err.getvalue() == ""

"""`ster serve --speculative mtp` as a user starts it: a real server on 127.0.0.1 port 0 over a tiny
DeepSeek-V3 whose MTP layer echoes its token (tests/engine/test_speculative.py), the real openai
client; greedy completions equal
`ster generate` without drafts, and /metrics counts the drafts and those accepted."""

from __future__ import annotations

import openai
import pytest

from tests.cli_run import cli_generate
from tests.serve_process import ServeProcess, metric
from tests.engine.test_speculative import with_mtp


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    return with_mtp(tmp_path_factory.mktemp("deepseek_echo"), echo=True)


def test_served_completions_with_drafts_equal_generate_without(echo):
    prompts = ["hello there", "the cat sat on", "one two three"]
    want = [
        cli_generate(
            f"--model={echo}",
            f"--prompt={p}",
            "--chat-template=off",
            "--max-new-tokens=10",
            "--ignore-eos",
        )["text"]
        for p in prompts
    ]
    proc = ServeProcess("--model", echo, "--speculative", "mtp", "--num-speculative-tokens", "2")
    try:
        client = openai.OpenAI(
            base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        got = [
            client.completions.create(
                model=str(echo),
                prompt=p,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for p in prompts
        ]
        drafted = metric(proc.url, "ster_spec_decode_num_draft_tokens_total")
        accepted = metric(proc.url, "ster_spec_decode_num_accepted_tokens_total")
    finally:
        assert proc.stop() == 0, "".join(proc.stderr)[-2000:]
    assert got == want
    assert drafted > 0 and 0 < accepted <= drafted

"""/v1/completions for lm-evaluation-harness (serve/echo.py, issue 60): `echo` with `logprobs` returns
the prompt's token log-probabilities (the first null), `max_tokens: 0` scores the prompt alone, prompts
come batched, as text or token ids; each log-probability is checked against Transformers' on the same
toy checkpoint."""

from __future__ import annotations

import functools

import httpx
import pytest
import torch

from tests.cli_run import make_toy
from tests.serve_process import ServeProcess


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def server(toy):
    proc = ServeProcess("--model", toy)
    yield proc
    assert proc.stop() == 0, "".join(proc.stderr)[-2000:]


@functools.cache
def _transformers(toy: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()


def reference(toy: str, ids: list[int], top: int) -> tuple[list[float], list[dict[int, float]]]:
    """Transformers' log-probability of each token after the first, and the `top` likeliest there."""
    model = _transformers(toy)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
    values, indices = logprobs.topk(top, dim=-1)
    return chosen, [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


def test_echo_logprobs_are_the_prompts_own_as_transformers_scores_them(server, toy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy)
    texts = ["the sea is calm tonight", "a storm"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    url = f"{server.url}/v1/completions"
    for prompt, max_tokens in ((texts, 0), (ids, 1)):
        reply = httpx.post(url, timeout=120, json={"model": toy, "prompt": prompt, "echo": True, "logprobs": 2,
                                                   "max_tokens": max_tokens, "temperature": 0})
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == 2
        for choice, text, row in zip(choices, texts, ids):
            logprobs = choice["logprobs"]
            assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
            assert len(logprobs["tokens"]) == len(row) + max_tokens
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            want, want_top = reference(toy, row, 2)
            got = logprobs["token_logprobs"][1:len(row)]
            assert got == pytest.approx(want, abs=1e-4)
            for top, expected in zip(logprobs["top_logprobs"][1:len(row)], want_top):
                assert sorted(top.values()) == pytest.approx(sorted(expected.values()), abs=1e-4)
            assert logprobs["text_offset"][0] == 0 and "".join(logprobs["tokens"][:len(row)]).endswith(text[-3:])


def test_echo_without_logprobs_and_what_it_refuses(server, toy):
    url = f"{server.url}/v1/completions"
    reply = httpx.post(url, timeout=60, json={"model": toy, "prompt": "hello", "echo": True, "max_tokens": 0})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hello"
    assert reply.json()["choices"][0]["logprobs"] is None
    refused = httpx.post(url, timeout=60, json={"model": toy, "prompt": "hello", "echo": True, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"

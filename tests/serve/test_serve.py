"""`ster serve` from the outside: the official openai client against a live server on the toy model,
every answer checked against `ster generate`'s (the engine's own reference, read in another process
state), and the server's safety: its key, its limits, a client that leaves, SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ster_dist import ops
from ster_dist.cli import parse
from ster_dist.session import Session
from tests.cli_run import cli_generate, make_toy
from tests.serve_process import ROOT, ServeProcess, metric, wait_for
from tests.steer.test_steer import PAIRS

openai = pytest.importorskip("openai")

KEY = "test-key-123"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def modifiers(toy, tmp_path_factory):
    """A steering vector trained on the toy (in --vectors DIR as calm.json) and a PEFT adapter."""
    from tests.steer.test_merge import peft_adapter

    root = tmp_path_factory.mktemp("modifiers")
    vectors = root / "vectors"
    vectors.mkdir()
    pairs = root / "pairs.json"
    pairs.write_text(json.dumps(PAIRS))
    request = parse(
        [
            "steer",
            "train",
            f"--model={toy}",
            f"--pairs={pairs}",
            f"--output={vectors / 'calm.json'}",
            "--layers=1",
        ]
    )
    with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
        ops.steer_train(session, request)
    adapter = root / "lora"
    peft_adapter(toy, adapter, ["q_proj", "v_proj", "gate_proj"], r=4, lora_alpha=8)
    return vectors, adapter


@pytest.fixture(scope="module")
def server(toy, modifiers, tmp_path_factory):
    vectors, adapter = modifiers
    # Ster's API reads and writes the tests' files, in pytest's temporary directories
    proc = ServeProcess(
        "--model",
        toy,
        "--vectors",
        vectors,
        "--adapter",
        f"lora={adapter}",
        "--allow-path",
        tmp_path_factory.getbasetemp(),
    )
    yield proc
    assert proc.stop() == 0, "".join(proc.stderr)[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def reference(toy, prompts: list[str], *flags) -> list[str]:
    """`ster generate --prompts` answers (one model load for them all)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        path, out = Path(directory) / "p.json", Path(directory) / "o.json"
        path.write_text(json.dumps({"prompts": prompts}))
        request = parse(
            ["generate", f"--model={toy}", f"--prompts={path}", f"--output={out}", *flags]
        )
        with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
            ops.generate(session, request)
        return [r["text"] for r in json.loads(out.read_text())["results"]]


def test_ready_line_is_the_one_line_on_stdout(server):
    assert server.ready == {"port": server.port, "ready": True}
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}


def test_a_compiling_server_warms_every_step_size_before_it_is_ready_and_answers_as_the_eager_one(
    toy, client
):
    # the suite runs eager (tests/conftest.py); this server compiles, as a user's does
    compiled = ServeProcess(
        "--model", toy, "--max-step-tokens", "32", env={"STER_ENFORCE_EAGER": "0"}
    )
    try:
        wait_for(
            lambda: any(
                "warmed the compiled steps for 1 to 32 tokens" in line for line in compiled.stderr
            )
        )
        said = len(compiled.stderr)
        ask = dict(model=str(toy), prompt="Hello there, how are", max_tokens=6, temperature=0)
        want = client.completions.create(**ask).choices[0].text
        other = openai.OpenAI(
            base_url=f"{compiled.url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        assert other.completions.create(**ask).choices[0].text == want
        # nothing compiled after the warm-up
        assert not any("compiled" in line for line in compiled.stderr[said:])
    finally:
        assert compiled.stop() == 0, "".join(compiled.stderr)[-2000:]


def test_chat_and_completions_streamed_or_not_equal_ster_generate(server, client, toy):
    chat_ref = cli_generate(
        f"--model={toy}", "--prompt=hello there", "--max-new-tokens=12", "--chat-template=on"
    )
    text_ref = cli_generate(
        f"--model={toy}", "--prompt=hello there", "--max-new-tokens=12", "--chat-template=off"
    )
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(
        model=toy, messages=messages, max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == chat_ref["text"]
    assert whole.choices[0].finish_reason == chat_ref["finish_reason"]
    assert whole.usage.prompt_tokens == chat_ref["prompt_tokens"]
    assert whole.usage.completion_tokens == chat_ref["completion_tokens"]
    chunks = list(
        client.chat.completions.create(
            model=toy,
            messages=messages,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref["text"]
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat_ref[
        "finish_reason"
    ]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == chat_ref["completion_tokens"]
    )
    text = client.completions.create(
        model=toy,
        prompt="hello there",
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert text.choices[0].text == text_ref["text"]
    assert len(text.choices[0].model_extra["token_ids"]) == text_ref["completion_tokens"]
    streamed = client.completions.create(
        model=toy, prompt="hello there", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text_ref["text"]


def test_models_lists_the_model_and_its_adapters(client, toy):
    assert [m.id for m in client.models.list().data] == [toy, "lora"]


def test_sampling_fields_reach_the_engine(client, toy):
    ref = cli_generate(
        f"--model={toy}",
        "--prompt=tell me",
        "--max-new-tokens=10",
        "--chat-template=off",
        "--temperature=0.8",
        "--seed=7",
        "--top-k=20",
        "--logprobs=2",
    )
    answer = client.completions.create(
        model=toy,
        prompt="tell me",
        max_tokens=10,
        temperature=0.8,
        seed=7,
        logprobs=2,
        extra_body={"top_k": 20},
    )
    assert answer.choices[0].text == ref["text"]
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(
        [lp["logprob"] for lp in ref["logprobs"]], abs=1e-5
    )
    assert all(len(top) <= 2 for top in answer.choices[0].logprobs.top_logprobs)
    # n choices of a seeded request are seeds seed, seed + 1, ...: the second is prompt 1 of a file
    two = client.completions.create(
        model=toy,
        prompt="tell me",
        max_tokens=10,
        temperature=0.8,
        seed=7,
        n=2,
        extra_body={"top_k": 20},
    )
    files = reference(
        toy,
        ["tell me", "tell me"],
        "--max-new-tokens=10",
        "--chat-template=off",
        "--temperature=0.8",
        "--seed=7",
        "--top-k=20",
    )
    assert [c.text for c in two.choices] == files
    stop_ref = cli_generate(
        f"--model={toy}",
        "--prompt=hello there",
        "--max-new-tokens=12",
        "--chat-template=off",
        "--stop=un",
    )
    stopped = client.completions.create(
        model=toy, prompt="hello there", max_tokens=12, temperature=0, stop=["un"]
    )
    assert stopped.choices[0].text == stop_ref["text"]


def test_sixty_four_concurrent_streams_all_complete_correctly(server, toy):
    prompts = [f"question number {i} about {'abcdefgh'[i % 8]}" for i in range(64)]
    expected = reference(toy, prompts, "--max-new-tokens=8", "--chat-template=on")

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=toy,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300
        ) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected


def test_steering_and_adapter_fields_equal_the_cli_flags(client, toy, modifiers):
    vectors, adapter = modifiers
    steered = cli_generate(
        f"--model={toy}",
        "--prompt=hello",
        "--max-new-tokens=10",
        "--chat-template=on",
        f"--vector={vectors / 'calm.json'}",
        "--strength=4",
    )
    plain = cli_generate(
        f"--model={toy}", "--prompt=hello", "--max-new-tokens=10", "--chat-template=on"
    )
    adapted = cli_generate(
        f"--model={toy}",
        "--prompt=hello",
        "--max-new-tokens=10",
        "--chat-template=on",
        f"--adapter={adapter}",
    )
    # both change the answer here
    assert steered["text"] != plain["text"] and adapted["text"] != plain["text"]
    messages = [{"role": "user", "content": "hello"}]
    by_name = client.chat.completions.create(
        model=toy,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"steering": {"vector": "calm", "strength": 4}},
    )
    assert by_name.choices[0].message.content == steered["text"]
    inline = client.chat.completions.create(
        model=toy,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={
            "steering": {"artifact": json.loads((vectors / "calm.json").read_text()), "strength": 4}
        },
    )
    assert inline.choices[0].message.content == steered["text"]
    lora = client.chat.completions.create(
        model="lora", messages=messages, max_tokens=10, temperature=0
    )
    assert lora.choices[0].message.content == adapted["text"]


def test_bad_requests_get_openai_shaped_errors(server, client, toy):
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": ', timeout=10)
    assert raw.status_code == 400
    assert (
        raw.json()["error"]["code"] == "invalid_json"
        and "not valid JSON" in raw.json()["error"]["message"]
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert (
        missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    )
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=toy, prompt="word " * 600, max_tokens=4)
    assert long_prompt.value.body["code"] == "context_length_exceeded"
    assert "positions" in long_prompt.value.body["message"]
    with pytest.raises(openai.NotFoundError) as vector:
        client.chat.completions.create(
            model=toy,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"steering": {"vector": "nope", "strength": 1}},
        )
    assert (
        vector.value.body["code"] == "vector_not_found"
        and "nope.json" in vector.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as temperature:
        client.completions.create(model=toy, prompt="hi", temperature=3)
    assert temperature.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as lone:
        client.chat.completions.create(
            model=toy, messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    assert lone.value.body["param"] == "top_logprobs"


def test_a_streamed_request_is_refused_before_its_stream_starts(server, client, toy):
    """The stream is submitted once the answer is set up (serve/event_stream.py), yet a refusal is
    still OpenAI's 400, not a 200 stream with an error in it."""
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=toy, prompt="word " * 600, max_tokens=4, stream=True)
    assert long_prompt.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(
            model=toy, messages=[{"role": "user", "content": "word " * 600}], stream=True
        )
    assert chat.value.body["param"] == "messages" and "positions" in chat.value.body["message"]
    wrong = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_a_client_that_leaves_frees_its_blocks(server, toy):
    body = {
        "model": toy,
        "prompt": "go on and on",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server.url, "ster_kv_cache_blocks_in_use") > 0
    wait_for(
        lambda: (
            metric(server.url, "ster_num_requests_running") == 0
            and metric(server.url, "ster_kv_cache_blocks_in_use") == 0
        )
    )
    assert metric(server.url, "ster_http_requests_in_flight") == 0
    # not streamed: the leaving is noticed at its next token, long before its 400th
    before = metric(server.url, "ster_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.2)
    wait_for(
        lambda: (
            metric(server.url, "ster_num_requests_running") == 0
            and metric(server.url, "ster_kv_cache_blocks_in_use") == 0
        )
    )
    assert metric(server.url, "ster_generation_tokens_total") - before < body["max_tokens"]
    assert metric(server.url, "ster_http_requests_in_flight") == 0


def test_metrics_count_requests_tokens_and_latencies(server, client, toy):
    client.completions.create(model=toy, prompt="count me", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "ster_requests_total{",
        "ster_generation_tokens_total",
        "ster_prompt_tokens_total",
        "ster_time_to_first_token_seconds_count",
        "ster_inter_token_latency_seconds_count",
        "ster_kv_cache_blocks_total",
        "ster_prefix_cache_hit_rate",
        "ster_num_requests_waiting",
    ):
        assert name in text, name
    assert metric(server.url, "ster_generation_tokens_total") >= 3
    assert 'ster_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_a_non_loopback_address_needs_a_key(toy):
    done = subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", "serve", "--model", toy, "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("--host 0.0.0.0 listens beyond this machine; give --api-key")
    )


@pytest.mark.parametrize("key", ["clé"])
def test_a_key_no_header_can_carry_is_refused_at_start(toy, key):
    """A header carries the key as ASCII bytes: a key with other characters could never match, and
    the server would answer every request 401. It is refused before the model loads."""
    done = subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", "serve", "--model", toy],
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "STER_API_KEY": key},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("--api-key must be printable ASCII")


def test_a_dead_rank_stops_the_engine_and_later_requests_are_503(toy):
    """A rank that dies mid-stream ends that stream with an error event and [DONE]; /health and
    every later request then say 503 engine_stopped (the server's fault), not a 400 blaming the
    prompt."""
    import os

    proc = ServeProcess("--model", toy, "--tp", "2", env={"STER_API_KEY": KEY}, timeout=300)
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        # the ranks' pids as the server reports them (never a search by name: other Ray ranks may
        # run here)
        queue = httpx.get(f"{proc.url}/v1/health", headers=auth, timeout=10).json()["queue"]
        ranks = [
            worker["pid"]
            for group in queue["groups"]
            for worker in group["workers"]
            if worker["rank"] == 1
        ]
        assert len(ranks) == 1, queue
        body = {"model": toy, "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{proc.url}/v1/completions", json=body, headers=auth, timeout=120
        ) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(ranks[0], signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][6:])
        health = httpx.get(f"{proc.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped"
        for stream in (False, True):
            later = httpx.post(
                f"{proc.url}/v1/completions",
                headers=auth,
                timeout=30,
                json={"model": toy, "prompt": "hi", "max_tokens": 2, "stream": stream},
            )
            assert later.status_code == 503, later.text
            assert (
                later.json()["error"]["code"] == "engine_stopped"
                and "died" in later.json()["error"]["message"]
            )
    finally:
        proc.stop()


def test_key_queue_limit_body_limit_and_drain(toy):
    proc = ServeProcess(
        "--model", toy, "--max-queue", "1", "--max-body", "2KiB", env={"STER_API_KEY": KEY}
    )
    try:
        url, auth = proc.url, {"Authorization": f"Bearer {KEY}"}
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.models.list()
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # probes need no key
        # ...but Ster's health tells the model's path and the workers' hosts and pids: only to a key
        # holder
        assert httpx.get(f"{url}/v1/health", timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/health", headers=auth, timeout=10).json()["status"] == "ok"
        big = httpx.post(
            f"{url}/v1/completions",
            headers=auth,
            timeout=10,
            json={"model": toy, "prompt": "x" * 4000},
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        body = {
            "model": toy,
            "prompt": "keep going",
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=auth, timeout=120
        ) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
            second = httpx.post(
                f"{url}/v1/completions",
                headers=auth,
                timeout=10,
                json={"model": toy, "prompt": "me too", "max_tokens": 2},
            )
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert second.json()["error"]["type"] == "rate_limit_error"
            # Ster's endpoints that run work count against the same limit
            job = httpx.post(
                f"{url}/v1/generate", headers=auth, timeout=10, json={"prompt": "me too"}
            )
            assert job.status_code == 429 and job.json()["error"]["code"] == "rate_limit_exceeded"
            # drains: the stream in flight still finishes whole
            proc.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        pieces = [json.loads(line[6:]) for line in rest[:-1]]
        assert pieces[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.proc.wait(60) == 0
        assert proc.rest_of_stdout() == ""  # the ready line stayed the only line on stdout
        assert any("draining" in line for line in proc.stderr)
    finally:
        proc.stop()


def test_ster_endpoints_share_the_server_and_pause_its_engine_between_steps(server, toy, tmp_path):
    """Ster's /v1/extract on the served model runs while an OpenAI stream is generating: the stream
    waits between steps (the ranks are the extract's alone meanwhile) and still gives its exact
    text; /v1/generate joins the server's own engine (no second model load, no rebuilt engine)."""
    import threading

    expected = cli_generate(
        f"--model={toy}",
        "--prompt=keep talking",
        "--max-new-tokens=240",
        "--chat-template=off",
        "--ignore-eos",
    )
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["one", "two"]}))
    streamed: list[str] = []

    def stream():
        body = {
            "model": toy,
            "prompt": "keep talking",
            "max_tokens": 240,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: streamed, timeout=60, step=0.01)
    extract = httpx.post(
        f"{server.url}/v1/extract",
        timeout=120,
        json={"input": str(prompts), "output": str(tmp_path / "acts.safetensors"), "layers": "1"},
    )
    assert extract.status_code == 200, extract.text
    assert len(streamed) < 240  # it ran while the stream was generating
    events = [json.loads(line) for line in extract.text.splitlines()]
    assert events[-1]["event"] == "result"
    thread.join(120)
    assert "".join(streamed) == expected["text"]
    assert (tmp_path / "acts.safetensors").is_file()
    generated = httpx.post(
        f"{server.url}/v1/generate",
        timeout=120,
        json={
            "prompt": "hello there",
            "maxNewTokens": 12,
            "chatTemplate": "off",
            "kvCacheMemory": "1MiB",
        },
    )
    result = [json.loads(line) for line in generated.text.splitlines()][-1]["result"]
    assert (
        result["text"]
        == cli_generate(
            f"--model={toy}", "--prompt=hello there", "--max-new-tokens=12", "--chat-template=off"
        )["text"]
    )
    # still the server's engine, not a 1MiB one
    assert metric(server.url, "ster_kv_cache_blocks_total") > 1000


def test_several_prompts_token_ids_and_streamed_choices(client, toy):
    from ster_dist.tokenizer import Tokenizer
    from pathlib import Path

    expected = reference(
        toy, ["hello there", "tell me"], "--max-new-tokens=8", "--chat-template=off"
    )
    many = client.completions.create(
        model=toy, prompt=["hello there", "tell me"], max_tokens=8, temperature=0
    )
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == expected
    ids = Tokenizer.from_directory(Path(toy)).encode("tell me")
    by_ids = client.completions.create(model=toy, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == expected[1]
    sampled = reference(
        toy,
        ["hello", "hello"],
        "--max-new-tokens=8",
        "--chat-template=on",
        "--temperature=0.9",
        "--seed=11",
    )
    chunks = client.chat.completions.create(
        model=toy,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0.9,
        seed=11,
        n=2,
        stream=True,
        logprobs=True,
        top_logprobs=1,
    )
    texts, logprob_tokens = {0: "", 1: ""}, {0: 0, 1: 0}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprob_tokens[choice.index] += len(choice.logprobs.content)
    assert [texts[0], texts[1]] == sampled
    assert logprob_tokens[0] > 0 and logprob_tokens[1] > 0


def test_inline_vectors_are_bounded_per_server(client, toy, modifiers, monkeypatch):
    """Each distinct inline artifact is registered on every rank for the engine's life: past the
    server's limit a new one is refused (400), a known one still steers."""
    from ster_dist.serve import state as state_module

    vectors, _ = modifiers
    artifact = json.loads((vectors / "calm.json").read_text())
    messages = [{"role": "user", "content": "hi"}]
    accepted = 0
    with pytest.raises(openai.BadRequestError) as refused:
        for i in range(state_module.MAX_VECTORS + 1):
            scaled = {
                **artifact,
                "vectors": [
                    {**v, "values": [x * (1 + i / 1000) for x in v["values"]]}
                    for v in artifact["vectors"]
                ],
            }
            client.chat.completions.create(
                model=toy,
                messages=messages,
                max_tokens=1,
                temperature=0,
                extra_body={"steering": {"artifact": scaled, "strength": 1}},
            )
            accepted += 1
    assert accepted < state_module.MAX_VECTORS + 1
    assert "distinct steering vectors" in refused.value.body["message"]
    again = client.chat.completions.create(
        model=toy,
        messages=messages,
        max_tokens=1,
        temperature=0,
        extra_body={"steering": {"vector": "calm", "strength": 1}},
    )
    assert again.choices[0].finish_reason in ("length", "stop")


def test_a_keyless_server_refuses_a_web_pages_requests(server, toy, tmp_path):
    """A page in the user's browser may POST to 127.0.0.1 (a text/plain body needs no CORS approval)
    or reach it by a name it rebinds there: a keyless server refuses both, before a job writes any
    file."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": ["one"]}))
    body = json.dumps(
        {"input": str(prompts), "output": str(tmp_path / "acts.safetensors"), "layers": "1"}
    )
    for headers in (
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
        {"Origin": "null"},
        {"Host": f"rebound.example:{server.port}"},
    ):
        refused = httpx.post(f"{server.url}/v1/extract", content=body, headers=headers, timeout=30)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "foreign_origin" and "--api-key" in error["message"]
    assert not (tmp_path / "acts.safetensors").exists()
    own = httpx.post(
        f"{server.url}/v1/completions",
        headers={"Origin": f"http://localhost:{server.port}"},
        timeout=30,
        json={"model": toy, "prompt": "hi", "max_tokens": 1},
    )
    assert own.status_code == 200, own.text
    assert (
        httpx.get(
            f"{server.url}/health", headers={"Origin": "http://evil.example"}, timeout=10
        ).status_code
        == 200
    )
    # a rebound page reads what it asks for (same origin to the browser): Ster's health names paths
    # and pids
    rebound = {"Host": f"rebound.example:{server.port}"}
    assert httpx.get(f"{server.url}/v1/health", headers=rebound, timeout=10).status_code == 403


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"50": 100}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"guided_regex": "a+"}, "guided_regex"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ]
            },
            "messages.0.content.0.type",
        ),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
    ],
)
def test_fields_not_served_are_refused_not_ignored(client, toy, fields, param):
    """What would change the answer and is not served is a 400 naming it (not silently dropped), and
    a chat_template_kwargs key that clashes with the request's own field is a 400, not a 500."""
    body = {
        "model": toy,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        **fields,
    }
    for stream in (False, True):
        answer = httpx.post(
            f"{client.base_url}chat/completions", json={**body, "stream": stream}, timeout=30
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


def test_what_is_served_or_harmless_still_passes(client, toy):
    plain = client.chat.completions.create(
        model=toy,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        response_format={"type": "text"},
        tool_choice="none",
        logit_bias={},
    )
    assert plain.choices[0].finish_reason == "length"


def test_non_finite_logprobs_are_answered_as_json(client, toy):
    """A steering strength may be huge (finite) and make the steered logits non-finite: the answer's
    logprobs are still JSON every client parses (vLLM's -9999.0), whole or streamed. The named
    vector:
    an inline one would count against the server's limit, which an earlier test fills."""

    def strict(text: str):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the answer"))

    body = {
        "model": toy,
        "prompt": "hi",
        "max_tokens": 2,
        "logprobs": 2,
        "steering": {"vector": "calm", "strength": 1e300},
    }
    whole = httpx.post(f"{client.base_url}completions", json=body, timeout=30)
    assert whole.status_code == 200, whole.text
    assert strict(whole.text)["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0, -9999.0]
    streamed = httpx.post(
        f"{client.base_url}completions", json={**body, "stream": True}, timeout=30
    )
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events and all(strict(event)["choices"] is not None for event in events)


def test_a_client_too_slow_to_send_its_request_is_cut_off(toy):
    """A head never finished (a byte now and then) is closed, a body never finished is answered 408,
    both after
    --read-seconds; meanwhile, and after, other clients are answered. Before, both held their
    connections (and the body its task) for ever."""
    proc = ServeProcess("--model", toy, "--read-seconds", "1", env={"STER_ENFORCE_EAGER": "1"})
    try:
        head = socket.create_connection(("127.0.0.1", proc.port), timeout=10)
        body = socket.create_connection(("127.0.0.1", proc.port), timeout=10)
        started = time.monotonic()
        head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model": '
        )
        closed = None
        while closed is None and time.monotonic() - started < 8:
            try:
                # a header's bytes, one at a time: each used to restart uvicorn's clock
                head.sendall(b"X")
                head.settimeout(0.3)
                closed = head.recv(1024) == b"" or None
            except socket.timeout:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
        assert closed, "a request head sent a byte at a time was still open after 8 s"
        assert time.monotonic() - started < 6
        body.settimeout(8)
        answer, chunk = b"", b"..."
        while chunk and (
            b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer)
        ):
            chunk = body.recv(65536)  # the head and the body may come in two segments
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        ok = httpx.post(
            f"{proc.url}/v1/completions",
            timeout=30,
            json={"model": toy, "prompt": "hi", "max_tokens": 1},
        )
        assert ok.status_code == 200, ok.text
    finally:
        assert proc.stop() == 0, "".join(proc.stderr)[-2000:]


def _length(response: bytes) -> int:
    head = response.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    return next(
        int(line.split(":", 1)[1])
        for line in head.split("\r\n")
        if line.startswith("content-length:")
    )


def test_a_huge_prompt_never_holds_health_and_is_refused_before_tokenizing(server, toy):
    """A 3.6 MB prompt (under the 4 MiB body limit) held every client for seconds while it was
    tokenized on the event loop: now it is refused by its length alone, and /health answers
    meanwhile."""
    import threading

    answers: list[httpx.Response] = []
    huge = "word " * 720_000
    bodies = [
        {"model": toy, "prompt": huge, "max_tokens": 1},
        {"model": toy, "messages": [{"role": "user", "content": huge}], "max_tokens": 1},
    ]
    paths = ["/v1/completions", "/v1/chat/completions"]

    def send():
        for path, body in zip(paths, bodies):
            answers.append(httpx.post(f"{server.url}{path}", json=body, timeout=60))

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        started = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - started)
    sender.join()
    for answer, param in zip(answers, ("prompt", "messages")):
        error = answer.json()["error"]
        assert (
            answer.status_code == 400
            and error["code"] == "context_length_exceeded"
            and error["param"] == param
        )
        assert "3600000 characters" in error["message"]
    assert slowest < 1.0

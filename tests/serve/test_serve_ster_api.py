"""Ster's serve API (ster_dist/serve/ster_api.py) on a live server: uvicorn on 127.0.0.1 port 0 in a
thread, a real job queue in this process, the toy checkpoint. Answers are compared with the
command line's: `ster generate`'s text, `ster steer inspect`'s summary, and each refusal with the
sentence the command line prints for the same input (`ster submit` of the body as a job spec for a
field, the job command itself for a missing file)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn
from fastapi import FastAPI
from safetensors import safe_open

from ster_dist import ops
from ster_dist.cli import parse, run
from ster_dist.errors import Refusal
from ster_dist.jobqueue.client import LocalClient
from ster_dist.jobqueue.queue import JobQueue
from ster_dist.schema import SteerInspectRequest
from ster_dist.serve.confine import Confinement
from ster_dist.serve.ster_api import camel_keys, ster_router
from tests.cli_run import cli_generate, make_toy
from tests.steer.test_steer import PAIRS


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    toy = make_toy(tmp_path_factory)
    root = tmp_path_factory.mktemp("ster-api")
    (root / "pairs.json").write_text(json.dumps(PAIRS))
    (root / "prompts.json").write_text(json.dumps({"prompts": ["the sea", "a storm"]}))
    defaults = {
        "model": toy,
        "revision": None,
        "precision": "f32",
        "device": "cpu",
        "tp": 1,
        "ep": 1,
    }
    client = LocalClient(JobQueue(root / "state", idle_s=600).start())
    app = FastAPI()
    # the tests' files lie in pytest's temporary directories: allowed, as --allow-path allows them
    models = [str(root / "no-such-model"), str(root / "empty-model")]
    app.include_router(ster_router(client, defaults, Confinement(toy, [str(root)], models)))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="ster-api-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield {
            "url": f"http://127.0.0.1:{port}",
            "toy": toy,
            "root": root,
            "defaults": defaults,
            "client": client,
        }
    finally:
        server.should_exit = True
        thread.join(30)
        client.close()


def call(served, path: str, body=None, method: str | None = None) -> tuple[int, dict, object]:
    """(status, headers, answer): NDJSON lines as a list of objects, any other JSON as itself."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        served["url"] + path,
        data=data,
        method=method or ("POST" if data else "GET"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            status, headers, text = reply.status, reply.headers, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, headers, text = error.code, error.headers, error.read().decode()
    headers = {key.lower(): value for key, value in headers.items()}
    if headers.get("content-type", "").startswith("application/x-ndjson"):
        return status, headers, [json.loads(line) for line in text.splitlines()]
    return status, headers, json.loads(text)


def result_of(lines: list[dict]) -> dict:
    assert lines and lines[-1]["event"] == "result", lines
    assert all(line["event"] in ("log", "text") for line in lines[:-1]), lines
    return lines[-1]["result"]


def cli_refusal(*argv) -> str:
    """The one line `ster ARGV...` prints for its refusal."""
    with pytest.raises(Refusal) as refused:
        run(parse([str(a) for a in argv]))
    return str(refused.value)


def as_spec_file(served, path: str, body: dict) -> str:
    """The body as the job spec the server makes of it (kind, the served settings, the body)."""
    spec = {"kind": path, **{k: v for k, v in served["defaults"].items() if v is not None}, **body}
    file = served["root"] / f"spec-{len(list(served['root'].glob('spec-*')))}.json"
    file.write_text(json.dumps(spec))
    return str(file)


def assert_refused(answer: tuple, status: int, message: str) -> None:
    code, _, body = answer
    assert (code, body) == (
        status,
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
    ), body


def test_generate_answers_what_the_command_line_does(served):
    status, headers, lines = call(
        served, "/v1/generate", {"prompt": "hello", "maxNewTokens": 8, "chatTemplate": "off"}
    )
    assert (
        status == 200
        and headers["content-type"].startswith("application/x-ndjson")
        and headers["x-ster-job"]
    )
    want = cli_generate(
        "--model",
        served["toy"],
        "--prompt",
        "hello",
        "--max-new-tokens",
        "8",
        "--chat-template",
        "off",
    )
    assert result_of(lines) == camel_keys(want)

    status, _, lines = call(
        served,
        "/v1/generate",
        {"prompt": "hello", "maxNewTokens": 8, "chatTemplate": "off", "stream": True},
    )
    texts = [line["text"] for line in lines if line["event"] == "text"]
    assert status == 200 and texts and "".join(texts) == result_of(lines)["text"] == want["text"]


def test_two_generate_requests_at_once_both_finish_right(served):
    bodies = [
        {"prompt": "the sea is", "maxNewTokens": 12, "chatTemplate": "off"},
        {
            "prompt": "a storm",
            "maxNewTokens": 6,
            "chatTemplate": "off",
            "temperature": 0.8,
            "seed": 3,
        },
    ]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda body: call(served, "/v1/generate", body), bodies))
    wants = [
        cli_generate(
            "--model",
            served["toy"],
            "--prompt",
            "the sea is",
            "--max-new-tokens",
            "12",
            "--chat-template",
            "off",
        ),
        cli_generate(
            "--model",
            served["toy"],
            "--prompt",
            "a storm",
            "--max-new-tokens",
            "6",
            "--chat-template",
            "off",
            "--temperature",
            "0.8",
            "--seed",
            "3",
        ),
    ]
    for (status, _, lines), want in zip(answers, wants):
        assert status == 200
        assert result_of(lines)["text"] == want["text"]


def test_train_inspect_evaluate_and_extract(served):
    root = served["root"]
    vector = root / "calm.json"
    status, _, lines = call(
        served,
        "/v1/train",
        {"pairs": str(root / "pairs.json"), "output": str(vector), "batchSize": 4},
    )
    assert status == 200
    trained = result_of(lines)
    assert vector.is_file() and trained["traitName"] == "calm" and trained["output"] == str(vector)
    logs = [line for line in lines if line["event"] == "log"]
    assert logs and all(isinstance(line["message"], str) and "time" in line for line in logs)
    assert any("reading 5 pairs" in line["message"] for line in logs), logs

    status, _, lines = call(served, "/v1/inspect", {"artifact": str(vector)})
    inspected = ops.OPERATIONS[SteerInspectRequest].run(parse(["steer", "inspect", str(vector)]))
    assert status == 200 and lines == [{"event": "result", "result": camel_keys(inspected)}]
    assert lines[0]["result"] == {k: v for k, v in trained.items() if k != "output"}

    best = root / "best.json"
    status, _, lines = call(
        served,
        "/v1/optimize",
        {"pairs": str(root / "pairs.json"), "output": str(best), "holdout": 0.4},
    )
    assert status == 200 and best.is_file()
    assert result_of(lines)["selection"]["holdout"] == {
        "fraction": 0.4,
        "fitPairs": 3,
        "holdoutPairs": 2,
    }

    status, _, lines = call(
        served, "/v1/evaluate", {"pairs": str(root / "pairs.json"), "vector": str(vector)}
    )
    assert status == 200
    report = result_of(lines)
    assert report["pairCount"] == 5 and report["traitName"] == "calm" and report["layers"]

    activations = root / "h.safetensors"
    status, _, lines = call(
        served,
        "/v1/extract",
        {
            "input": str(root / "prompts.json"),
            "output": str(activations),
            "layers": "0,1",
            "chatTemplate": "off",
        },
    )
    assert status == 200
    extracted = result_of(lines)
    assert (
        extracted["rows"] == 2 and extracted["hiddenSize"] == 64 and extracted["layers"] == [0, 1]
    )
    with safe_open(str(activations), "pt") as tensors:
        assert tensors.get_tensor("layers.1").shape == (2, 64)


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "maxNewToken": 8},  # no such field
        {"prompt": "hi", "maxNewTokens": -1},  # a value out of range
        # a value a validator refuses
        {"prompt": "hi", "topP": 1.5},
        # a sampled job states its seed
        {"prompt": "hi", "temperature": 0.7},
    ],
    ids=["unknown-field", "bad-value", "bad-top-p", "no-seed"],
)
def test_a_refused_field_is_a_400_in_the_command_lines_words(served, body):
    want = cli_refusal("submit", "--local", as_spec_file(served, "generate", body))
    answer = call(served, "/v1/generate", body)
    assert_refused(answer, 400, want)
    assert (
        "'maxNewToken'" in want or "'maxNewTokens'" in want or "'topP'" in want or "'seed'" in want
    )


def test_missing_files_are_a_404_in_the_command_lines_words(served):
    root, toy = served["root"], served["toy"]
    missing = root / "missing-pairs.json"
    want = cli_refusal(
        "steer", "train", "--model", toy, "--pairs", missing, "--output", root / "never.json"
    )
    assert str(missing) in want
    assert_refused(
        call(served, "/v1/train", {"pairs": str(missing), "output": str(root / "never.json")}),
        404,
        want,
    )

    nowhere = root / "no-such-model"
    want = cli_refusal("generate", "--model", nowhere, "--prompt", "hi")
    assert_refused(call(served, "/v1/generate", {"model": str(nowhere), "prompt": "hi"}), 404, want)

    want = str(
        pytest.raises(
            Refusal,
            ops.OPERATIONS[SteerInspectRequest].run,
            parse(["steer", "inspect", str(root / "no-vector.json")]),
        ).value
    )
    assert_refused(
        call(served, "/v1/inspect", {"artifact": str(root / "no-vector.json")}), 404, want
    )
    assert not (root / "never.json").exists()


def test_a_job_that_fails_once_its_stream_began_ends_with_an_error_line(served):
    # a directory, so the job starts (and says so), then is refused
    empty = served["root"] / "empty-model"
    empty.mkdir()
    want = cli_refusal("generate", "--model", empty, "--prompt", "hi")
    status, _, lines = call(served, "/v1/generate", {"model": str(empty), "prompt": "hi"})
    assert status == 200 and lines[0]["event"] == "log", lines
    assert lines[-1] == {"event": "error", "error": {"message": want}}


def test_malformed_bodies_and_unknown_paths_answer_in_the_envelope(served):
    code, _, body = call(served, "/v1/generate", b'{"prompt": "hi",')
    assert code == 400 and body["error"]["code"] == 400 and "not JSON" in body["error"]["message"]
    code, _, body = call(served, "/v1/generate", [1, 2])
    assert code == 400 and "must be a JSON object" in body["error"]["message"]
    code, _, body = call(served, "/v1/generate", {"kind": "extract", "prompt": "hi"})
    assert code == 400 and "'kind'" in body["error"]["message"]
    code, _, body = call(served, "/v1/train/now", {})
    assert (
        code == 404 and body["error"]["code"] == 404 and "/v1/train/now" in body["error"]["message"]
    )
    code, headers, body = call(served, "/v1/train", method="GET")
    assert code == 405 and headers["allow"] == "POST" and body["error"]["code"] == 405


def test_the_served_settings_fill_only_what_a_body_leaves_out_for_the_served_model(served):
    from ster_dist.schema import GenerateRequest
    from ster_dist.serve.ster_api import SterApi

    api = SterApi(served["client"], {**served["defaults"], "precision": "bf16"})
    toy = served["toy"]
    assert api.spec(GenerateRequest, {"prompt": "x", "precision": "f16"}) == {
        "kind": "generate",
        "model": toy,
        "device": "cpu",
        "tp": 1,
        "ep": 1,
        "prompt": "x",
        "precision": "f16",
    }
    assert api.spec(GenerateRequest, {"model": toy, "prompt": "x"}) == {
        "kind": "generate",
        "model": toy,
        "precision": "bf16",
        "device": "cpu",
        "tp": 1,
        "ep": 1,
        "prompt": "x",
    }
    assert api.spec(GenerateRequest, {"model": "other/model", "prompt": "x"}) == {
        "kind": "generate",
        "model": "other/model",
        "prompt": "x",
    }


def test_health(served):
    code, _, body = call(served, "/v1/health")
    assert code == 200 and body["status"] == "ok" and body["model"] == served["toy"]
    assert set(body["queue"]) >= {"queued", "jobs", "groupStarts", "groups"}
    assert isinstance(body["queue"]["groupStarts"], int) and isinstance(
        body["queue"]["groups"], list
    )


def test_paths_outside_the_allowed_directories_and_other_models_are_403(served, tmp_path_factory):
    """A body's paths are the server's files: one outside the working directory and --allow-path is
    refused before its job is queued, followed through symlinks and `..`; so is a model not
    served."""
    root, toy = served["root"], served["toy"]
    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.txt").write_text("the server's own file")
    (root / "link").symlink_to(outside, target_is_directory=True)
    for body in (
        {"prompt": "hi", "system": "/etc/hostname"},
        {"prompt": "hi", "system": str(outside / "secret.txt")},
        {"prompt": "hi", "system": str(root / "link" / "secret.txt")},
        {"prompt": "hi", "system": str(root / ".." / outside.name / "secret.txt")},
        {"prompt": "hi", "output": str(outside / "written.json")},
    ):
        field = next(k for k in body if k != "prompt")
        code, _, answer = call(served, "/v1/generate", body)
        message = answer["error"]["message"]
        assert code == 403 and message.startswith(
            f"'{field}' {body[field]} is outside the directories"
        ), answer
        assert "--allow-path DIR" in message
    assert not (outside / "written.json").exists()
    code, _, answer = call(served, "/v1/inspect", {"artifact": str(outside / "secret.txt")})
    assert code == 403 and "'artifact'" in answer["error"]["message"]
    code, _, answer = call(
        served, "/v1/train", {"pairs": str(root / "pairs.json"), "output": "/tmp/../etc/x.json"}
    )
    assert code == 403 and answer["error"]["message"].startswith(
        "'output' /tmp/../etc/x.json is outside"
    )

    for model in ("gpt2", str(outside)):
        code, _, answer = call(served, "/v1/generate", {"model": model, "prompt": "hi"})
        assert code == 403 and answer["error"]["message"].startswith(
            f"'model' {model!r} is not served here"
        )
        assert "--allow-models NAME" in answer["error"]["message"]
    # the served model in another spelling of its directory is the served model
    code, _, lines = call(
        served,
        "/v1/generate",
        {"model": f"{toy}/.", "prompt": "hi", "maxNewTokens": 2, "chatTemplate": "off"},
    )
    assert code == 200 and isinstance(result_of(lines)["text"], str)


def test_a_body_nested_too_deep_or_with_a_huge_number_is_a_400(served):
    code, _, answer = call(served, "/v1/generate", b"[" * 5000 + b"]" * 5000)
    assert code == 400 and "nest too deeply" in answer["error"]["message"]
    code, _, answer = call(served, "/v1/generate", b'{"maxNewTokens": ' + b"9" * 5000 + b"}")
    assert code == 400 and "a number too long" in answer["error"]["message"]

"""`ster serve --replicas N` (ster_dist.serve.replicas): N app replicas on a real local Ray cluster
behind Ray Serve's one proxy port.

A small FastAPI app (its lifespan standing for a model load) shows Serve's routing, streaming,
startup failures and shutdown on their own; then the real server (`ster serve`'s settings) on the
toy checkpoint, two replicas through one port, answers the openai client as `ster generate` does,
in this process and (marked slow) as the `ster serve --replicas 2` command.
"""

import asyncio
import contextlib
import functools
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ster_dist.cli import parse
from ster_dist.errors import Refusal
from ster_dist.serve.replica_server import deploy_server
from ster_dist.serve.replicas import REPLICA_HEADER, deploy
from tests.cli_run import cli_generate, make_toy
from tests.listeners import descendants, listening, who_listens_beyond_loopback
from tests.serve_process import ServeProcess

openai = pytest.importorskip("openai")

CHUNKS = 4
CHUNK_GAP_S = 0.4


def small_app(stopped: Path):
    """Builds the test app in a replica: /who names the replica's process and what its lifespan
    set up; /echo streams CHUNKS server-sent events, CHUNK_GAP_S apart. Its lifespan's end (where
    the server closes its engine) leaves a file named by the process in `stopped`."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield {"started_in": os.getpid()}
        (stopped / str(os.getpid())).touch()

    app = FastAPI(lifespan=lifespan)

    @app.get("/who")
    async def who(request: Request):
        # long enough for concurrent requests to overlap in a replica's queue
        await asyncio.sleep(0.05)
        return {"pid": os.getpid(), "started_in": request.state.started_in}

    @app.post("/echo")
    async def echo(body: dict):
        async def events():
            for i in range(CHUNKS):
                yield f"data: {body['text']} {i}\n\n"
                await asyncio.sleep(CHUNK_GAP_S)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def app_that_cannot_start():
    """Builds an app whose startup refuses, as the server's does when its model cannot load."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        raise Refusal("no checkpoint at /nowhere/model; give --model a model directory")
        yield

    return FastAPI(lifespan=lifespan)


def test_what_cannot_run_here_is_refused_before_ray_starts():
    import ray

    builder = functools.partial(small_app, Path("/nowhere"))
    with pytest.raises(Refusal, match="--replicas 0"):
        deploy(builder, replicas=0, host="127.0.0.1", port=0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(Refusal, match=f"cannot listen on 127.0.0.1:{port}"):
            deploy(builder, replicas=2, host="127.0.0.1", port=port)
    gpus = torch.cuda.device_count()
    with pytest.raises(
        Refusal,
        match=f"2 replicas holding {gpus + 1} GPU each need {2 * gpus + 2} GPUs and "
        f"this machine has {gpus}",
    ):
        deploy(builder, replicas=2, host="127.0.0.1", port=0, num_gpus=gpus + 1)
    assert not ray.is_initialized()


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_two_replicas_answer_through_one_port_and_stream_in_pieces(tmp_path):
    import ray

    assert not ray.is_initialized()
    started = time.monotonic()
    served = deploy(functools.partial(small_app, tmp_path), replicas=2, host="127.0.0.1", port=0)
    print(f"two replicas ready in {time.monotonic() - started:.1f} s")
    try:
        assert served.port > 0 and served.url == f"http://127.0.0.1:{served.port}"
        assert ray.is_initialized()  # deploy started a local cluster of its own

        # Serve routes each request to the less busy of two replicas drawn at random: a few rounds
        # of concurrent requests reach both
        pids: dict[str, int] = {}
        with requests.Session() as http, ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                for reply in pool.map(
                    lambda _: http.get(f"{served.url}/who", timeout=30), range(8)
                ):
                    assert reply.status_code == 200, reply.text
                    body = reply.json()
                    # the app's lifespan ran in its replica
                    assert body["started_in"] == body["pid"]
                    assert (
                        pids.setdefault(reply.headers[REPLICA_HEADER], body["pid"]) == body["pid"]
                    )
                if len(pids) == 2:
                    break
        assert len(pids) == 2, pids
        assert len(set(pids.values())) == 2  # each replica is its own process with its own app
        # Ray's servers, Serve's controller, proxy and replicas: none beyond loopback
        ours = descendants(os.getpid())
        assert served.port in {int(address.split(":")[1], 16) for address in listening(ours)}
        wide = who_listens_beyond_loopback(ours)
        assert not wide, f"listening beyond loopback: {wide}"

        # a stream arrives event by event, in order, as the replica sends it
        arrivals = []
        with requests.post(
            f"{served.url}/echo", json={"text": "hi"}, stream=True, timeout=30
        ) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream")
            assert reply.headers[REPLICA_HEADER] in pids
            for piece in reply.iter_content(chunk_size=None):
                arrivals.append((time.monotonic(), piece.decode()))
        text = "".join(piece for _, piece in arrivals)
        assert text == "".join(f"data: hi {i}\n\n" for i in range(CHUNKS))
        assert len(arrivals) >= CHUNKS - 1
        # buffered, every piece would come at the end; streamed, they span the gaps between events
        assert arrivals[-1][0] - arrivals[0][0] > (CHUNKS - 1) * CHUNK_GAP_S / 2
    finally:
        served.shutdown()

    # each app was stopped
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(map(str, pids.values()))
    assert not ray.is_initialized()  # what deploy started, shutdown stopped
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.port), timeout=5).close()
    # the port is free for the next server (which reuses addresses, as all do)
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", served.port))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster the later tests share (starting one costs 5-15 s on 2 cores); deploy runs on
    it and must leave it running."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def test_a_replica_that_cannot_start_is_one_refusal_naming_why(ray_cluster):
    import ray

    with pytest.raises(
        Refusal, match="no checkpoint at /nowhere/model; give --model a model directory"
    ):
        deploy(app_that_cannot_start, replicas=1, host="127.0.0.1", port=0)
    assert ray.is_initialized()  # a cluster deploy did not start, it leaves running


def test_two_server_replicas_answer_the_openai_client_as_ster_generate(
    ray_cluster, tmp_path_factory
):
    """The real server (`ster serve`'s settings, each replica with its own toy model and engine)
    behind one port: every answer, from either replica, streamed or not, is `ster generate`'s."""
    toy = make_toy(tmp_path_factory)
    reference = cli_generate(
        f"--model={toy}", "--prompt=hello there", "--max-new-tokens=12", "--chat-template=on"
    )
    messages = [{"role": "user", "content": "hello there"}]

    started = time.monotonic()
    served = deploy_server(parse(["serve", f"--model={toy}", "--replicas=2"]))
    print(f"two server replicas ready in {time.monotonic() - started:.1f} s")
    try:
        client = openai.OpenAI(
            base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

        def ask(_):
            raw = client.chat.completions.with_raw_response.create(
                model=toy, messages=messages, max_tokens=12, temperature=0
            )
            return raw.headers[REPLICA_HEADER], raw.parse()

        replicas = set()
        with ThreadPoolExecutor(8) as pool:
            for _ in range(6):
                for replica, answer in pool.map(ask, range(8)):
                    assert answer.choices[0].message.content == reference["text"]
                    assert answer.usage.completion_tokens == reference["completion_tokens"]
                    replicas.add(replica)
                if len(replicas) == 2:
                    break
        assert len(replicas) == 2, replicas

        # a second deployment on this cluster is refused without touching the running one
        other = functools.partial(small_app, tmp_path_factory.mktemp("unused"))
        with pytest.raises(
            Refusal, match="a Serve application named ster already runs on this cluster"
        ):
            deploy(other, replicas=1, host="127.0.0.1", port=served.port)
        elsewhere = (
            f"Ray Serve already runs on this cluster with its proxy on 127.0.0.1:{served.port}"
        )
        with pytest.raises(Refusal, match=elsewhere):
            deploy(other, replicas=1, host="127.0.0.1", port=0, name="another")

        chunks = list(
            client.chat.completions.create(
                model=toy, messages=messages, max_tokens=12, temperature=0, stream=True
            )
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == reference["text"]
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference[
            "finish_reason"
        ]
    finally:
        served.shutdown()


@pytest.mark.slow
def test_the_command_serves_replicas_on_a_given_cluster_and_stops_on_sigterm(
    ray_cluster, tmp_path_factory
):
    """`ster serve --replicas 2 --address CLUSTER` as a user runs it: ready line, both replicas
    answering as `ster generate`, SIGTERM stopping the replicas (status 0, the result line) and
    leaving the cluster it was given running. (About 45 s on 2 cores: a process importing torch
    and Ray, then two model loads.)"""
    import ray

    toy = make_toy(tmp_path_factory)
    reference = cli_generate(
        f"--model={toy}", "--prompt=hello there", "--max-new-tokens=12", "--chat-template=on"
    )
    messages = [{"role": "user", "content": "hello there"}]
    server = ServeProcess(
        "--model", toy, "--replicas", "2", "--address", ray.get_runtime_context().gcs_address
    )
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
        )

        def ask(_):
            raw = client.chat.completions.with_raw_response.create(
                model=toy, messages=messages, max_tokens=12, temperature=0
            )
            return raw.headers[REPLICA_HEADER], raw.parse().choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            answers = [answer for _ in range(4) for answer in pool.map(ask, range(8))]
        assert {text for _, text in answers} == {reference["text"]}
        assert len({replica for replica, _ in answers}) == 2
    finally:
        status = server.stop()
    assert status == 0, "".join(server.stderr)[-3000:]
    assert {"served": toy, "replicas": 2} in [
        json.loads(line) for line in server.stderr if line.startswith("{")
    ]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    assert ray.cluster_resources().get("CPU") == 2  # the cluster it was given is still there

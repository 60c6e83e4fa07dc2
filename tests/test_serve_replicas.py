"""`ster serve --replicas N` (ster_dist.serve.replicas): N app replicas on a real local Ray cluster
behind Ray Serve's one proxy port.

The app here is a small FastAPI app (its lifespan stands for the server's model load), so these
tests see Serve's routing, streaming, startup failures and shutdown on their own; the server
proper is checked through the same path by the integration test further down.
"""

import asyncio
import contextlib
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ster_dist.errors import Refusal
from ster_dist.serve.replicas import REPLICA_HEADER, deploy

CHUNKS = 4
CHUNK_GAP_S = 0.4


def small_app():
    """Builds the test app in a replica: /who names the replica's process and what its lifespan
    set up; /echo streams CHUNKS server-sent events, CHUNK_GAP_S apart."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield {"started_in": os.getpid()}

    app = FastAPI(lifespan=lifespan)

    @app.get("/who")
    async def who(request: Request):
        await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap in a replica's queue
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


def test_zero_replicas_are_refused_before_ray_starts():
    import ray

    with pytest.raises(Refusal, match="--replicas 0"):
        deploy(small_app, replicas=0, host="127.0.0.1", port=0)
    assert not ray.is_initialized()


def test_two_replicas_answer_through_one_port_and_stream_in_pieces():
    import ray

    assert not ray.is_initialized()
    started = time.monotonic()
    served = deploy(small_app, replicas=2, host="127.0.0.1", port=0)
    print(f"two replicas ready in {time.monotonic() - started:.1f} s")
    try:
        assert served.port > 0 and served.url == f"http://127.0.0.1:{served.port}"
        assert ray.is_initialized()  # deploy started a local cluster of its own

        # Serve routes each request to the less busy of two replicas drawn at random: a few rounds
        # of concurrent requests reach both
        pids: dict[str, int] = {}
        with requests.Session() as http, ThreadPoolExecutor(8) as pool:
            for _ in range(8):
                for reply in pool.map(lambda _: http.get(f"{served.url}/who", timeout=30), range(8)):
                    assert reply.status_code == 200, reply.text
                    body = reply.json()
                    assert body["started_in"] == body["pid"]  # the app's lifespan ran in its replica
                    assert pids.setdefault(reply.headers[REPLICA_HEADER], body["pid"]) == body["pid"]
                if len(pids) == 2:
                    break
        assert len(pids) == 2, pids
        assert len(set(pids.values())) == 2  # each replica is its own process with its own app

        # a stream arrives event by event, in order, as the replica sends it
        arrivals = []
        with requests.post(f"{served.url}/echo", json={"text": "hi"}, stream=True, timeout=30) as reply:
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

    assert not ray.is_initialized()  # what deploy started, shutdown stopped
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.port), timeout=5).close()
    with socket.socket() as server:  # the port is free for the next server (which reuses addresses, as all do)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", served.port))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster the later tests share (starting one costs 5-15 s on 2 cores); deploy runs on
    it and must leave it running."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def test_a_replica_that_cannot_start_is_one_refusal_naming_why(ray_cluster):
    import ray

    with pytest.raises(Refusal, match="no checkpoint at /nowhere/model; give --model a model directory"):
        deploy(app_that_cannot_start, replicas=1, host="127.0.0.1", port=0)
    assert ray.is_initialized()  # a cluster deploy did not start, it leaves running

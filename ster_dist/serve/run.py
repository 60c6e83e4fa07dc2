"""`ster serve`: check the settings, load the model, listen, say so in one line, drain on SIGTERM.

The listening socket is bound before the model loads, so a taken port is refused at once; the
ready line `{"port":N,"ready":true}` is printed on stdout (the only line there) once the model is
loaded and the server accepts requests. SIGTERM or SIGINT stops accepting (new requests on open
connections get 503), lets the requests in flight finish for up to --drain-seconds, then exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import uvicorn

from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.schema.serve import ServeRequest, is_loopback
from ster_dist.serve.app import build_app
from ster_dist.serve.slow_clients import head_deadline
from ster_dist.serve.sockets import listen
from ster_dist.serve.state import ServerState


def check_exposure(request: ServeRequest) -> ServeRequest:
    """The key from STER_API_KEY when none is given; a non-loopback address refused without one."""
    if request.api_key is None and os.environ.get("STER_API_KEY"):
        request = request.model_copy(update={"api_key": os.environ["STER_API_KEY"]})
    if request.api_key is not None and not request.api_key.strip():
        raise Refusal(
            f"{request.label('api_key')} is empty; give a key clients will send as 'Authorization: "
            "Bearer KEY'"
        )
    key = request.api_key
    if key is not None and not (key.isascii() and key.isprintable() and key == key.strip()):
        # a header carries it as bytes of ASCII: any other key could never be matched, every request
        # a 401
        raise Refusal(
            f"{request.label('api_key')} must be printable ASCII with no space at either end (clients "
            "send it in an HTTP header); give another key"
        )
    if not is_loopback(request.host) and request.api_key is None:
        raise Refusal(
            f"{request.label('host')} {request.host} listens beyond this machine; give "
            f"{request.label('api_key')} KEY (or set STER_API_KEY) so only clients holding it are "
            "answered, or keep the default 127.0.0.1"
        )
    return request


def ready_line(port: int) -> None:
    sys.__stdout__.write(json.dumps({"port": port, "ready": True}, separators=(",", ":")) + "\n")
    sys.__stdout__.flush()


def serve(request: ServeRequest) -> dict:
    request = check_exposure(request)
    if request.replicas > 1:
        return _serve_replicas(request)
    sock = listen(request.host, request.port)
    state = None
    try:
        state = ServerState(request).start()
        app = build_app(state)
        server = _Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=int(request.drain_seconds) or None,
                timeout_keep_alive=5,
                http=head_deadline(request.read_seconds),
            ),
            state,
        )
        progress(
            f"serving {state.name} on http://{request.host}:{sock.getsockname()[1]}"
            + (f" with adapters {', '.join(state.adapters)}" if state.adapters else "")
        )
        server.run(sockets=[sock])
        stats = state.engine.stats() if state.engine is not None else {}
        return {
            "served": state.name,
            "requests": stats.get("requests", 0),
            "generated_tokens": stats.get("generated_tokens", 0),
        }
    finally:
        sock.close()
        if state is not None:
            state.close()


class _Server(uvicorn.Server):
    """uvicorn's server, printing the ready line once it accepts and marking the state draining on a
    signal (so requests still arriving on open connections are answered 503, not dropped)."""

    def __init__(self, config, state):
        super().__init__(config)
        self.state = state

    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        if self.started:
            ready_line(sockets[0].getsockname()[1])

    def handle_exit(self, sig, frame):
        self.state.draining = True
        progress("draining: finishing the requests in flight, then exiting")
        super().handle_exit(sig, frame)
        # uvicorn raises a caught SIGTERM again once it has stopped, which would kill the process
        # before the worker group is closed; a drained server exits on its own, with status 0
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]


def _serve_replicas(request: ServeRequest) -> dict:
    """N replicas behind one port (Ray Serve, serve/replica_server.py): each builds its own state
    (its own worker group, with tp x ep ranks as Ray actors when above 1) and app. The ready line
    comes once every replica is ready; SIGTERM or SIGINT shuts the deployment down, the replicas
    finishing their requests in flight for up to --drain-seconds."""
    import time

    from ster_dist.serve.replica_server import deploy_server

    # while the replicas load, a signal raises (KeyboardInterrupt, or SystemExit from the SIGTERM
    # handler ray.init installs), and deploy removes what it started before passing it on
    replicas = deploy_server(request)
    stop: list[int] = []
    # then plain Python handlers, set after ray.init's: they replace its SIGTERM handler, under
    # which the process aborts without shutting the replicas down. A list, not an Event: setting
    # an Event from a handler can deadlock on the lock its own wait holds
    previous = {
        sig: signal.signal(sig, lambda number, _: stop.append(number))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        progress(f"serving {request.name()} on {replicas.url} with {request.replicas} replicas")
        ready_line(replicas.port)
        while not stop:
            time.sleep(0.2)
        progress("draining: the replicas finish the requests in flight, then exit")
    finally:
        replicas.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return {"served": request.name(), "replicas": request.replicas}

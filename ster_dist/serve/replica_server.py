"""`ster serve --replicas N`'s server: the settings of one `ster serve` deployed as N replicas.

Each replica builds the whole server (serve/state.py's ServerState: its own job queue, model and
token engine; serve/app.py's app) in its constructor and closes it when Serve stops the replica.
The replica already runs inside the cluster, so its ranks (--tp above 1) are Ray actors of that
cluster whatever --address said, and a one-rank model runs in the replica's own process.
"""

from __future__ import annotations

import asyncio
import functools

from ster_dist.schema.serve import ServeRequest
from ster_dist.serve.replicas import ReplicaSet, deploy


def deploy_server(request: ServeRequest) -> ReplicaSet:
    """request.replicas copies of the server behind request.host:request.port, on the cluster at
    request.address (None: a local one). The caller has checked the key and the host."""
    # a model in the replica's own process needs the replica to hold its GPU; ranks hold their own
    one_rank_on_gpu = request.device == "cuda" and request.tp * request.ep == 1
    return deploy(
        functools.partial(server_app, request),
        replicas=request.replicas,
        host=request.host,
        port=request.port,
        address=request.address,
        num_gpus=1.0 if one_rank_on_gpu else 0.0,
        max_ongoing_requests=request.max_queue,
        drain_s=request.drain_seconds,
    )


def server_app(request: ServeRequest):
    """Run in each replica: load the model, start the engine, and return the server's app."""
    from ster_dist.serve.app import build_app
    from ster_dist.serve.state import ServerState

    state = ServerState(request.model_copy(update={"address": None}))
    try:
        return _ClosesState(build_app(state.start()), state)
    except BaseException:
        state.close()
        raise


class _ClosesState:
    """The server's app with a lifespan whose shutdown closes its state (engine, job queue,
    ranks)."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # the model loaded when the app was built
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self.state.close)
                await send({"type": "lifespan.shutdown.complete"})
                return

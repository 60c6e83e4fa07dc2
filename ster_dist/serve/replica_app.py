"""What one Ray Serve replica runs: the app it builds, started here, answering with the replica's
id.

The app's lifespan (where the server loads its model and starts its engine) is run here rather than
by Serve, because Serve turns any startup failure into "ASGI lifespan startup failed"; run here, a
failing startup raises its own exception (a Refusal naming the model, say), which becomes the
replica's constructor error and so the message `deploy` reports. Serve then drives only the
wrapper's lifespan: startup is already done, shutdown runs the app's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

ASGIApp = Callable[..., Any]  # an ASGI application: async (scope, receive, send) -> None

REPLICA_HEADER = "x-ster-replica"


class Lifespan:
    """An ASGI app's lifespan protocol, run by hand: start() returns once the app has started or
    raises what its startup raised; stop() runs its shutdown."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.state: dict = {}  # what the app's lifespan yields, copied into every request's scope
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Future | None = None

    async def start(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.0"},
            "state": self.state,
        }
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        await self._expect("lifespan.startup.complete")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._expect("lifespan.shutdown.complete")
        await self._task

    async def _expect(self, wanted: str) -> None:
        reply = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait({reply, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done() and reply.result()["type"] == wanted:
            return
        # a failing app sends "...failed" and then raises: raise its own exception when it has one
        message = reply.result().get("message", "") if reply.done() else ""
        reply.cancel()
        await asyncio.wait({self._task})
        if self._task.exception() is not None:
            raise self._task.exception()
        raise RuntimeError(f"the app's lifespan did not answer {wanted}: {message or 'it ended'}")


class ReplicaApp:
    """The ASGI app Serve sees in one replica: the built app, started, tagging every response."""

    def __init__(self, app: ASGIApp, lifespan: Lifespan, replica: str):
        self.app = app
        self.lifespan = lifespan
        self.replica = replica.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._serve_lifespan(receive, send)
        # as uvicorn does: each request sees a copy of what the app's lifespan yielded
        scope = {**scope, "state": {**scope.get("state", {}), **self.lifespan.state}}
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_tagged)

    async def _serve_lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # the app started before Serve asked
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.lifespan.stop()
                except Exception as exc:
                    await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.shutdown.complete"})
                return


async def build_replica_app(app_builder: Callable[[], ASGIApp]) -> ReplicaApp:
    """Build and start the app in this replica (called from the replica's constructor)."""
    from ray import serve

    app = app_builder()
    lifespan = Lifespan(app)
    await lifespan.start()
    return ReplicaApp(app, lifespan, serve.get_replica_context().replica_tag)

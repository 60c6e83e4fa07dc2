"""Server-sent events as a plain ASGI answer, the status line and headers going out with the first
event.

Why not Starlette's StreamingResponse: it sends the headers at once, so the client wakes, reads them
and waits again while the engine computes the first token, and on a machine with as many cores as
the engine's threads that client takes a core from the step it is waiting for. Here the client wakes
once, for the first token, and the answer runs as one coroutine beside one task that waits for the
client's disconnect (no task group per answer). An `ApiError` raised before the first event (a
refusal at submission) is answered as the plain error it is, with its status; after it, the events
generator reports failures in the stream itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from ster_dist.serve.errors import ApiError

EVENT_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def until_disconnect(receive) -> None:
    """Returns when the client has gone (its request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_events(events: AsyncGenerator[str, None], receive, send) -> None:
    """Each text `events` yields as one event; a client that leaves stops the wait for the next one,
    and the generator is closed either way (its own cleanup cancels its engine requests)."""
    answer = asyncio.current_task()
    left = asyncio.Event()

    async def watch() -> None:
        await until_disconnect(receive)
        left.set()
        answer.cancel()

    watcher = asyncio.ensure_future(watch())
    # the watcher parks on receive() now, before the first event submits the step
    await asyncio.sleep(0)
    try:
        await _send_each(events, send)
    except asyncio.CancelledError:
        if not left.is_set():
            raise  # cancelled from outside (the server stopping)
        answer.uncancel()
    finally:
        watcher.cancel()
        await events.aclose()


async def _send_each(events: AsyncGenerator[str, None], send) -> None:
    started = False
    try:
        async for event in events:
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": EVENT_HEADERS})
                started = True
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
    except ApiError as error:
        if started:
            raise
        return await error.send(send)
    if not started:
        await send({"type": "http.response.start", "status": 200, "headers": EVENT_HEADERS})
    await send({"type": "http.response.body", "body": b"", "more_body": False})

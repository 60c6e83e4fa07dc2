"""Deadlines on what a client sends: a connection that has not sent a whole request head within the
deadline is closed, and a body not whole within it again is answered 408 (serve/app.py's guard).

uvicorn's HTTP/1.1 protocols time a connection only between requests (its keep-alive timeout,
restarted by every byte), so a client that sends a head a byte at a time, or never finishes it, held
its connection for ever: a few thousand such clients use up the process's file descriptors, and no
request is answered after that.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.auto import AutoHTTPProtocol


def head_deadline(seconds: float) -> type[asyncio.Protocol]:
    """The protocol uvicorn would pick (httptools' parser where it is installed, else h11's),
    closing a connection whose request head is not whole `seconds` after the connection opened or
    its last answer ended."""

    class HeadDeadline(AutoHTTPProtocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:  # httptools' parser calls it once a head is whole
            super().on_headers_complete()
            self._disarm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            conn = getattr(self, "conn", None)  # h11's state machine: past IDLE, the head is whole
            if conn is not None and conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self.head_timer = self.loop.call_later(seconds, self._late)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _late(self) -> None:
            self.head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline

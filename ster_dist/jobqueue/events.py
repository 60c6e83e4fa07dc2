"""Progress events of running jobs: what an operation prints on stderr, kept per job.

Operations report progress as NDJSON lines on stderr (ster_dist.events.progress). The
job queue runs them on its executor thread; while it does, this module's stderr wrapper
routes that thread's lines into the running job's event log (and on to the real stderr when
asked), so a caller polling the job queue, in this process or through the Ray actor, gets the
same events `ster generate` would have printed. Other threads' writes pass through untouched.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable

from ster_dist.events import StreamWrapper, as_event


class _ThreadTee(StreamWrapper):
    def __init__(self, original):
        super().__init__(original)
        self.sinks: dict[int, Callable[[str], None]] = {}
        self._partial: dict[int, str] = {}

    def write(self, text: str) -> int:
        ident = threading.get_ident()
        sink = self.sinks.get(ident)
        if sink is None:
            return self.original.write(text)
        buffered = self._partial.get(ident, "") + text
        *lines, rest = buffered.split("\n")
        self._partial[ident] = rest
        for line in lines:
            if line.strip():
                sink(line)
        return len(text)


_LOCK = threading.Lock()


def capture(sink: Callable[[dict], None]) -> Callable[[], None]:
    """Send this thread's stderr lines to sink (as event dicts) until the returned callable is
    called."""
    with _LOCK:
        if not isinstance(sys.stderr, _ThreadTee):
            sys.stderr = _ThreadTee(sys.stderr)
        tee = sys.stderr
    ident = threading.get_ident()

    def on_line(line: str) -> None:
        sink(as_event(line))

    tee.sinks[ident] = on_line

    def stop() -> None:
        tee.sinks.pop(ident, None)
        tee._partial.pop(ident, None)

    return stop


def event(message: str, **fields) -> dict:
    return {"event": "queue", "time": round(time.time(), 3), "message": message, **fields}


def emit(event_: dict, stream=None) -> None:
    """One NDJSON line on the real stderr (not the job capture)."""
    stream = stream or sys.stderr
    if isinstance(stream, _ThreadTee):
        stream = stream.original
    print(json.dumps(event_, ensure_ascii=False), file=stream, flush=True)

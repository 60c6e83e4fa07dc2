"""Progress events: one JSON object per line on stderr, what every operation reports as it goes.

The job queue routes a running job's lines into that job's event log (sched/events.py), so a caller
polling the queue, in this process or through the Ray actor, sees what the command line would show.
"""

from __future__ import annotations

import json
import sys
import time


def progress(message: str, **fields) -> None:
    print(json.dumps({"event": "progress", "time": round(time.time(), 3), "message": message, **fields},
                     ensure_ascii=False), file=sys.stderr, flush=True)


def as_event(line: str) -> dict:
    """A line of stderr as an event: itself when it is one, else a log event carrying it."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        event = {"event": "log", "time": round(time.time(), 3), "message": line}
    return event

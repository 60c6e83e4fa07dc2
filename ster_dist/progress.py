"""Progress lines: one NDJSON object per event on stderr, the shape every command prints.

Lower modules (adapters, steering, training) report progress here instead of reaching up into
commands/; the job queue's stderr tee (sched/events.py) routes the lines per job all the same,
since it reads sys.stderr when each line is written.
"""

from __future__ import annotations

import json
import sys
import time


def progress(message: str, **fields) -> None:
    print(json.dumps({"event": "progress", "time": round(time.time(), 3), "message": message, **fields}),
          file=sys.stderr, flush=True)

"""A command line's request run as a job of a job queue in this process: how `ster generate` and
the other job commands go through the same front door as job specs and the Python API."""

from __future__ import annotations

import sys

from ster_dist import protocol
from ster_dist.errors import JobFailed, Refusal
from ster_dist.jobqueue import events
from ster_dist.jobqueue.follow import follow
from ster_dist.jobqueue.queue import JobQueue, running
from ster_dist.schema import Request


def run_cli(request: Request) -> tuple[dict, int]:
    """A command line's typed request run as a job through a job queue in this process: how the
    command line goes through the same front door as the API and Ray jobs. Progress events go to
    stderr as the command's own would; a failed job raises JobFailed with its exit status; a
    finished one returns (its result, its exit status: parity's 1 when it fails).
    A queue already running in this process (an Engine's) takes the job; else one is started for
    it and closed after (an interrupt closes it at once, with its worker groups)."""
    if request.kind is None:
        raise Refusal(f"`ster {' '.join(request.command)}` is not a job kind the job queue runs")
    current = running()
    own = None if current is not None else JobQueue(None, address=getattr(request, "address", None))
    queue = own.start() if own is not None else current
    queue.pool.prepare(
        int(getattr(request, "tp", 1))
        * int(getattr(request, "ep", 1))
        * int(getattr(request, "pp", 1))
    )
    interrupted = False
    try:
        ids = queue.submit_jobs([protocol.job_from_request(request)])
        (record,) = follow(queue, ids, on_event=_cli_event)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if own is not None:
            own.close(timeout=0 if interrupted else 600)
    if record["status"] != "done":
        raise JobFailed(record["error"], record["exit_code"] or 2)
    return record["result"], record["exit_code"]


def _cli_event(event_: dict) -> None:
    """A job's event on a command line's stderr: the command's own progress, and the job queue's
    only where it says something happened (a retry, an error), not its bookkeeping."""
    if event_.get("event") == "queue" and not event_.get("notice"):
        return
    if event_.get("event") == "text":  # generate --stream: the answer itself, on the real stdout
        sys.__stdout__.write(event_["text"])
        sys.__stdout__.flush()
        return
    events.emit({k: v for k, v in event_.items() if k != "job"})

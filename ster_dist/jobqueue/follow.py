"""Following jobs to their end: progress events streamed as they come, result records collected,
from any client of a job queue (the queue itself, a LocalClient, a RayClient)."""

from __future__ import annotations

import time
from collections.abc import Callable

from ster_dist import protocol


def follow(
    client,
    ids: list[str],
    on_event: Callable[[dict], None] | None = None,
    timeout: float | None = None,
) -> list[dict]:
    """Stream every job's events to on_event until all have results; the result records, in
    order."""
    cursors = {job_id: 0 for job_id in ids}
    results: dict[str, dict] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(results) < len(ids):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(ids) - len(results)} job(s) did not finish within {timeout} s"
            )
        replies = client.poll_many({i: cursors[i] for i in ids if i not in results}, 1.0)
        for job_id, reply in replies.items():
            cursors[job_id] = reply["cursor"]
            if on_event is not None:
                for event in reply["events"]:
                    on_event({**event, "job": job_id})
            if reply["result"] is not None:
                results[job_id] = protocol.check_result(reply["result"])
    return [results[job_id] for job_id in ids]


def stopped_waiting(exc: TimeoutError, local: bool) -> str:
    """A submitter's --timeout, run out: what that means for the jobs, in one line."""
    where = (
        "the in-process job queue stopped with this command, without waiting for its running job (jobs "
        "not finished stay accepted in its --state journal, if one was given)"
        if local
        else "the jobs go on in the cluster's job queue"
    )
    return (
        f"{exc}; stopped waiting (--timeout): {where}; a job spec's timeout_s is what fails a job "
        "that runs too long"
    )

"""submit, queue: the command line's way into the job queue."""

from __future__ import annotations

from typing import Literal

from ster_dist.schema.base import Request, field


class SubmitRequest(Request):
    command = ("submit",)
    summary = "submit job specs to the job queue (a Ray job, or --local)"

    specs: list[str] = field(
        help="job spec files (JSON or YAML; see jobs/examples)",
        min_length=1,
        cli={"positional": True, "nargs": "+"},
    )
    address: str | None = field(
        None,
        help="the Ray job server, http://HEAD:8265 (default RAY_API_SERVER_ADDRESS, else local)",
    )
    local: bool = field(False, help="run through an in-process job queue, no Ray")
    state: str | None = field(None, help="the job queue's state directory (journal) when it starts")
    no_wait: bool = field(False, help="print the submission id and return")
    timeout: float | None = field(None, gt=0, help="stop waiting after this many seconds")
    python: str | None = field(
        None,
        help="the Python on the cluster's nodes (default: this one's path, as on "
        "a one-machine cluster)",
    )


class QueueRequest(Request):
    command = ("queue",)
    summary = "the cluster's job-queue actor: status, stop, cancel jobs, or read a journal"

    action: Literal["status", "stop", "cancel", "journal"] = field(
        help="what to do", cli={"positional": True}
    )
    jobs: list[str] = field(
        [], help="cancel: the ids of the jobs to cancel", cli={"positional": True, "nargs": "*"}
    )
    address: str | None = field(None, help="the Ray cluster, HOST:PORT (default RAY_ADDRESS)")
    state: str | None = field(None, help="journal: the state directory to read")


class RunJobsRequest(Request):
    """jobs/run.py, the `ray job submit` entrypoint."""

    command = ("run-jobs",)
    summary = "run job specs through the job queue (the entrypoint of `ray job submit`)"

    specs: list[str] = field(
        help="job spec files (JSON or YAML), or msgpack:<base64>",
        min_length=1,
        cli={"positional": True, "nargs": "+"},
    )
    address: str | None = field(
        None, help="the Ray cluster (default RAY_ADDRESS, set inside a Ray job)"
    )
    local: bool = field(False, help="an in-process job queue, no Ray (for trying a spec)")
    state: str | None = field(
        None, help="the job queue's state directory (its journal), when it starts"
    )
    idle_s: float = field(300.0, gt=0, help="release a worker group idle this long")
    max_retries: int = field(2, ge=0, help="retries of a job whose worker died")
    job_timeout: float | None = field(
        None,
        gt=0,
        help="fail a job that runs longer than this many seconds and go "
        "on to the next (a spec's timeout_s overrides it)",
    )
    keep_finished: int = field(
        10000,
        ge=0,
        help="finished jobs the job queue keeps in memory (the oldest are "
        "dropped past this; the journal keeps them)",
    )
    timeout: float | None = field(None, gt=0, help="give up waiting after this many seconds")

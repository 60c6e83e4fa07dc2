"""submit, queue: the command line's way into the job queue.

`ster submit SPEC...` is a thin wrapper over Ray job submission: it validates the specs here
(a malformed one is refused before anything is sent), submits `python jobs/run.py
msgpack:<specs>` with this source tree as the working directory, re-emits the job's progress
lines as NDJSON on stderr and returns its result record(s). `--local` runs the specs through
an in-process job queue instead (Ctrl-C or SIGTERM cancels its jobs). `ster queue
status|stop|cancel|journal` looks after the cluster's job-queue actor and reads a journal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import time
from pathlib import Path

from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.schema.jobs import QueueRequest, SubmitRequest

ROOT = Path(__file__).resolve().parent.parent.parent
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def submit(request: SubmitRequest) -> tuple[dict, int]:
    """(the result record, or {"jobs": [...]} for several; the worst exit status among them)."""
    from ster_dist.jobqueue.client import with_ids
    from ster_dist.jobqueue.entry import read_specs

    specs = with_ids(read_specs(request.specs))
    if request.local:
        return _local(request, specs)
    return _ray_job(request, specs)


def _local(request: SubmitRequest, specs: list[dict]) -> tuple[dict, int]:
    from ster_dist.jobqueue.client import LocalClient
    from ster_dist.jobqueue.entry import ranks_of
    from ster_dist.jobqueue.events import emit
    from ster_dist.jobqueue.follow import follow, stopped_waiting
    from ster_dist.jobqueue.queue import JobQueue
    from ster_dist.jobqueue.signals import cancelled_on_signals

    queue = JobQueue(request.state).start()
    # Ray, when a job needs ranks, is started here on the main thread: started from the queue's
    # executor thread it outlived the queue's shutdown and the command hung on exit
    queue.pool.prepare(max(ranks_of(spec) for spec in specs))
    client = LocalClient(queue)
    waited_out = False
    try:
        if request.no_wait:
            raise Refusal("--no-wait needs a cluster: a --local queue ends with this command")
        ids = client.submit_many(specs)
        with cancelled_on_signals(queue, ids):
            records = follow(client, ids, on_event=emit, timeout=request.timeout)
    except TimeoutError as exc:
        # the command ends now: never wait on for the job that outlasted --timeout
        waited_out = True
        raise Refusal(stopped_waiting(exc, local=True)) from None
    finally:
        client.close(wait=not waited_out)
    return _outcome(records)


def _outcome(records: list[dict]) -> tuple[dict, int]:
    for record in records:
        if record["status"] in ("failed", "cancelled"):
            progress(f"job {record['id']} ({record['kind']}) {record['status']}: {record['error']}")
    return records[0] if len(records) == 1 else {"jobs": records}, max(
        [r["exit_code"] for r in records] + [0]
    )


def job_server(address: str | None) -> str:
    address = (
        address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or ""
    )
    if not address.startswith(("http://", "https://")):
        address = "http://127.0.0.1:8265"
    return address


def server_answers(url: str, timeout: float = 5.0) -> bool:
    """Whether a Ray job server answers at url. Asked plainly over HTTP first: the SDK's client,
    given a server that is not up, goes looking for other clusters on this machine instead. A
    server that answers 401 or 403 (Ray's token authentication) is refused saying how to give the
    token, not reported absent."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url.rstrip('/')}/api/version", headers=ray_auth_headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status == 200
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            given = "was refused" if "Authorization" in request.headers else "was not given"
            raise Refusal(
                f"the Ray job server at {url} answered {exc.code}: it needs Ray's authentication token, "
                f"which {given}; set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token> (or "
                "RAY_AUTH_TOKEN_PATH, or put it in ~/.ray/auth_token) and submit again"
            ) from None
        return False
    except (urllib.error.URLError, OSError, ValueError):
        return False


def ray_auth_headers() -> dict:
    """The Authorization header Ray's own clients send under RAY_AUTH_MODE=token: the token of
    RAY_AUTH_TOKEN, else of the file RAY_AUTH_TOKEN_PATH names, else of ~/.ray/auth_token; else
    none."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return {}
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        with contextlib.suppress(OSError):
            token = path.read_text(encoding="utf-8", errors="replace")[:4096].strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _ray_job(request: SubmitRequest, specs: list[dict]) -> tuple[dict, int]:
    import sys

    from ray.job_submission import JobSubmissionClient

    from ster_dist.jobqueue.entry import anchor, inline

    if not (ROOT / "jobs" / "run.py").is_file():
        raise Refusal(
            f"ster submit needs the ster_dist source tree (jobs/run.py) beside the package, not found "
            f"under {ROOT}; run it from a checkout, or use `ray job submit` yourself"
        )
    address = job_server(request.address)
    if not server_answers(address):
        raise Refusal(
            f"no Ray job server answers at {address}; start a cluster (docs/runbook.md) or give "
            "--address http://HEAD:8265"
        )
    try:
        client = JobSubmissionClient(address)
    # the SDK raises ConnectionError, RuntimeError, ... for an absent server
    except Exception as exc:
        raise Refusal(
            f"no Ray job server answers at {address}: {str(exc).splitlines()[0] if str(exc) else exc}; "
            "start a cluster (docs/runbook.md) or give --address http://HEAD:8265"
        ) from None
    # local paths resolved here, on the submitting machine: a git-ignored directory (models/) is not
    # in
    # the working directory Ray uploads, and a relative path would then be read as a Hub id there
    specs = anchor(specs, Path.cwd())
    # this interpreter unless told: a bare `python` on the nodes is whatever their PATH finds first
    python = shlex.quote(request.python or sys.executable)
    entrypoint = f"{python} jobs/run.py {inline(specs)}"
    if request.state:
        entrypoint += f" --state {shlex.quote(request.state)}"
    # the SDK logs its packaging of the working directory as plain text; stderr here is NDJSON
    for name in (
        "ray",
        "ray.dashboard.modules.dashboard_sdk",
        "ray.dashboard.modules.job.sdk",
        "ray._private.runtime_env.packaging",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    submission = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": str(ROOT)})
    progress(f"submitted Ray job {submission} to {address}", jobs=[s["id"] for s in specs])
    if request.no_wait:
        return {
            "submission_id": submission,
            "address": address,
            "jobs": [s["id"] for s in specs],
        }, 0
    return _follow_job(request, client, submission)


def _follow_job(request: SubmitRequest, client, submission: str) -> tuple[dict, int]:
    from ster_dist.jobqueue.events import as_event, emit

    deadline = None if request.timeout is None else time.monotonic() + request.timeout
    seen, result, last_text = 0, None, ""
    while True:
        status = str(client.get_job_status(submission)).split(".")[-1]
        logs = client.get_job_logs(submission)
        complete = logs[seen:].rpartition("\n")
        if complete[1]:
            seen += len(complete[0]) + 1
            for line in complete[0].splitlines():
                record = _record(line)
                if record is not None:
                    result = record
                elif line.strip():
                    emit(as_event(line))
                    last_text = line if not line.lstrip().startswith("{") else last_text
        if status in TERMINAL:
            break
        if deadline is not None and time.monotonic() > deadline:
            raise Refusal(
                f"Ray job {submission} did not finish within {request.timeout} s; it keeps running "
                f"(`ray job logs {submission}`)"
            )
        time.sleep(0.5)
    if result is not None:
        records = result.get("jobs", [result])
        return _outcome(records)
    info = client.get_job_info(submission)
    raise Refusal(last_text.strip() or f"Ray job {submission} ended {status}: {info.message}")


def _record(line: str):
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if isinstance(data, dict) and (
        "jobs" in data or ("status" in data and "kind" in data and "id" in data)
    ):
        return data
    return None


# ---- the job queue actor -----------------------------------------------------------------------


def _actor(request):
    from ster_dist.jobqueue.actor import existing
    from ster_dist.workers.ray_group import start_ray

    if not (request.address or os.environ.get("RAY_ADDRESS")):
        raise Refusal(
            "give --address HOST:PORT (or RAY_ADDRESS): the job queue lives on a running Ray cluster"
        )
    start_ray(request.address)
    actor = existing()
    if actor is None:
        raise Refusal(
            "no ster job queue runs on this cluster (one starts with the first submitted job)"
        )
    return actor


def queue_action(request: QueueRequest) -> dict:
    from ster_dist import protocol

    if request.action == "journal":
        return _journal(request.state)
    if (request.action == "cancel") != bool(request.jobs):
        raise Refusal(
            "`ster queue cancel` takes the ids of the jobs to cancel; status, stop and journal take none"
            if request.jobs
            else "give the ids of the jobs to cancel: ster queue cancel JOB [JOB ...]"
        )
    import ray

    actor = _actor(request)
    if request.action == "status":
        return protocol.unpack(ray.get(actor.stats.remote(), timeout=60))
    if request.action == "cancel":
        replies = [
            protocol.unpack(ray.get(actor.cancel.remote(job_id), timeout=60))
            for job_id in request.jobs
        ]
        for reply in replies:
            if "refusal" in reply:
                raise Refusal(reply["refusal"])
        return replies[0] if len(replies) == 1 else {"jobs": replies}
    ray.get(actor.shutdown.remote(), timeout=600)
    ray.kill(actor, no_restart=True)
    return {"stopped": True}


def _journal(state: str | None) -> dict:
    from ster_dist.jobqueue.actor import default_state_dir
    from ster_dist.jobqueue.journal import lost_line, read

    directory = state or default_state_dir()
    journal = read(directory)
    jobs = [
        {
            "id": job_id,
            "kind": e.spec.get("kind"),
            "attempts": e.attempts,
            "status": (e.result or {}).get("status", "pending"),
            "error": (e.result or {}).get("error"),
        }
        for job_id, e in journal.entries.items()
    ]
    jobs += [
        {"id": job_id, "kind": None, "attempts": 0, "status": "lost", "error": lost_line([job_id])}
        for job_id in journal.lost
    ]
    report = {"state": str(directory), "jobs": jobs}
    if journal.skipped:
        report["unreadable"] = {
            "records": journal.skipped,
            "bytes": journal.skipped_bytes,
            "lost_jobs": journal.lost,
        }
        progress(
            f"the journal has {journal.skipped} unreadable record(s)"
            + (f"; {lost_line(journal.lost)}" if journal.lost else "")
        )
    return report

"""The job runner behind `jobs/run.py` (the `ray job submit` entrypoint) and `ster submit --local`:
read specs, hand them to a job queue, stream progress as NDJSON on stderr, print the result
record(s) as one JSON line on stdout, and exit 0 (all done), 1 (a job failed) or 2 (refused).

A SPEC argument is a JSON or YAML file (one spec, a list, or {"jobs": [...]}) or
`msgpack:<base64>`, which is how `ster submit` passes specs inline so that they need not be
inside the uploaded working directory.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fnmatch
import json
import os
import sys
from pathlib import Path

from ster_dist import protocol
from ster_dist.errors import Refusal
from ster_dist.inputs import INPUT_FIELDS
from ster_dist.jobqueue.events import emit
from ster_dist.schema.jobs import RunJobsRequest

INLINE = "msgpack:"


def inline(specs: list[dict]) -> str:
    return INLINE + base64.urlsafe_b64encode(protocol.pack(specs)).decode("ascii")


def read_specs(arguments: list[str]) -> list[dict]:
    specs: list[dict] = []
    for argument in arguments:
        if argument.startswith(INLINE):
            try:
                data = protocol.unpack(
                    base64.urlsafe_b64decode(argument[len(INLINE) :]), "inline job spec"
                )
            except (binascii.Error, ValueError):
                raise Refusal("the inline job spec is not base64 msgpack") from None
            specs += data if isinstance(data, list) else [data]
        else:
            specs += protocol.load_spec_file(argument)
    for spec in specs:
        protocol.validate(spec)  # every one refused here, before any is sent or any model touched
    return specs


def anchor(specs: list[dict], base: Path) -> list[dict]:
    """Relative paths that name something under `base` (the job's working directory: the uploaded
    tree) made absolute: the job queue actor's own working directory may be an older upload."""
    out = []
    for spec in specs:
        spec = dict(spec)
        for name, value in spec.items():
            if (
                name not in protocol.PROTOCOL_FIELDS
                and isinstance(value, str)
                and value
                and not os.path.isabs(value)
                and len(value) < 4096
                and (base / value).exists()
            ):
                spec[name] = str((base / value).resolve())
        out.append(spec)
    return out


def check_uploaded(specs: list[dict], base: Path) -> None:
    """Refuse a relative input path that is not in the job's working directory because Ray left it
    out of the upload (it skips what the tree's .gitignore lists: models/ here), rather than read it
    as a Hub id there."""
    ignored = _ignored_patterns(base)
    if not ignored:
        return
    for spec in specs:
        for name in INPUT_FIELDS:
            value = spec.get(name)
            if (
                not isinstance(value, str)
                or not value
                or os.path.isabs(value)
                or (base / value).exists()
            ):
                continue
            parts = Path(value).parts
            if any(
                fnmatch.fnmatchcase(parts[0], p) or fnmatch.fnmatchcase(value, p) for p in ignored
            ):
                raise Refusal(
                    f"job {spec.get('id', '?')}: {name} {value!r} is not inside the uploaded working "
                    f"directory {base} (.gitignore keeps {parts[0]}/ out of Ray's upload); give an absolute "
                    "path the cluster's nodes can read, or submit with `ster submit`, which resolves "
                    "local paths on the submitting machine"
                )


def _ignored_patterns(base: Path) -> list[str]:
    try:
        lines = (
            (base / ".gitignore").read_text(encoding="utf-8", errors="replace").splitlines()[:10000]
        )
    except OSError:
        return []
    return [
        line.strip().strip("/")
        for line in lines
        if line.strip() and not line.lstrip().startswith(("#", "!"))
    ]


def run(client, specs: list[dict], out=None, timeout: float | None = None, signals=None) -> int:
    """Submit, follow, print; the exit status. `signals(ids)`: a context cancelling the jobs on
    Ctrl-C / SIGTERM (an in-process queue's; a cluster's jobs outlive the submitter)."""
    from ster_dist.jobqueue.follow import follow

    out = out or sys.stdout
    ids = client.submit_many(specs)
    with signals(ids) if signals is not None else contextlib.nullcontext():
        records = follow(client, ids, on_event=emit, timeout=timeout)
    print(
        json.dumps(records[0] if len(records) == 1 else {"jobs": records}, ensure_ascii=False),
        file=out,
        flush=True,
    )
    for record in records:
        if record["status"] in ("failed", "cancelled"):
            print(
                f"job {record['id']} ({record['kind']}) {record['status']}: {record['error']}",
                file=sys.stderr,
                flush=True,
            )
    return max([r["exit_code"] for r in records] + [0])


def run_jobs(request: RunJobsRequest) -> int:
    """jobs/run.py: the specs through the cluster's job-queue actor (or an in-process one with
    `local`); the exit status."""
    try:
        specs = anchor(read_specs(request.specs), Path.cwd())
        check_uploaded(specs, Path.cwd())
        options = {
            "idle_s": request.idle_s,
            "max_retries": request.max_retries,
            "job_timeout": request.job_timeout,
            "keep_finished": request.keep_finished,
        }
        if request.local:
            from ster_dist.jobqueue.client import LocalClient
            from ster_dist.jobqueue.queue import JobQueue

            queue = JobQueue(request.state, **options).start()
            queue.pool.prepare(max(ranks_of(spec) for spec in specs))
            client = LocalClient(queue)
            from ster_dist.jobqueue.signals import cancelled_on_signals

            signals = lambda ids: cancelled_on_signals(queue, ids)  # noqa: E731
        else:
            from ster_dist.jobqueue.client import RayClient

            client = RayClient(request.address, request.state, options)
            signals = None
        waited_out = False
        try:
            return run(client, specs, timeout=request.timeout, signals=signals)
        except TimeoutError as exc:
            from ster_dist.jobqueue.follow import stopped_waiting

            waited_out = True
            raise Refusal(stopped_waiting(exc, request.local)) from None
        finally:
            client.close(wait=not waited_out)
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr, flush=True)
        return getattr(refusal, "exit_code", 2)


def ranks_of(spec: dict) -> int:
    """How many ranks a spec's job runs on (tp x ep x pp x dp): whether Ray must be started
    first."""
    request = protocol.validate(spec, check_model=False).request
    return (
        int(getattr(request, "tp", 1))
        * int(getattr(request, "ep", 1))
        * int(getattr(request, "pp", 1))
        * int(getattr(request, "dp", 1))
    )

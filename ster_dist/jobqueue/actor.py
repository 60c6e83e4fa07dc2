"""The job queue as a named, detached Ray actor: one per cluster, found or started by whoever
submits first (`jobs/run.py` under `ray job submit`, `ster submit`, Engine(address=...)).

It lives on the head node (where its journal is), asks for no CPU (its worker groups are
their own actors, placed by Ray on the nodes that have the resources), and Ray restarts it
if its process dies: the new process replays the journal and finishes every accepted job.
Calls carry msgpack (ster_dist.protocol) and refusals come back as values, never as Ray
exceptions. Clients give each job an id before sending it, so a call Ray retries after a
restart cannot queue a job twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from ster_dist import protocol
from ster_dist.errors import Refusal

ACTOR_NAME = "ster_job_queue"
NAMESPACE = "ster"


def default_state_dir() -> str:
    return os.environ.get("STER_STATE_DIR") or str(
        Path.home() / ".cache" / "ster_dist" / "job_queue"
    )


class JobQueueActor:
    def __init__(self, state_dir: str, options: dict):
        import ray

        from ster_dist.jobqueue.queue import JobQueue

        address = ray.get_runtime_context().gcs_address
        self.queue = JobQueue(state_dir, address=address, **options).start()

    def submit_many(self, packed: bytes) -> bytes:
        try:
            specs = protocol.unpack(packed, "job spec list")
            if not isinstance(specs, list):
                raise Refusal("the job queue takes a list of job specs")
            return protocol.pack({"ids": self.queue.submit_many(specs)})
        except Refusal as refusal:
            return protocol.pack({"refusal": str(refusal)})

    def poll_many(self, cursors: dict, timeout: float) -> bytes:
        try:
            return protocol.pack(self.queue.poll_many(cursors, min(timeout, 30.0)))
        except Refusal as refusal:
            return protocol.pack({"refusal": str(refusal)})

    def cancel(self, job_id: str) -> bytes:
        """Cancel a job (jobqueue/queue.py JobQueue.cancel): its id and state after the call."""
        try:
            return protocol.pack(self.queue.cancel(job_id))
        except Refusal as refusal:
            return protocol.pack({"refusal": str(refusal)})

    def stats(self) -> bytes:
        return protocol.pack({**self.queue.stats(), "pid": os.getpid()})

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> bool:
        """Release every worker group and stop the queue (accepted jobs stay in the journal)."""
        self.queue.close()
        return True


def find_or_start(state_dir: str | None = None, options: dict | None = None):
    """The cluster's job-queue actor (started here when there is none yet). Needs ray.init first."""
    import ray

    cls = ray.remote(JobQueueActor)
    # "node:__internal_head__" pins it to the head node, whose disk holds the journal across
    # restarts
    return cls.options(
        name=ACTOR_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        max_concurrency=64,
        resources={"node:__internal_head__": 0.001},
    ).remote(state_dir or default_state_dir(), options or {})


def existing():
    """The cluster's job-queue actor, or None."""
    import ray

    try:
        return ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None

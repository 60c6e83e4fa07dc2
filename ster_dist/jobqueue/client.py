"""Talking to a job queue: in this process (LocalClient) or the cluster's actor (RayClient); both
answer jobqueue/follow.py's `follow`.

Specs are validated here first, so a malformed one is refused before anything is sent or
started, and again by the job queue on arrival (it trusts no client).
"""

from __future__ import annotations

import time
import uuid

from ster_dist import protocol
from ster_dist.errors import Refusal


def with_ids(specs: list[dict], cli: bool = False) -> list[dict]:
    """Validated specs, each with an id (given here when missing, so a resend is recognised)."""
    out = []
    for spec in specs:
        spec = dict(spec)
        spec.setdefault("id", uuid.uuid4().hex[:16])
        protocol.validate(spec, cli=cli)
        out.append(spec)
    return out


class LocalClient:
    def __init__(self, queue):
        self.queue = queue

    def submit_many(self, specs: list[dict], cli: bool = False) -> list[str]:
        return self.queue.submit_many(with_ids(specs, cli), cli)

    def poll_many(self, cursors: dict[str, int], timeout: float = 0.0) -> dict[str, dict]:
        return self.queue.poll_many(cursors, timeout)

    def stats(self) -> dict:
        return self.queue.stats()

    def cancel(self, job_id: str) -> dict:
        return self.queue.cancel(job_id)

    def close(self, wait: bool = True) -> None:
        """Stop the queue: after its running job, or (wait=False) at once, abandoning it."""
        self.queue.close(timeout=600.0 if wait else 0.0)


class RayClient:
    """The cluster's job-queue actor. `address` as for ray.init (None: RAY_ADDRESS, as inside a Ray
    job). Calls survive a restart of the actor: Ray retries them once it is back."""

    def __init__(
        self, address: str | None = None, state_dir: str | None = None, options: dict | None = None
    ):
        from ster_dist.jobqueue.actor import find_or_start
        from ster_dist.workers.ray_group import start_ray

        self._started_ray = start_ray(address)
        self.actor = find_or_start(state_dir, options)

    def _call(self, method: str, *args, timeout: float = 120.0):
        import ray

        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = protocol.unpack(
                    ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
                )
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                if time.monotonic() > deadline:
                    raise Refusal(
                        f"the job queue actor did not come back within {timeout:.0f} s: "
                        f"{str(exc).splitlines()[0]}"
                    ) from None
                time.sleep(0.5)
                continue
            if isinstance(reply, dict) and "refusal" in reply:
                raise Refusal(reply["refusal"])
            return reply

    def submit_many(self, specs: list[dict]) -> list[str]:
        return self._call("submit_many", protocol.pack(with_ids(specs)))["ids"]

    def poll_many(self, cursors: dict[str, int], timeout: float = 0.0) -> dict[str, dict]:
        return self._call("poll_many", cursors, timeout, timeout=timeout + 120.0)

    def stats(self) -> dict:
        return self._call("stats")

    def cancel(self, job_id: str) -> dict:
        return self._call("cancel", job_id)

    def pid(self) -> int:
        import ray

        return ray.get(self.actor.pid.remote())

    def close(self, wait: bool = True) -> None:
        """Disconnect (the actor stays up for the next job, with its running one)."""
        import ray

        if self._started_ray and ray.is_initialized():
            ray.shutdown()

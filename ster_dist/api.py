"""The Python API: an Engine over one model, every call a job through the central scheduler.

    from ster_dist.api import Engine

    with Engine("models/smollm2", tp=2) as engine:
        answer = engine.generate("What is the capital of France?", max_new_tokens=16)
        answers = engine.generate(["one", "two", "three"])        # one batched forward

Without `address` the scheduler runs in this process (one-rank groups here, larger ones on an
embedded local Ray cluster); with one, calls go to the cluster's scheduler actor, the same
one `ray job submit ... jobs/run.py` and `ster submit` reach. Keyword arguments are the CLI
command's flags (max_new_tokens=..., layer=..., ...); a method whose command this build does
not register refuses clearly. A failed job raises a Refusal carrying the job's error.
"""

from __future__ import annotations

from ster_dist import protocol
from ster_dist.errors import Refusal


class Engine:
    def __init__(self, model: str, *, revision: str | None = None, tp: int = 1, ep: int = 1,
                 precision: str = "f32", device: str = "cpu", address: str | None = None,
                 state_dir: str | None = None, on_event=None, **scheduler_options):
        self.model = model
        self.settings = {"model": model, "revision": revision, "precision": precision, "device": device,
                         "tp": tp, "ep": ep}
        self.on_event = on_event
        if address is None:
            from ster_dist.sched.client import LocalClient
            from ster_dist.scheduler import Scheduler

            scheduler = Scheduler(state_dir, **scheduler_options).start()
            scheduler.pool.prepare(tp * ep)
            self.client = LocalClient(scheduler)
        else:
            from ster_dist.sched.client import RayClient

            self.client = RayClient(address, state_dir, scheduler_options)

    # -- one method per job kind ---------------------------------------------------------------
    def generate(self, prompt: str | list[str], **flags):
        """One prompt: its result mapping. A list: one job per prompt (batched into one forward when
        greedy) and the list of their results, in order."""
        if isinstance(prompt, list):
            return self.run_many([self.spec("generate", prompt=p, **flags) for p in prompt])
        return self.run("generate", prompt=prompt, **flags)

    def extract(self, **flags) -> dict:
        return self.run("extract", **flags)

    def steer(self, action: str = "train", **flags) -> dict:
        return self.run(f"steer-{action}", **flags)

    def decide(self, **flags) -> dict:
        return self.run("decide", **flags)

    def merge(self, **flags) -> dict:
        return self.run("merge", **flags)

    def parity(self, **flags) -> dict:
        return self.run("parity", **flags)

    # -- underneath ------------------------------------------------------------------------------
    def spec(self, kind: str, **flags) -> dict:
        """The job spec for kind: this engine's model settings (those the command takes), then the
        flags given."""
        protocol.command_parsers(kind)  # refuses a kind this build does not have, naming it
        spec = {"kind": kind}
        for name, value in self.settings.items():
            if value is None:
                continue
            if protocol.accepts(kind, name):
                spec[name] = value
            elif name in ("tp", "ep") and value != 1:
                raise Refusal(f"{kind} jobs take no {name!r} in this ster_dist build; use {name}=1")
        spec.update(flags)
        return spec

    def run(self, kind: str, **flags) -> dict:
        return self.run_many([self.spec(kind, **flags)])[0]

    def run_many(self, specs: list[dict]) -> list[dict]:
        from ster_dist.sched.client import follow

        records = follow(self.client, self.client.submit_many(specs), on_event=self.on_event)
        for record in records:
            if record["status"] != "done":
                raise Refusal(f"{record['kind']} job {record['id']} failed: {record['error']}")
        return [record["result"] for record in records]

    def stats(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""The Python API: an Engine over one model, every call a typed request run as a job through the
job queue.

    from ster_dist.api import Engine

    with Engine("models/smollm2", tp=2) as engine:
        answer = engine.generate("What is the capital of France?", max_new_tokens=16)
        answers = engine.generate(["one", "two", "three"])        # one batched forward
        report = engine.run(ExtractRequest(model=..., input=..., output=...))

Without `address` the job queue runs in this process (one-rank groups here, larger ones on an
embedded local Ray cluster); with one, calls go to the cluster's job-queue actor, the same one
`ray job submit ... jobs/run.py` and `ster submit` reach. Keyword arguments are the request
model's fields (ster_dist/schema: max_new_tokens=..., layers=..., ...), validated as a queued
job's are. A failed job raises a Refusal carrying the job's error.
"""

from __future__ import annotations

from ster_dist import protocol
from ster_dist.errors import Refusal
from ster_dist.schema import JOB_REQUESTS, Request

_SETTINGS = ("model", "revision", "precision", "device", "tp", "ep", "pp")


class Engine:
    def __init__(
        self,
        model: str,
        *,
        revision: str | None = None,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        precision: str = "f32",
        device: str = "cpu",
        address: str | None = None,
        state_dir: str | None = None,
        on_event=None,
        **queue_options,
    ):
        self.model = model
        self.settings = {
            "model": model,
            "revision": revision,
            "precision": precision,
            "device": device,
            "tp": tp,
            "ep": ep,
            "pp": pp,
        }
        self.on_event = on_event
        if address is None:
            from ster_dist.jobqueue.client import LocalClient
            from ster_dist.jobqueue.queue import JobQueue

            queue = JobQueue(state_dir, **queue_options).start()
            queue.pool.prepare(tp * ep * pp)
            self.client = LocalClient(queue)
        else:
            from ster_dist.jobqueue.client import RayClient

            self.client = RayClient(address, state_dir, queue_options)

    # -- one method per operation --------------------------------------------------------------
    def generate(self, prompt: str | list[str], stream: bool = False, **fields):
        """One prompt: its result mapping. A list: one job per prompt (sharing the token engine's
        batch) and the list of their results, in order. stream=True (one prompt): an iterator of the
        answer's text as it is generated."""
        if stream:
            if isinstance(prompt, list):
                raise Refusal("stream=True streams one prompt's answer; give one prompt")
            return self._stream(self.job("generate", prompt=prompt, stream=True, **fields))
        if isinstance(prompt, list):
            return self.run_many([self.job("generate", prompt=p, **fields) for p in prompt])
        return self.run(self.job("generate", prompt=prompt, **fields))

    def extract(self, **fields) -> dict:
        return self.run(self.job("extract", **fields))

    def steer(self, action: str = "train", **fields) -> dict:
        return self.run(self.job(f"steer-{action}", **fields))

    def decide(self, **fields) -> dict:
        return self.run(self.job("decide", **fields))

    def calibrate(self, **fields) -> dict:
        return self.run(self.job("calibrate", **fields))

    def merge(self, **fields) -> dict:
        return self.run(self.job("merge", **fields))

    def parity(self, **fields) -> dict:
        return self.run(self.job("parity", **fields))

    def tune(self, action: str = "sft", **fields) -> dict:
        return self.run(self.job(f"tune-{action}", **fields))

    # -- underneath ------------------------------------------------------------------------------
    def job(self, kind: str, **fields) -> protocol.JobSpec:
        """The job of `kind`: this engine's model settings (those its request takes), then the
        fields given (and `id` / `priority` when given), validated as a queued job's."""
        if kind not in JOB_REQUESTS:
            raise Refusal(f"unknown job kind {kind!r}; give one of: {', '.join(JOB_REQUESTS)}")
        cls = JOB_REQUESTS[kind]
        data = {}
        for name in _SETTINGS:
            value = self.settings[name]
            if value is None:
                continue
            if name in cls.model_fields:
                data[name] = value
            elif name in ("tp", "ep", "pp") and value != 1:
                raise Refusal(f"{kind} jobs take no {name!r}; use {name}=1")
        data.update(fields)
        return protocol.validate({"kind": kind, **data})

    def run(self, request: Request | protocol.JobSpec) -> dict:
        """One typed request (or job) run as a job; its result."""
        return self.run_many([request])[0]

    def run_many(self, requests: list[Request | protocol.JobSpec]) -> list[dict]:
        from ster_dist.jobqueue.follow import follow

        specs = [
            r.to_dict() if isinstance(r, protocol.JobSpec) else {"kind": r.kind, **r.given()}
            for r in requests
        ]
        records = follow(self.client, self.client.submit_many(specs), on_event=self.on_event)
        for record in records:
            if record["status"] != "done":
                raise Refusal(f"{record['kind']} job {record['id']} failed: {record['error']}")
        return [record["result"] for record in records]

    def _stream(self, spec: protocol.JobSpec):
        """The job's text events as they arrive (a thread follows the job); its failure is
        raised."""
        import queue
        import threading

        from ster_dist.jobqueue.follow import follow

        texts: queue.SimpleQueue = queue.SimpleQueue()
        end = object()

        def on_event(event: dict) -> None:
            if event.get("event") == "text":
                texts.put(event["text"])
            elif self.on_event is not None:
                self.on_event(event)

        def run() -> None:
            try:
                (record,) = follow(
                    self.client, self.client.submit_many([spec.to_dict()]), on_event=on_event
                )
                texts.put(
                    Refusal(f"generate job {record['id']} failed: {record['error']}")
                    if record["status"] != "done"
                    else end
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                texts.put(exc)

        threading.Thread(target=run, name="ster-stream", daemon=True).start()
        while True:
            item = texts.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stats(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

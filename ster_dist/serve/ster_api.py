"""Ster's serve API as a FastAPI router over the job queue: POST /v1/train, /v1/optimize,
/v1/evaluate, /v1/generate, /v1/extract, /v1/inspect and GET /v1/health (docs/serve-api.md).

A body is a job spec in camelCase (`{"prompt": "hi", "maxNewTokens": 8}`), validated by the same
request models as the command line and job specs (ster_dist.protocol), with the served model's
settings filled in where the body names no other model. Its job runs through the job queue like
any other, so requests run side by side where the queue allows (generate jobs share the token
engine's batch in lanes). The answer is NDJSON: the job's progress as `log` events, then one
`result` (keys in camelCase), or an `error` when the job fails once the stream has begun.

The response is held until the job says something (a progress line, generated text, its result):
a job refused before that (a bad field, a missing input file the operation checks first) is
answered 400, or 404 for a file or model directory that does not exist, in the envelope
`{"error": {"message", "type", "code"}}` whose message is the refusal the command line prints.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import types
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ster_dist import ops, protocol
from ster_dist.errors import Refusal
from ster_dist.inputs import INPUT_FIELDS
from ster_dist.resolve import resolve
from ster_dist.schema import (
    ExtractRequest,
    GenerateRequest,
    SteerEvaluateRequest,
    SteerInspectRequest,
    SteerOptimizeRequest,
    SteerTrainRequest,
)
from ster_dist.schema.base import kind_of_value
from ster_dist.serve.confine import Confinement, Forbidden

# endpoint name (Ster's command name) -> the request its body is (a job kind, except inspect: one
# small
# file read here)
ENDPOINTS = {
    cls.ster_name or cls.command[-1]: cls
    for cls in (
        SteerTrainRequest,
        SteerOptimizeRequest,
        SteerEvaluateRequest,
        GenerateRequest,
        ExtractRequest,
        SteerInspectRequest,
    )
}
SETTINGS = ("model", "revision", "precision", "device", "tp", "ep", "pp", "weights")
NDJSON = "application/x-ndjson"
POLL_S = 1.0  # one poll's longest wait; news wakes it at once
_SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def ster_router(client, defaults: dict, confinement: Confinement | None = None) -> APIRouter:
    """The router for an app to include. `client` is a job-queue client (LocalClient, RayClient);
    `defaults` the served model's settings (model, revision, precision, device, tp, ep, weights);
    `confinement` the paths and models a body may name (default: the working directory and the
    served model)."""
    api = SterApi(client, defaults, confinement)
    router = APIRouter()
    for name, cls in ENDPOINTS.items():
        router.add_api_route(
            f"/v1/{name}",
            api.endpoint(cls),
            methods=["POST"],
            include_in_schema=True,
            summary=cls.summary,
        )
        router.add_api_route(
            f"/v1/{name}",
            _wrong_method(f"/v1/{name}", "POST"),
            methods=[m for m in _METHODS if m != "POST"],
            include_in_schema=False,
        )
        router.add_api_route(
            f"/v1/{name}/{{rest:path}}", _unknown, methods=_METHODS, include_in_schema=False
        )
    router.add_api_route(
        "/v1/health", api.health, methods=["GET"], summary="the server and its job queue"
    )
    router.add_api_route(
        "/v1/health",
        _wrong_method("/v1/health", "GET"),
        methods=[m for m in _METHODS if m != "GET"],
        include_in_schema=False,
    )
    return router


class SterApi:
    def __init__(self, client, defaults: dict, confinement: Confinement | None = None):
        self.client = client
        self.defaults = dict(defaults)
        self.confinement = confinement or Confinement(self.defaults["model"])
        # polls wait up to POLL_S each: a pool of their own keeps them off the event loop and out of
        # the threads the app's other handlers use
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ster-api")

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def endpoint(self, cls):
        async def handle(request: Request) -> Response:
            try:
                body = await read_body(request)
                if cls.kind is None:
                    return await self.run_here(cls, body)
                return await self.run_job(cls, body)
            except Refused as refused:
                return refused.response()

        handle.__name__ = f"ster_{cls.command[-1]}"
        return handle

    # -- a job through the queue -------------------------------------------------------------------
    def spec(self, cls, body: dict) -> dict:
        """The body as a job spec: its kind, the served model's settings the body leaves out (when
        it names no other model), then the body itself."""
        if "kind" in body:
            raise Refused(400, f"/v1/{cls.command[-1]} runs {cls.kind} jobs; drop the field 'kind'")
        spelled = protocol.names(cls)
        given = {spelled.get(key, key) for key in body}
        model = next((body[k] for k in body if spelled.get(k) == "model"), None)
        spec = {"kind": cls.kind}
        if model is None or model == self.defaults.get("model"):
            for name in SETTINGS:
                value = self.defaults.get(name)
                if name in cls.model_fields and name not in given and value is not None:
                    spec[name] = value
        return {**spec, **body}

    def confine(self, request) -> None:
        try:
            self.confinement.check(request, lambda name: f"'{protocol.camel(name)}'")
        except Forbidden as forbidden:
            raise Refused(403, str(forbidden)) from None

    async def run_job(self, cls, body: dict) -> Response:
        spec = self.spec(cls, body)
        spelled = protocol.names(cls)
        model = next(
            (value for key, value in spec.items() if spelled.get(key, key) == "model"), None
        )
        if isinstance(model, str):  # before validation, whose checks read the model's config.json
            self.confine(types.SimpleNamespace(model=model))
        try:
            job = await self._call(protocol.validate, spec)
        except Refusal as refusal:
            raise Refused(400, str(refusal)) from None
        self.confine(job.request)
        try:
            await self._call(local_model_exists, job.request)
        except Refusal as refusal:
            raise Refused(404, str(refusal)) from None
        try:
            (job_id,) = await self._call(self.client.submit_many, [{**spec, "id": job.id}])
        except Refusal as refusal:
            raise Refused(400, str(refusal)) from None
        cursor, pending, record = 0, [], None
        # hold the answer until the job says something: a refusal before then is a 400, not a stream
        while not pending and record is None:
            cursor, lines, record = await self._poll(job_id, cursor)
            pending += lines
        if not pending and record["status"] != "done":
            raise Refused(status_of(job.request, record), record["error"])
        return StreamingResponse(
            self._stream(job_id, cursor, pending, record),
            media_type=NDJSON,
            headers={"x-ster-job": job_id},
        )

    async def _poll(self, job_id: str, cursor: int) -> tuple[int, list[dict], dict | None]:
        reply = (await self._call(self.client.poll_many, {job_id: cursor}, POLL_S))[job_id]
        lines = [line for line in map(event_line, reply["events"]) if line is not None]
        return reply["cursor"], lines, reply["result"]

    async def _stream(self, job_id: str, cursor: int, pending: list[dict], record: dict | None):
        while True:
            for line in pending:
                yield _encode(line)
            if record is not None:
                yield _encode(result_line(record))
                return
            cursor, pending, record = await self._poll(job_id, cursor)

    # -- inspect: one small file, read in a thread
    # ---------------------------------------------------
    async def run_here(self, cls, body: dict) -> Response:
        try:
            request = protocol.parse_fields(cls, body, f"{' '.join(cls.command)} requests")
        except Refusal as refusal:
            raise Refused(400, str(refusal)) from None
        self.confine(request)
        try:
            result = await self._call(ops.OPERATIONS[cls].run, request)
        except Refusal as refusal:
            raise Refused(
                404 if names_missing_path(request, str(refusal)) else 400, str(refusal)
            ) from None
        return Response(
            _encode({"event": "result", "result": camel_keys(result)}), media_type=NDJSON
        )

    # -- health
    # ----------------------------------------------------------------------------------------
    async def health(self) -> dict:
        stats = await self._call(self.client.stats)
        queue = {
            key: stats[key]
            for key in (
                "queued",
                "jobs",
                "group_starts",
                "group_releases",
                "groups",
                "journal_behind",
            )
            if key in stats
        }
        return {
            "status": "ok",
            "model": self.defaults.get("model"),
            "queue": camel_keys(_plain(queue)),
        }


# -- bodies, events and answers
# ----------------------------------------------------------------------
class Refused(Exception):
    """An answer in the error envelope, before any stream began."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def response(self) -> JSONResponse:
        return envelope(self.status, str(self))


def envelope(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


async def read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise Refused(
            400, "the request body is not UTF-8 text; send a JSON object of fields"
        ) from None
    except json.JSONDecodeError as exc:
        raise Refused(
            400,
            f"the request body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
            "send a JSON object of fields",
        ) from None
    except RecursionError:  # json.loads' own depth limit, reached by a body of ordinary size
        raise Refused(
            400, "the request body's arrays or objects nest too deeply to be read; flatten it"
        ) from None
    except ValueError as exc:  # an integer of over 4300 digits
        raise Refused(
            400,
            f"the request body holds a number too long to read ({str(exc).split(';')[0][:100]})",
        ) from None
    if not isinstance(body, dict):
        raise Refused(
            400, f"the request body must be a JSON object of fields, got {kind_of_value(body)}"
        )
    return body


def event_line(event: dict) -> dict | None:
    """A job's event as a line of the answer: progress and log lines as `log`, generated text as
    `text`, the job queue's notices (a retry, an error) as `log`; its bookkeeping not at all."""
    kind = event.get("event")
    if kind == "text":
        return {"event": "text", "text": event.get("text", "")}
    if kind == "queue":
        if not event.get("notice"):
            return None
        return {"event": "log", "message": event.get("message", ""), "time": event.get("time")}
    extra = {
        k: v for k, v in event.items() if k not in ("event", "message", "time", "job", "traceback")
    }
    return {
        "event": "log",
        "message": event.get("message", ""),
        "time": event.get("time"),
        **camel_keys(extra),
    }


def result_line(record: dict) -> dict:
    if record["status"] == "done":
        return {"event": "result", "result": camel_keys(record["result"])}
    return {"event": "error", "error": {"message": record["error"]}}


def status_of(request, record: dict) -> int:
    """A job failed before its stream began: 404 when its refusal is about an input file or model
    directory that does not exist, 400 for any other refusal, 500 for a fault inside ster_dist."""
    if record.get("exit_code") != 2:
        return 500
    return 404 if names_missing_path(request, record["error"]) else 400


def local_model_exists(request) -> None:
    """A model named by a path whose directory is here but which is not: refused before it is queued
    (a job would report it only after its "resolving" line had begun the stream), in the resolver's
    own sentence. Only then: the resolver refuses such a path before any network request, where any
    other name that is not a directory may be a Hub id."""
    model = getattr(request, "model", None)
    if not isinstance(model, str) or os.path.isdir(model):
        return
    parent = os.path.dirname(os.path.normpath(model))
    if parent and os.path.isdir(parent):
        resolve(model, getattr(request, "revision", None))


def names_missing_path(request, message: str) -> bool:
    """Whether the refusal names an input of the request that is not on this machine. A model is
    counted only when it looks like a local path (a Hub id is no file here either)."""
    for name in (*INPUT_FIELDS, "artifact"):
        value = getattr(request, name, None)
        if (
            not isinstance(value, str)
            or not value
            or value == "-"
            or value not in message
            or os.path.exists(value)
        ):
            continue
        if name != "model" or os.path.isabs(value) or os.path.isdir(os.path.dirname(value) or "."):
            return True
    return False


def camel_keys(value):
    """Mapping keys that are snake_case identifiers in camelCase, at every depth; values
    untouched."""
    if isinstance(value, dict):
        return {
            (protocol.camel(k) if isinstance(k, str) and _SNAKE.fullmatch(k) else k): camel_keys(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [camel_keys(v) for v in value]
    return value


def _plain(value):
    return json.loads(json.dumps(value, default=str))


def _encode(line: dict) -> bytes:
    return (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")


async def _unknown(request: Request) -> JSONResponse:
    return envelope(
        404,
        f"no endpoint {request.url.path} in Ster's serve API; the endpoints are "
        + ", ".join(f"/v1/{name}" for name in ENDPOINTS)
        + " and /v1/health",
    )


def _wrong_method(path: str, method: str):
    async def answer(request: Request) -> JSONResponse:
        response = envelope(405, f"{path} takes {method}, not {request.method}")
        response.headers["Allow"] = method
        return response

    return answer

"""The server's FastAPI application over a started ServerState.

Routes: OpenAI's (serve/openai_api.py), vLLM's /tokenize and /detokenize (serve/tokenize.py), Ster's
serve API (serve/ster_api.py), `/health` and `/metrics`. Around them one plain ASGI layer (cheaper
than Starlette's BaseHTTPMiddleware, and it never buffers a stream) checks, in this order: the
bearer key (or, on a keyless server, that the request is not a web page's), the server draining, the
body size, and the limit of requests in flight, OpenAI's and Ster's endpoints that run work alike
(429 with Retry-After); it counts every answer by endpoint and status for /metrics. The two
completion endpoints it answers itself, below FastAPI, through openai_api.answer: their time on the
event loop delays the first token. Every error body is OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from ster_dist.schema.serve import is_loopback
from ster_dist.serve import errors
from ster_dist.serve.errors import ApiError
from ster_dist.serve.openai_api import CHAT, TEXT, answer, router as openai_router
from ster_dist.serve.tokenize import router as tokenize_router

# answered while draining; the first also without a key or from any origin, for load balancers: it
# says only
# "ok" or why not, where Ster's /v1/health tells the model's path, the workers' hosts and pids
OPEN_PATHS = ("/health", "/v1/health")
PROBE = "/health"
ANSWERED = (CHAT, TEXT)  # answered below FastAPI, by openai_api.answer
# Ster's endpoints that run work (a job, or a file read): counted by the in-flight limit as OpenAI's
# are
STER_WORK = (
    "/v1/train",
    "/v1/optimize",
    "/v1/evaluate",
    "/v1/generate",
    "/v1/extract",
    "/v1/inspect",
)
# the endpoint label of /metrics: these paths, every other one counted as "other" (never a made-up
# path)
KNOWN = (*ANSWERED, *OPEN_PATHS, "/v1/models", "/metrics", "/tokenize", "/detokenize", *STER_WORK)


def build_app(state) -> FastAPI:
    app = FastAPI(title="ster serve", docs_url=None, redoc_url=None, openapi_url=None)
    state.started = time.time()
    app.state.ster = state
    app.include_router(openai_router(state))
    app.include_router(tokenize_router(state))
    _mount_ster_api(app, state)

    @app.get("/health")
    async def health():
        if state.draining:
            return errors.shutting_down().response()
        if state.engine is None or state.engine.stopped:
            return errors.engine_stopped().response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return errors.bad_request(
                f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(
                    ": "
                ),
                code="invalid_json",
            ).response()
        param = errors.param_of(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        return errors.bad_request(
            f"{param}: {message}" if param else message, param=param
        ).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def crashed(_, exc: Exception):
        return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error").response()

    return _Guard(app, state)


def _mount_ster_api(app: FastAPI, state) -> None:
    try:
        from ster_dist.serve.ster_api import ster_router
    except ImportError:  # not in this build
        return
    from ster_dist.serve.confine import Confinement

    request = state.request
    defaults = {
        "model": request.model,
        "revision": request.revision,
        "precision": request.precision,
        "device": request.device,
        "tp": request.tp,
        "ep": request.ep,
        "pp": request.pp,
        "weights": request.weights,
    }
    confinement = Confinement(request.model, request.allow_path, request.allow_models)
    app.include_router(ster_router(state.client, defaults, confinement))


class _Guard:
    """Key, draining, body size and in-flight limit, before the app sees a request; counts
    answers."""

    def __init__(self, app: FastAPI, state):
        self.app, self.state = app, state
        self.key = state.request.api_key
        self.body_limit = state.request.body_limit()
        self.read_seconds = state.request.read_seconds

    # uvicorn and tests reach the FastAPI app's attributes through the guard
    def __getattr__(self, name):
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, state = scope["path"], self.state
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                return await refusal.send(counted_send)
            # a client that never finishes its body would hold its connection and this task for ever
            try:
                body = await asyncio.wait_for(self._body(receive), self.read_seconds)
            except asyncio.TimeoutError:
                return await errors.too_slow(self.read_seconds).send(counted_send)
            if body is None:
                return await errors.too_large(self.body_limit).send(counted_send)
            replay = _replaying(body, receive)
            limited = path in ANSWERED or (path in STER_WORK and scope["method"] == "POST")
            if not limited:
                return await self.app(scope, replay, counted_send)
            if path in ANSWERED and scope["method"] != "POST":
                return await ApiError(405, "Method Not Allowed", code="method_not_allowed").send(
                    counted_send
                )
            if state.in_flight >= state.max_queue:
                return await errors.too_many(1, state.max_queue).send(counted_send)
            state.in_flight += 1
            try:  # a Ster job counts until its stream ends
                if path in ANSWERED:
                    await answer(state, path, body, replay, counted_send)
                else:
                    await self.app(scope, replay, counted_send)
            finally:
                state.in_flight -= 1
        finally:
            state.metrics.requests.labels(path if path in KNOWN else "other", str(status[0])).inc()

    def _refusal(self, scope, path: str) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.key is not None and path != PROBE:
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.key.encode()
            ):
                return errors.unauthorized()
        if self.key is None and path != PROBE:
            foreign = _foreign(headers)
            if foreign is not None:
                return errors.foreign_site(*foreign)
        if self.state.draining and path not in OPEN_PATHS:
            return errors.shutting_down()
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.body_limit:
            return errors.too_large(self.body_limit)
        return None

    async def _body(self, receive) -> bytes | None:
        """The whole request body, or None once it grows past the limit (a body sent in chunks,
        without a content-length, is counted as it comes)."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.body_limit:
                return None
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _foreign(headers: dict) -> tuple[str, str] | None:
    """("Origin" | "Host", value) when a keyless server is asked by another site: a web page's
    request (a browser sends its Origin, and a form or text/plain POST needs no CORS approval) or
    DNS rebinding (a foreign name that resolves to 127.0.0.1). Such a page could otherwise run jobs
    that write files where the body says. Clients off a browser send no Origin and name the address
    they dialled."""
    # an Origin is a URL; a Host is the authority alone, read as one by putting "//" before it
    for header, name, lead in ((b"origin", "Origin", ""), (b"host", "Host", "//")):
        value = headers.get(header)
        if value is None:
            continue
        text = value.decode("latin-1")
        try:
            host = urlsplit(lead + text).hostname
        except ValueError:
            host = None
        if host is None or not is_loopback(host):
            return name, text
    return None


def _replaying(body: bytes, receive):
    """A `receive` that hands the app the body read already, then passes on what the client sends
    next (its disconnect)."""
    sent = [False]

    async def replay():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

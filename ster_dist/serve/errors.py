"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status that
fits.

A Refusal raised below (the engine's, the steering artifact's, the adapter's) keeps its sentence:
the server adds the status and the field it concerns, never a traceback.
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 (OpenAI's key)
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    async def send(self, send) -> None:
        """The error as a whole ASGI answer, for layers below FastAPI's exception handlers."""
        await send_json(
            send,
            self.body(),
            self.status,
            [(k.lower().encode(), v.encode()) for k, v in (self.headers or {}).items()],
        )


async def send_json(send, body: dict, status: int = 200, headers: list | None = None) -> None:
    """`body` as a whole ASGI answer, written as Starlette's JSONResponse writes it."""
    data = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *(headers or ()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, param=param, code=code)


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Incorrect API key provided; send it as 'Authorization: Bearer KEY' (the key given to "
        "ster serve --api-key)",
        code="invalid_api_key",
    )


def foreign_site(header: str, value: str) -> ApiError:
    return ApiError(
        403,
        f"this server has no key, so it answers only clients on this machine, and the request's "
        f"{header} {value[:200]!r} is another site's (a web page, or DNS rebinding); call it as "
        "127.0.0.1 or localhost, or start ster serve with --api-key KEY",
        code="foreign_origin",
    )


def too_many(retry_after: int, limit: int) -> ApiError:
    return ApiError(
        429,
        f"the server is at its limit of {limit} requests in flight; retry after {retry_after} s",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry_after)},
    )


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's {limit} bytes (ster serve --max-body)",
        code="request_too_large",
    )


def engine_stopped(why: str = "") -> ApiError:
    return ApiError(
        503,
        f"the engine has stopped{': ' + why.removeprefix('the engine has stopped: ') if why else ''}; "
        "restart the server",
        type="server_error",
        code="engine_stopped",
    )


def too_slow(seconds: float) -> ApiError:
    return ApiError(
        408,
        f"the request's body did not arrive whole within {seconds:g} s; send it at once (or start "
        "ster serve with a longer --read-seconds)",
        code="request_timeout",
    )


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "the server is shutting down; send the request to another replica or retry later",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "5"},
    )


def param_of(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI's dotted param ("messages.0.content")."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None

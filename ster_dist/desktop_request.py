"""`ster request <operation>`: one JSON request run to completion, as Ster Desktop runs each
workflow (Ster's guide/desktop-requests.md).

The body is one JSON document on stdin carrying each flag of the mirrored command as a camelCase
field; it becomes that command's typed request (ster_dist/schema) and runs through the same front
door as the command line (cli.run). stdout carries NDJSON only, each event flushed as written:

    {"type":"log","stream":"stderr","chunk":"...\\n"}   what the command writes to stderr, in order
    {"type":"result","status":S,"json":{...}}             exactly one, last; S is the exit status

Status 0: done, `json` is the command's document. 1: it started and failed; the last log event is
`error: <sentence>`. 2: refused before anything ran, no log event before it: an unknown operation
(`unknown operation: <name>`), a body that does not parse into the operation's fields (`request
body is not valid JSON: ...`, with a missing number named as serde names it, `missing field
\\`learningRate\\` at line L column C`), or a field the request's validation refuses.

A reader that closes stdout ends the request at its next event: the write fails, and the run is
stopped the way an interrupt stops it (its job cancelled, its ranks closed), without a result.

Ster's operations that ster_dist has no command for are refused with status 2, named as such.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
import threading

from ster_dist.errors import Refusal
from ster_dist.schema import REQUESTS, DecideRequest, GenerateRequest, Request

# Ster's numbers with no default (steering.md, fine-tuning.md): a body leaving one out is refused
REQUIRED_NUMBERS: dict[str, tuple[str, ...]] = {
    "generate": ("max_new_tokens", "temperature", "seed"),
    "vector/optimize": ("holdout",),
    "vector/curve": ("holdout", "sizes", "method"),
    **{
        f"tune/{verb}": ("learning_rate", "epochs", "seed")
        for verb in ("sft", "dpo", "reward", "grpo")
    },
}
# in Ster's table, not (yet) a ster_dist command: refused by name rather than as unknown
NOT_IN_STER_DIST = (
    "vector/project",
    "vector/ablate",
    "pairs/import",
    "pairs/inspect",
    "pairs/save",
    "pairs/synthesize",
)
# a body field Ster names otherwise than the command's flag: operation -> {body: request field}
RENAMED: dict[str, dict[str, str]] = {
    "pairs/merge": {"sources": "pairs", "trait_name": "trait"},
    "workspace/import-pairs": {"pairs": "file", "path": "file"},
}


def operations() -> dict[str, type[Request]]:
    """Ster's operation names: a command's 0.14 words joined by `/`, or its own single word."""
    table: dict[str, type[Request]] = {}
    for cls in REQUESTS:
        if cls.ster_command is not None:
            table["/".join(cls.ster_command)] = cls
        elif cls.command and cls.command[0] in (
            "generate",
            "extract",
            "decide",
            "calibrate",
            "tune",
            "pairs",
            "workspace",
            "onboarding",
            "vector",
        ):
            table["/".join(cls.command)] = cls
    return table


class ReaderGone(KeyboardInterrupt):
    """stdout was closed: nobody is left to receive the result. An interrupt, so the job queue and
    the ranks stop as they do on Ctrl-C, not after the run."""


class Events:
    """NDJSON events on the real stdout, one per line, flushed as written."""

    def __init__(self, out):
        self.out = out
        self.logged = 0
        self.gone = False
        self._lock = threading.Lock()

    def send(self, event: dict) -> None:
        with self._lock:
            if self.gone:
                raise ReaderGone()
            try:
                self.out.write(json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n")
                self.out.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.gone = True
                with contextlib.suppress(
                    OSError
                ):  # no flush at exit may fail on the closed pipe again
                    os.dup2(os.open(os.devnull, os.O_WRONLY), self.out.fileno())
                raise ReaderGone() from None

    def log(self, chunk: str) -> None:
        self.logged += 1
        self.send({"type": "log", "stream": "stderr", "chunk": chunk})


class LogStream(io.TextIOBase):
    """A stderr whose every line becomes a log event (a progress event's line: its message)."""

    def __init__(self, events: Events):
        self.events = events
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).replace("\r", "\n").split("\n")
        for line in lines:
            if line.strip():
                self.events.log(_readable(line) + "\n")
        return len(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False


def _readable(line: str) -> str:
    try:
        event = json.loads(line)
    except ValueError:
        return line
    if isinstance(event, dict) and isinstance(event.get("message"), str):
        return event["message"]
    return line


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _end_of(text: str) -> tuple[int, int]:
    """serde's position for a missing field: the closing brace of the document."""
    end = text.rstrip()
    line = end.count("\n") + 1
    return line, len(end) - (end.rfind("\n") + 1)


def parse_body(operation: str, text: str, scratch: list[str]) -> Request:
    """The operation's typed request from the body, or a Refusal worded as Ster words it."""
    table = operations()
    if operation in NOT_IN_STER_DIST:
        raise Refusal(
            f"operation {operation} is Ster's but not ster_dist's yet: no command runs it here"
        )
    cls = table.get(operation)
    if cls is None:
        raise Refusal(f"unknown operation: {operation}")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Refusal(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(body, dict):
        raise Refusal("request body is not valid JSON: invalid type: expected a JSON object")
    line, column = _end_of(text)
    data, written = {}, {}
    renamed = RENAMED.get(operation, {})
    for key, value in body.items():
        name = renamed.get(_snake(key), _snake(key))
        if name not in cls.model_fields and not (cls is GenerateRequest and name == "steering"):
            raise Refusal(
                f"request body is not valid JSON: unknown field `{key}` "
                f"at line {line} column {column}"
            )
        data[name], written[name] = value, key
    if cls is GenerateRequest and "steering" in data:
        _steering(data)
    required = [n for n, f in cls.model_fields.items() if f.is_required()] + list(
        REQUIRED_NUMBERS.get(operation, ())
    )
    body_name = {field: _camel(name) for name, field in renamed.items()}
    for name in required:
        if name not in data:
            raise Refusal(
                "request body is not valid JSON: missing field "
                f"`{body_name.get(name, _camel(name))}` "
                f"at line {line} column {column}"
            )
    if cls is DecideRequest and isinstance(data.get("request"), (dict, list)):
        data["request"] = _inline(data["request"], scratch)  # the desktop composes it inline
    return cls.parse(data, written=written)


def _steering(data: dict) -> None:
    """`steering: [{"vector", "strength"}]`, each strength required."""
    steering = data.pop("steering")
    if not isinstance(steering, list) or not all(isinstance(s, dict) for s in steering):
        raise Refusal(
            'request body is not valid JSON: steering must be a list of {"vector", "strength"}'
        )
    for entry in steering:
        for key in ("vector", "strength"):
            if key not in entry:
                raise Refusal(f"request body is not valid JSON: missing field `{key}` in steering")
    if steering:
        data["vector"] = [entry["vector"] for entry in steering]
        data["strength"] = [entry["strength"] for entry in steering]


def _inline(document, scratch: list[str]) -> str:
    handle, path = tempfile.mkstemp(prefix="ster-request-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump(document, out)
    scratch.append(path)
    return path


def main(argv: list[str], run) -> int:
    """`run` is cli.run: (result, exit status) of a typed request, as the command line runs it."""
    events = Events(sys.stdout)
    if len(argv) != 1 or argv[0].startswith("-"):
        events.send(
            {
                "type": "result",
                "status": 2,
                "json": {
                    "error": "ster request takes one operation, such as vector/inspect, and its "
                    "body on stdin"
                },
            }
        )
        return 2
    operation, scratch = argv[0], []
    try:
        try:
            request = parse_body(operation, sys.stdin.read(), scratch)
        except Refusal as refusal:
            events.send({"type": "result", "status": 2, "json": {"error": str(refusal)}})
            return 2
        status, document = _run(request, events, run)
        events.send({"type": "result", "status": status, "json": document})
        return status
    except ReaderGone:
        # the run was stopped as an interrupt stops it (job cancelled, ranks closed); leave now, not
        # through interpreter shutdown, where a closed group's native thread may abort the process
        _remove(scratch)
        sys.stderr.flush()
        os._exit(1)
    finally:
        _remove(scratch)


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _run(request: Request, events: Events, run) -> tuple[int, dict]:
    stream = LogStream(events)
    try:
        with contextlib.redirect_stderr(stream), contextlib.redirect_stdout(stream):
            result, code = run(request)
    except ReaderGone:
        raise
    except Refusal as refusal:
        sentence = str(refusal)
    except (
        Exception
    ) as exc:  # a defect still ends in one result, the status the docs give a failure
        sentence = f"{type(exc).__name__}: {exc}"
    else:
        return code, json.loads(json.dumps(result, default=str))
    events.log(f"error: {sentence}\n")
    return 1, {"error": sentence}

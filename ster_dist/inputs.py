"""Reading the small input files operations take (prompts, pairs, requests, system messages), each
refused in one line naming the field it came from, before any weight is read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from ster_dist.errors import Refusal

MAX_INPUT_BYTES = 256 << 20  # an input file past this is refused before it is read whole


def read_bytes(path: str, where: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file or pipe `path`, at most `limit` of them. The size is counted as
    it is read, never taken from st_size (0 for /dev/zero or a FIFO, which then grew the reader
    without bound). Devices and sockets are refused. A pipe is what a shell hands a command for
    generated input (`<(...)`): it is read while a process writes to it; one no process has open for
    writing is refused at once, not waited on (the file is opened without blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise Refusal(f"{where} {path}: {exc.strerror or exc}") from None
    # of what was opened, so a path swapped after a check is still caught
    mode = os.fstat(fd).st_mode
    first = b""
    if stat.S_ISFIFO(mode):
        try:
            first = os.read(fd, limit + 1)
        except BlockingIOError:  # a writer holds it open and has not written yet: wait for it
            pass
        else:
            if not first:  # end of file at once: no process writes to it
                os.close(fd)
                raise Refusal(f"{where} {path} is a pipe no process writes to; name a file")
        os.set_blocking(fd, True)
    elif not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise Refusal(f"{where} {path} is a directory; name a file")
        raise Refusal(
            f"{where} {path} is not a regular file or a pipe (a device or a socket); name a file"
        )
    with os.fdopen(fd, "rb") as file:
        try:
            data = first + (file.read(limit + 1 - len(first)) if len(first) <= limit else b"")
        except OSError as exc:
            raise Refusal(f"{where} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise Refusal(
            f"{where} {path} is more than the {_size(limit)} an input file may hold; split it"
        )
    return data


def read_text(path: str, where: str, limit: int = MAX_INPUT_BYTES) -> str:
    try:
        return read_bytes(path, where, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(f"{where} {path} is not UTF-8 text") from None


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def read_json(path: str, where: str):
    try:
        return json.loads(read_text(path, where))
    except json.JSONDecodeError as exc:
        raise Refusal(f"{where} {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:  # json.loads' own limits, reached by a file of ordinary size
        raise Refusal(
            f"{where} {path}: its arrays or objects nest too deeply to be read; flatten it"
        ) from None
    except ValueError as exc:  # an integer of over 4300 digits
        raise Refusal(
            f"{where} {path}: it holds a number too long to read ({str(exc).split(';')[0][:100]})"
        ) from None


def read_prompts(path: str, where: str) -> list[str]:
    data = read_json(path, where)
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise Refusal(
            f'{where} {path} must be {{"prompts": ["...", ...]}} with at least one string'
        )
    return prompts


def writable_file(path: str | None, where: str, what: str = "file") -> None:
    """An output file's path can be written: not a directory, its parent not a file."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise Refusal(f"{where} {path} is a directory; name the {what} to write")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise Refusal(f"{where} {path}: {parent} is a file, not a directory")


def existing_file(path: str | None, where: str) -> None:
    """An input that is read later (a steering artifact, read by the ranks' driver once the model is
    up) exists and is not a directory; checked by its metadata alone, so a named pipe is not
    drained."""
    if path is None:
        return
    file = Path(path)
    if not file.exists():
        raise Refusal(f"{where} {path}: No such file or directory")
    if file.is_dir():
        raise Refusal(f"{where} {path} is a directory; name a file")


# the fields operations read files or directories from; an output may be none of them
INPUT_FIELDS = (
    "model",
    "input",
    "pairs",
    "prompts",
    "request",
    "system",
    "examples",
    "adapter",
    "vector",
    "decisions",
    "control",
    "calibration",
)


def output_not_an_input(request) -> None:
    """A request's output is none of its own inputs (duck-typed: any request with .output and
    .label)."""
    inputs = [(name, request.label(name), getattr(request, name, None)) for name in INPUT_FIELDS]
    not_an_input(getattr(request, "output", None), request.label("output"), inputs)


def not_an_input(output: str | None, where: str, inputs: list[tuple[str, str, str | None]]) -> None:
    """Refuse an output that is, or lies inside, an input (name, label, path): writing it would
    replace what the command reads (ster extract --output MODEL/model.safetensors replaced the
    weights). Paths are compared resolved, so a symlink or a relative spelling of an input is caught
    too."""
    if output is None:
        return
    target = Path(output).resolve()
    for name, label, path in inputs:
        # a Hub id or standard input: no local file
        if not path or path == "-" or not Path(path).exists():
            continue
        source = Path(path).resolve()
        if target == source or (target.exists() and target.samefile(source)):
            what = "the model" if name == "model" else "an input"
        elif source.is_dir() and target.is_relative_to(source):
            what = (
                ("the model's own file" if target.exists() else "inside the model directory")
                if name == "model"
                else "inside an input"
            )
        else:
            continue
        raise Refusal(f"{where} {output} is {what} ({label} {path}); write somewhere else")

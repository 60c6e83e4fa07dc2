"""Reading the small input files operations take (prompts, pairs, requests, system messages), each
refused in one line naming the field it came from, before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

from ster_dist.errors import Refusal

MAX_INPUT_BYTES = 256 << 20  # an input file past this is refused before it is read whole


def read_text(path: str, where: str) -> str:
    file = Path(path)
    try:
        if file.is_dir():
            raise Refusal(f"{where} {path} is a directory; name a file")
        size = file.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise Refusal(f"{where} {path} is {size} bytes, more than the {MAX_INPUT_BYTES >> 20} MiB an input "
                          "file may hold; split it")
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"{where} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise Refusal(f"{where} {path} is not UTF-8 text") from None


def read_json(path: str, where: str):
    try:
        return json.loads(read_text(path, where))
    except json.JSONDecodeError as exc:
        raise Refusal(f"{where} {path} is not JSON: {exc.msg} at line {exc.lineno}") from None


def read_prompts(path: str, where: str) -> list[str]:
    data = read_json(path, where)
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise Refusal(f'{where} {path} must be {{"prompts": ["...", ...]}} with at least one string')
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
    up) exists and is not a directory; checked by its metadata alone, so a named pipe is not drained."""
    if path is None:
        return
    file = Path(path)
    if not file.exists():
        raise Refusal(f"{where} {path}: No such file or directory")
    if file.is_dir():
        raise Refusal(f"{where} {path} is a directory; name a file")

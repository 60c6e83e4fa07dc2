"""Reading the files a user names by flag (--examples, --pairs, ...): an unreadable file or bad JSON
is a refusal that names the flag and the path, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from ster_dist.errors import Refusal


def read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"{flag} {path}: {exc.strerror or exc}") from None


def read_json(path: str, flag: str):
    try:
        return json.loads(read_text(path, flag))
    except json.JSONDecodeError as exc:
        raise Refusal(f"{flag} {path} is not JSON: {exc.msg} at line {exc.lineno}") from None

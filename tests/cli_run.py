"""Running `ster` commands in-process from tests, and the toy checkpoint several test files
share."""

from __future__ import annotations

import contextlib
import io
import json

from ster_dist import ops
from ster_dist.cli import parse
from ster_dist.session import Session
from ster_dist.load.toy import make_toy_model


def cli_generate(*argv) -> dict:
    """`ster generate ...`'s operation run directly, as the reference for jobs: no job queue (the
    command line goes through one), its own session and model load, its result as the command
    line shows it."""
    request = parse(["generate", *argv])
    with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
        return json.loads(json.dumps(ops.generate(session, request).shown(request)))


def make_toy(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("toy") / "model"
    make_toy_model(directory, layers=2, hidden=64, seed=0)
    return str(directory)

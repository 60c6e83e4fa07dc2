"""Running `ster` commands in-process from tests, and the toy checkpoint several test files share."""

from __future__ import annotations

import contextlib
import io
import json

from ster_dist.cli import build_parser
from ster_dist.toy import make_toy_model


def cli_generate(*argv) -> dict:
    """`ster generate ...`'s command run directly, as the reference for jobs: no scheduler (the
    command line goes through one), its own model load, its result as the command returns it."""
    args = build_parser().parse_args(["generate", *argv])
    with contextlib.redirect_stderr(io.StringIO()):
        return json.loads(json.dumps(args.run(args)))


def make_toy(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("toy") / "model"
    make_toy_model(directory, layers=2, hidden=64, seed=0)
    return str(directory)

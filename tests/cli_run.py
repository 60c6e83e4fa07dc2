"""Running `ster` commands in-process from tests, and the toy checkpoint several test files share."""

from __future__ import annotations

import contextlib
import io
import json

from ster_dist.cli import main
from ster_dist.toy import make_toy_model


def cli_generate(*argv) -> dict:
    """`ster generate ...` run plainly: no scheduler, its own model load."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["generate", *argv]) == 0
    return json.loads(out.getvalue())


def make_toy(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("toy") / "model"
    make_toy_model(directory, layers=2, hidden=64, seed=0)
    return str(directory)

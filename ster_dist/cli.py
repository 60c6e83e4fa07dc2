"""The `ster` command line: thin argument parsing over the library.

Every command prints its result as JSON on stdout and progress on stderr. A
Refusal is printed once, as one line on stderr, with exit status 2: never a
traceback. Subcommands live in ster_dist/commands/, one module per area.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import pkgutil
import sys

import ster_dist.commands
from ster_dist.errors import Refusal


@functools.cache  # one per process: cli.main and the scheduler's protocol read the same definitions
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ster", description="Run Hugging Face decoder checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(ster_dist.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"ster_dist.commands.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.exit_code = 0
    try:
        # stdout carries the result alone: what libraries print meanwhile (Ray's notices of a dead
        # worker, DeepSpeed's accelerator line) goes to stderr with the progress
        with contextlib.redirect_stdout(sys.stderr):
            result = _run(args)
        print(json.dumps(result, indent=2, ensure_ascii=False))
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr)
        return getattr(refusal, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return args.exit_code


def _run(args):
    """A job kind goes through the scheduler, the same front door as the API and Ray jobs; other
    commands (families, inspect-model, toy-model, ...) run directly."""
    from ster_dist import protocol

    if protocol.kind_of(args) is None:
        return args.run(args)
    from ster_dist.scheduler import run_cli

    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())

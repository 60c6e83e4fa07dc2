"""The `ster` command line, generated from the typed requests of ster_dist/schema.

Every command is one request model: its fields become the command's flags (help text, defaults,
choices), and what the command line states is validated by that model, refused in the flags' words.
Job kinds run as jobs through a job queue in this process (ster_dist.jobqueue.queue.run_cli), the
same front door as job specs and the Python API; the other commands call their operation directly.

Every command prints its result as JSON on stdout and progress events (one JSON object per line)
on stderr (`ster chat` alone keeps stdout for the conversation and prints its totals on stderr). A
refusal is printed once, as one line on stderr, with exit status 2 (3 for running out of memory):
never a traceback. This is the only module that touches argparse.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import types
import typing
from importlib.metadata import PackageNotFoundError, version

from ster_dist.errors import Refusal
from ster_dist.events import json_stderr, progress_line
from ster_dist.schema import (
    REQUESTS,
    BatchRequest,
    ChatRequest,
    QueueRequest,
    Request,
    ServeRequest,
    SubmitRequest,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # one line, like every other refusal (argparse would print its usage block and exit itself)
        raise Refusal(f"{self.prog}: {message}; see `{self.prog} --help`")


def _version() -> str:
    try:
        return version("ster_dist")
    except PackageNotFoundError:
        return "unknown"


@functools.cache
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ster",
        description="Run Hugging Face decoder checkpoints: generate, capture, steer, "
        "decide, merge, across tensor- and expert-parallel ranks.",
    )
    parser.add_argument("--version", action="version", version=f"ster_dist {_version()}")
    _text_flag(parser)
    root = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for cls in REQUESTS:
        *parents, name = cls.command
        sub = root
        for parent in parents:  # `ster steer train`: one parser for "steer", its verbs below it
            sub = _group(root, groups, parent)
        _command(sub, name, cls, cls.summary)
        if cls.ster_name is not None:  # Ster's spelling, beside ster_dist's grouped one
            _command(
                root,
                cls.ster_name,
                cls,
                f"{cls.summary} (Ster's name for `ster {' '.join(cls.command)}`)",
            )
    root.add_parser(
        "request",
        help="run one desktop request to completion: a JSON body (camelCase flags) on "
        "stdin, NDJSON log events and one result event on stdout",
    )
    for cls in REQUESTS:  # Ster 0.14's words (`ster vector train`), the 0.12 ones kept beside them
        if cls.ster_command is not None:
            *parents, name = cls.ster_command
            _command(
                _group(root, groups, parents[0]),
                name,
                cls,
                f"{cls.summary} (also `ster {' '.join(cls.command)}`)",
            )
    return parser


def _group(
    root, groups: dict[str, argparse._SubParsersAction], parent: str
) -> argparse._SubParsersAction:
    if parent not in groups:
        verbs = [c.command[-1] for c in REQUESTS if c.command[:-1] == (parent,)]
        verbs += [
            c.ster_command[-1]
            for c in REQUESTS
            if c.ster_command and c.ster_command[:-1] == (parent,)
        ]
        holder = root.add_parser(parent, help=f"{parent}: " + ", ".join(verbs))
        groups[parent] = holder.add_subparsers(
            dest=f"{parent}_command", required=True, parser_class=_Parser
        )
    return groups[parent]


def _command(sub: argparse._SubParsersAction, name: str, cls: type[Request], summary: str) -> None:
    command = sub.add_parser(name, help=summary, description=summary)
    for field_name, info in cls.model_fields.items():
        _add_field(command, field_name, info)
    _text_flag(command)
    command.set_defaults(request_class=cls)


def _text_flag(parser: argparse.ArgumentParser) -> None:
    """The global --text, before the command or among its flags."""
    parser.add_argument(
        "--text",
        dest="text_output",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print the answer as `path: value` lines instead of JSON",
    )


def _add_field(parser: argparse.ArgumentParser, name: str, info) -> None:
    meta = (info.json_schema_extra or {}).get("cli", {})
    annotation = _unoptional(info.annotation)
    kwargs: dict = {"dest": name, "help": info.description or ""}
    if not info.is_required():
        kwargs["default"] = argparse.SUPPRESS  # only what the line states reaches the request
        if info.default is not None and annotation is not bool:
            kwargs["help"] += f" (default: {info.default})"
    if annotation is bool:
        kwargs["action"] = "store_true"
    elif typing.get_origin(annotation) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(annotation))
    elif annotation in (int, float):
        kwargs["type"] = annotation
    elif typing.get_origin(annotation) is list and meta.get("nargs"):
        kwargs["nargs"] = meta["nargs"]
    elif meta.get("append"):  # list[X], or X | list[X]: the flag repeated, a value each time
        kwargs["action"] = "append"
        if meta.get("int") or meta.get("float"):
            kwargs["type"] = int if meta.get("int") else float
    # anything else (text, a comma list of numbers) is taken as its text; the request parses it
    if meta.get("positional"):
        kwargs.pop("dest")
        kwargs.pop("default", None)
        parser.add_argument(name, **kwargs)
        return
    if "action" not in kwargs and "choices" not in kwargs:
        kwargs["metavar"] = name.upper()
    parser.add_argument(
        meta.get("flag", "--" + name.replace("_", "-")), required=info.is_required(), **kwargs
    )


def _unoptional(annotation):
    """X for `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _refuse_unknown_flags(argv: list[str]) -> None:
    """A flag the command does not have, named with the closest one it has (`--modle`: did you mean
    `--model`?), before argparse's first complaint, which is often about another flag (a required
    --model missing). Prefixes of a flag are left to argparse, which takes an unambiguous one."""
    import difflib

    parser: argparse.ArgumentParser = build_parser()
    for token in argv:
        if token == "--":
            return
        commands = next(
            (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None
        )
        if commands and token in commands:  # `ster steer train`: the words choose the parser
            parser = commands[token]
            continue
        flag = token.split("=", 1)[0]
        # "--a b": a value, to argparse
        if not flag.startswith("--") or len(flag) == 2 or " " in flag:
            continue
        known = [s for s in parser._option_string_actions if s.startswith("--")]
        if flag in known or any(k.startswith(flag) for k in known):
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.5)
        hint = f"did you mean `{close[0]}`? " if close else ""
        raise Refusal(f"{parser.prog}: unknown flag {flag}; {hint}see `{parser.prog} --help`")


def parse(argv: list[str] | None = None) -> Request:
    """The typed request of a command line, or a one-line Refusal in the flags' words."""
    _refuse_unknown_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    cls = args.request_class
    given = {
        name: value
        for name, value in vars(args).items()
        if name in cls.model_fields and not name.endswith("_command")
    }
    return cls.parse(given, cli=True)


def parse_command(cls: type[Request], argv: list[str] | None, prog: str) -> Request:
    """One request's command line on its own (jobs/run.py, the `ray job submit` entrypoint)."""
    parser = _Parser(prog=prog, description=cls.summary)
    for field_name, info in cls.model_fields.items():
        _add_field(parser, field_name, info)
    given = {
        name: value
        for name, value in vars(parser.parse_args(argv)).items()
        if name in cls.model_fields
    }
    return cls.parse(given, cli=True)


def run(request: Request) -> tuple[object, int]:
    """(result, exit status) of one request, through the job queue when it is a job kind."""
    if isinstance(request, SubmitRequest):
        from ster_dist.jobqueue.submit import submit

        return submit(request)
    if isinstance(request, BatchRequest):
        from ster_dist.batch.run import run_batch

        return run_batch(request), 0
    if isinstance(request, QueueRequest):
        from ster_dist.jobqueue.submit import queue_action

        return queue_action(request), 0
    if isinstance(request, ServeRequest):
        from ster_dist.serve.run import serve

        return serve(request), 0
    if isinstance(request, ChatRequest):
        from ster_dist.chat import chat

        return chat(request), 0
    if request.kind is not None:
        from ster_dist.jobqueue.in_process import run_cli

        return run_cli(request)
    from ster_dist import ops

    result = ops.OPERATIONS[type(request)].run(request)
    return result, ops.exit_code(request, result)


def refuse_early(request: Request) -> None:
    """What the command line can refuse before anything starts (torch, Ray, a model load): a --model
    that names no directory here and is no owner/name Hub id (resolve.check_reference lists a
    directory, nothing more). The request's own validators have already checked its flags (serve's
    --host)."""
    from ster_dist.schema.common import ModelRef

    if isinstance(request, ModelRef):
        from ster_dist.resolve import check_reference

        check_reference(request.model)


def _for_a_person(request: Request) -> bool:
    """`ster chat` at a terminal: progress as one line that updates, totals in words; JSON events
    with --events or where stderr is not a terminal (a pipe, a file, a test)."""
    return isinstance(request, ChatRequest) and not request.events and sys.stderr.isatty()


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    # NDJSON on stdout, its own statuses: not one of the generated commands
    if words[:1] == ["request"]:
        from ster_dist.desktop_request import main as request_main

        return request_main(words[1:], run)
    try:
        request = parse(argv)  # --help and --version print on stdout and exit here
        refuse_early(request)
        person = _for_a_person(request)
        # stdout carries the result alone: what libraries print meanwhile (Ray's notices of a dead
        # worker, DeepSpeed's accelerator line) goes to stderr with the progress, as log events
        with progress_line() if person else json_stderr(), contextlib.redirect_stdout(sys.stderr):
            result, code = run(request)
        if getattr(request, "stream", False):
            print()  # the answer went out as it came (its record is the job's, not this stream's)
        elif getattr(request, "format", "json") == "text":
            # generate --format text: the answer alone, its record left to the job
            print(result["text"])
        elif person:
            from ster_dist.chat import totals_in_words

            print(totals_in_words(result), file=sys.stderr)
        # stdout held the conversation or the ready line: totals go with the events
        elif not request.result_on_stdout:
            print(json.dumps(result, ensure_ascii=False), file=sys.stderr)
        elif getattr(build_parser().parse_args(argv), "text_output", False):
            from ster_dist.text_lines import text_lines

            print("\n".join(text_lines(json.loads(json.dumps(result, default=str)))))
        else:
            print(json.dumps(result, indent=2, ensure_ascii=False))
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr)
        return getattr(refusal, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())

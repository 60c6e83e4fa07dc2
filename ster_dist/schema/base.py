"""The typed request every operation takes, and how its validation errors read.

One pydantic model per operation is the single statement of what an operation accepts: its
fields with their help text, defaults and constraints. The command line is generated from it
(ster_dist/cli.py), job specs validate against it (ster_dist/protocol.py), and the HTTP server
of a later issue reuses it. A refusal names the field the way its reader wrote it: `--top-p`
on a command line, `job spec field 'top_p'` in a spec (`Request.label`), `job spec field 'topP'`
in a spec that spelled it so (the context's `written`: field name -> the key as written).

Validation takes a context: `cli` (a command line being run now, in this process), `queued` (a
job that may run later, elsewhere: it must state its seed and may not read standard input),
`check_model` (read a local model's config.json to check layer indexes; never its weights).
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo

from ster_dist.errors import Refusal


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def label(name: str, cli: bool, written: dict[str, str] | None = None) -> str:
    """How a refusal names a field: as the flag of a command line, or as the spec's field, spelled
    as the spec wrote it (maxNewTokens, max-new-tokens) when `written` says so."""
    return flag(name) if cli else f"job spec field {(written or {}).get(name, name)!r}"


def label_in(info: ValidationInfo | None, name: str) -> str:
    context = (info.context if info is not None else None) or {}
    return label(name, bool(context.get("cli")), context.get("written"))


def context_of(info: ValidationInfo | None, key: str, default: bool = False) -> bool:
    return bool(info.context.get(key, default)) if info is not None and info.context else default


class Request(BaseModel):
    """What one operation takes. Subclasses set `kind` (the job kind, or None for a command that is
    not a job), `command` (its words on the command line) and `summary` (its one-line help)."""

    model_config = ConfigDict(
        extra="forbid", strict=True, validate_default=False, populate_by_name=True
    )

    kind: ClassVar[str | None] = None
    command: ClassVar[tuple[str, ...]] = ()
    # Ster's own top-level name for the command, where ster_dist files it under a group (`ster
    # train` for
    # `ster steer train`): the command line takes both, and Ster's serve API names its endpoint so
    ster_name: ClassVar[str | None] = None
    # Ster 0.14's words for it (`vector train` for `steer train`, `tune merge` for `merge`): another
    # name for the same request, on the command line and as a `ster request` operation
    ster_command: ClassVar[tuple[str, ...] | None] = None
    summary: ClassVar[str] = ""
    # fields that belong to whoever submits, not to a queued job (the job queue decides them)
    submitter_fields: ClassVar[dict[str, str]] = {}
    # False for a command whose stdout is its own (a server's ready line): its result goes to stderr
    result_on_stdout: ClassVar[bool] = True

    _cli: bool = PrivateAttr(default=False)

    def label(self, name: str) -> str:
        return label(name, self._cli)

    def given(self) -> dict:
        """The fields this request states (not its defaults): what a job spec carries."""
        return self.model_dump(include=self.model_fields_set, mode="json", by_alias=True)

    @classmethod
    def parse(
        cls,
        data: dict,
        *,
        cli: bool = False,
        queued: bool = False,
        check_model: bool = True,
        written: dict[str, str] | None = None,
    ) -> Request:
        """The request, or a one-line Refusal naming the field at fault (as `written` spells it)."""
        context = {
            "cli": cli,
            "queued": queued,
            "check_model": check_model,
            "written": written or {},
        }
        try:
            request = cls.model_validate(data, context=context)
        except ValidationError as exc:
            raise Refusal(explain(cls, exc, cli, written)) from None
        request._cli = cli
        return request


def cli_meta(**meta) -> dict:
    """Field metadata for the command line: positional=True, metavar=..., hidden=True (spec
    only)."""
    return {"cli": meta}


def field(default: Any = ..., help: str = "", **kwargs) -> Any:  # noqa: A002 (the help text)
    extra = kwargs.pop("cli", None)
    return Field(
        default, description=help, json_schema_extra=cli_meta(**extra) if extra else None, **kwargs
    )


_PHRASES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a finite number",
    "float_parsing": "must be a finite number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "bool_type": "is a switch and must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
}


def explain(
    cls: type[Request], exc: ValidationError, cli: bool, written: dict[str, str] | None = None
) -> str:
    """The first error of a validation, in one line naming its field and what it got."""
    error = exc.errors(include_url=False)[0]
    loc = [part for part in error["loc"] if not isinstance(part, int)]
    where = _where(error["loc"], cli, written)
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        if cli:
            return f"{where} is required"
        return (
            f"a {cls.kind or cls.command[0]} job spec is missing the required field {loc[-1]!r}"
            if len(loc) == 1
            else f"{where} is missing"
        )
    if kind == "extra_forbidden":
        known = ", ".join(sorted(n for n in cls.model_fields if n not in cls.submitter_fields))
        return f"unknown field {loc[-1]!r} for {cls.kind} jobs; known fields: {known}"
    if kind == "literal_error":
        return f"{where} must be one of {ctx.get('expected', '').replace(' or ', ', ')}, got {shown(got)}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = {
            "greater_than_equal": "zero or more" if ctx.get("ge") == 0 else "{ge} or more",
            "greater_than": "more than {gt}",
            "less_than_equal": "at most {le}",
            "less_than": "less than {lt}",
        }[kind].format(**ctx)
        return f"{where} must be {bound}, got {shown(got)}"
    if kind == "value_error":
        return f"{where}: {str(ctx.get('error', error['msg']))}"
    phrase = _PHRASES.get(kind, error["msg"].lower())
    return f"{where} {phrase}, got {shown(got)}"


def _where(loc: tuple, cli: bool, written: dict[str, str] | None = None) -> str:
    if not loc:
        return "the request"
    head = label(str(loc[0]), cli, written)
    rest = "".join(f" item {p}" if isinstance(p, int) else f" field {p!r}" for p in loc[1:])
    return head + rest


def kind_of_value(value) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
        bytes: "bytes",
    }.get(type(value), type(value).__name__)


def shown(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    else:
        text = json.dumps(value, default=str) if not isinstance(value, bytes) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind_of_value(value)} {text}"

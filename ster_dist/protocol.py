"""Job specs and results: what the scheduler accepts and what it hands back.

A job spec is the arguments of the CLI command of its kind, as a mapping of flag names to
values, plus `kind` and optional `id` and `priority`:

    {"kind": "generate", "model": "models/smollm2", "prompt": "Hi", "max_new_tokens": 8}

It is validated on arrival against the command's own argparse definition (sched/fields.py: so
the scheduler, the CLI and the Python API can never disagree on a flag), then against the rules
a queued job needs beyond the CLI (sched/rules.py: a token budget is not negative, a sampled job
states its seed so a retry or a re-run after a restart gives the same answer, a layer the model
does not have): every refusal names the field and happens before any model is touched. Specs
and results travel as msgpack; spec files may be JSON or YAML (read with the safe loader only).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from ster_dist.errors import Refusal
from ster_dist.sched import rules
from ster_dist.sched.fields import (
    check_value,
    convert,
    default,
    is_int,
    kind_of_value,
    required,
    shown,
)

# job kind -> the CLI command path it runs
JOB_KINDS: dict[str, tuple[str, ...]] = {
    "generate": ("generate",),
    "extract": ("extract",),
    "steer-train": ("steer", "train"),
    "steer-evaluate": ("steer", "evaluate"),
    "steer-optimize": ("steer", "optimize"),
    "decide": ("decide",),
    "merge": ("merge",),
    "parity": ("parity",),
}
PROTOCOL_FIELDS = ("kind", "id", "priority")
# flags of the command that belong to whoever submits, not to the job: the scheduler decides them
SUBMITTER_FIELDS = {"address": "give the cluster to `ster submit --address` or Engine(address=...), not to a job"}
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class JobSpec:
    """A validated job: its id, kind, priority and the fields it gave (argparse dest names)."""

    id: str
    kind: str
    priority: int = 0
    fields: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "id": self.id, "priority": self.priority, **self.fields}

    def namespace(self) -> argparse.Namespace:
        """The argparse Namespace the command would get from `ster <kind> ...` with these flags."""
        if _is_batch_merge(self.kind, self.fields):
            from ster_dist.sched.merges import run_batch_merge

            return argparse.Namespace(command="merge", merges=self.fields["merges"], exit_code=0,
                                      max_shard_size=self.fields.get("max_shard_size"), run=run_batch_merge)
        parsers = command_parsers(self.kind)
        ns = argparse.Namespace()
        for name, (parent_dest, parser) in zip(JOB_KINDS[self.kind], parsers):
            setattr(ns, parent_dest, name)
            for action in parser._actions:
                if action.dest is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS:
                    setattr(ns, action.dest, default(action))
            for key, value in parser._defaults.items():
                setattr(ns, key, value)
        for key, value in self.fields.items():
            action = _actions(self.kind)[key]
            setattr(ns, key, convert(action, value))
        ns.exit_code = 0
        return ns


# ---- the command definitions -------------------------------------------------------------------

def _root() -> argparse.ArgumentParser:
    from ster_dist.cli import build_parser  # cached there: one parser per process

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


@functools.cache
def _lookup(kind: str):
    """[(the dest naming the chosen subcommand, its parser), ...] down the kind's command path, or
    None when this build does not register that command (cli.py keeps a placeholder for it)."""
    parser, path = _root(), []
    for name in JOB_KINDS[kind]:
        sub = _subparsers(parser)
        child = sub.choices.get(name) if sub is not None else None
        if child is None or _is_placeholder(child):
            return None
        path.append((sub.dest, child))
        parser = child
    return tuple(path)


def command_parsers(kind: str) -> tuple[tuple[str, argparse.ArgumentParser], ...]:
    """The kind's command path; refuses a kind that is unknown or not registered in this build."""
    if kind not in JOB_KINDS:
        raise Refusal(f"unknown job kind {kind!r}; give one of: {', '.join(available_kinds()) or 'none'}")
    path = _lookup(kind)
    if path is None:
        raise Refusal(f"job kind {kind!r} is not available in this ster_dist build yet (no `ster "
                      f"{' '.join(JOB_KINDS[kind])}` command); give one of: {', '.join(available_kinds())}")
    return path


def _is_placeholder(parser: argparse.ArgumentParser) -> bool:
    run = parser._defaults.get("run")
    if run is None:
        return _subparsers(parser) is None
    return getattr(run, "__name__", "") == "cmd_planned"


def available_kinds() -> list[str]:
    return [kind for kind in JOB_KINDS if _lookup(kind) is not None]


@functools.cache
def _actions(kind: str) -> dict[str, argparse.Action]:
    parser = command_parsers(kind)[-1][1]
    return {a.dest: a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction))}


@functools.cache
def _names(kind: str) -> dict[str, str]:
    """Every spelling a spec may use for a flag (max_new_tokens, max-new-tokens, --max-new-tokens)."""
    names = {}
    for dest, action in _actions(kind).items():
        names[dest] = dest
        for option in action.option_strings:
            bare = option.lstrip("-")
            names[bare] = names[option] = names[bare.replace("-", "_")] = dest
    return names


def kind_of(args: argparse.Namespace) -> str | None:
    """The job kind of a parsed `ster ...` command line, or None when it is not a job (families, ...)."""
    for kind in available_kinds():
        path = _lookup(kind)
        if all(getattr(args, dest, None) == name for (dest, _), name in zip(path, JOB_KINDS[kind])):
            return kind
    return None


def spec_from_args(kind: str, args: argparse.Namespace) -> dict:
    """The job spec of a parsed command line: every flag it has a value for, written as a spec
    states it (a converted value back to the text the flag took)."""
    spec = {"kind": kind}
    for dest, action in _actions(kind).items():
        value = getattr(args, dest, None)
        if value is None or dest in SUBMITTER_FIELDS:
            continue
        if isinstance(action, argparse._StoreFalseAction):
            value = not value
        elif isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction):
            value = value == action.const
        elif action.type not in (None, str, int, float) and action.nargs != 0:
            value = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        spec[dest] = value
    return spec


def accepts(kind: str, name: str) -> bool:
    return name in _names(kind)


# ---- validation ------------------------------------------------------------------------------

def validate(spec, check_model: bool = True, cli: bool = False) -> JobSpec:
    """A JobSpec from a mapping (or msgpack bytes), or a Refusal naming the field at fault (as its
    flag when `cli`: the spec is a command line being run now, see sched/rules.py)."""
    if isinstance(spec, (bytes, bytearray)):
        spec = unpack(spec, "job spec")
    if not isinstance(spec, dict):
        raise Refusal(f"a job spec must be a mapping of field names to values, got {kind_of_value(spec)}")
    if "kind" not in spec:
        raise Refusal("job spec is missing the field 'kind'; give one of: " + ", ".join(available_kinds()))
    kind = spec["kind"]
    if not isinstance(kind, str):
        raise Refusal(f"job spec field 'kind' must be a string, got {kind_of_value(kind)}")
    command_parsers(kind)
    job_id = spec.get("id")
    if job_id is None:
        job_id = uuid.uuid4().hex[:16]
    elif not isinstance(job_id, str) or not _ID.match(job_id):
        raise Refusal(f"job spec field 'id' must be 1-128 letters, digits, '.', '_', ':' or '-', got {job_id!r}")
    priority = spec.get("priority", 0)
    if not is_int(priority):
        raise Refusal(f"job spec field 'priority' must be an integer, got {kind_of_value(priority)}")
    if _is_batch_merge(kind, spec):
        return _batch_merge(spec, job_id, int(priority))
    names, actions = _names(kind), _actions(kind)
    fields: dict = {}
    for key, value in spec.items():
        if key in PROTOCOL_FIELDS:
            continue
        if not isinstance(key, str):
            raise Refusal(f"job spec field names must be strings, got {kind_of_value(key)}")
        dest = names.get(key)
        if dest is None:
            known = ", ".join(sorted(set(actions) - set(SUBMITTER_FIELDS)))
            raise Refusal(f"unknown field {key!r} for {kind} jobs; known fields: {known}")
        if dest in SUBMITTER_FIELDS:
            raise Refusal(f"job spec field {key!r} is not a job setting: {SUBMITTER_FIELDS[dest]}")
        if dest in fields:
            raise Refusal(f"job spec gives the field {dest!r} twice (as {key!r} too); keep one")
        check_value(kind, dest, actions[dest], value)
        fields[dest] = value
    for dest, action in actions.items():
        if dest not in fields and required(action) and dest not in SUBMITTER_FIELDS:
            raise Refusal(f"a {kind} job spec is missing the required field {dest!r}")
    job = JobSpec(job_id, kind, int(priority), fields)
    rules.check(job, check_model, cli)
    return job


def _is_batch_merge(kind: str, fields: dict) -> bool:
    return kind == "merge" and "merges" in fields


def _batch_merge(spec: dict, job_id: str, priority: int) -> JobSpec:
    from ster_dist.sched.merges import BATCH_FIELDS, check_batch

    fields = {k: v for k, v in spec.items() if k not in PROTOCOL_FIELDS}
    for key in fields:
        if key not in BATCH_FIELDS:
            raise Refusal(f"unknown field {key!r} for a batch merge job; known fields: {', '.join(BATCH_FIELDS)} "
                          "(or give one merge's fields without 'merges')")
    check_batch(fields)
    return JobSpec(job_id, "merge", priority, fields)


# ---- msgpack and files -------------------------------------------------------------------------

def pack(value) -> bytes:
    """msgpack bytes of a JSON-like value (paths and other objects as their text)."""
    return msgpack.packb(_plain(value), use_bin_type=True)


def unpack(data: bytes, what: str = "message"):
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise Refusal(f"the {what} is not valid msgpack: {exc}") from None


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return str(value)


RESULT_FIELDS = {"id": str, "kind": str, "status": str, "attempts": int, "exit_code": int}
STATUSES = ("done", "failed")


def make_result(job: JobSpec, status: str, result=None, error: str | None = None, attempts: int = 1,
                exit_code: int = 0, batch: int = 1) -> dict:
    record = {"id": job.id, "kind": job.kind, "status": status, "result": _plain(result), "error": error,
              "attempts": attempts, "exit_code": exit_code, "batch": batch}
    check_result(record)
    return record


def check_result(record) -> dict:
    """A result as it arrives from a scheduler: its fields and their types, or a Refusal."""
    if not isinstance(record, dict):
        raise Refusal(f"a job result must be a mapping, got {kind_of_value(record)}")
    for name, kind in RESULT_FIELDS.items():
        if not isinstance(record.get(name), kind):
            raise Refusal(f"job result field {name!r} must be {kind.__name__}, got {shown(record.get(name))}")
    if record["status"] not in STATUSES:
        raise Refusal(f"job result field 'status' must be one of {', '.join(STATUSES)}, got {record['status']!r}")
    if record["status"] == "failed" and not isinstance(record.get("error"), str):
        raise Refusal("a failed job result must carry its error")
    return record


def load_spec_file(path: str) -> list[dict]:
    """The job specs in a JSON or YAML file: one spec, a list of specs, or {"jobs": [...]}."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"job spec file {path}: {exc.strerror or exc}") from None
    suffix = Path(path).suffix.lower()
    data = None
    if suffix in (".yaml", ".yml"):
        data = _yaml(text, path)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if suffix == ".json":
                raise Refusal(f"job spec file {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
            data = _yaml(text, path)
    if isinstance(data, dict) and "jobs" in data and "kind" not in data:
        data = data["jobs"]
    specs = data if isinstance(data, list) else [data]
    if not specs:
        raise Refusal(f"job spec file {path} lists no jobs")
    for spec in specs:
        if not isinstance(spec, dict):
            raise Refusal(f"job spec file {path}: every job must be a mapping, got {kind_of_value(spec)}")
    return specs


def _yaml(text: str, path: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise Refusal(f"job spec file {path} is not YAML{where}: {getattr(exc, 'problem', exc)}") from None

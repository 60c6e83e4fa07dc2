"""Job specs and results: what the job queue accepts and what it hands back.

A job spec is a typed request of its kind (ster_dist/schema) as a mapping of field names to
values, plus `kind` and optional `id`, `priority` and `timeout_s`:

    {"kind": "generate", "model": "models/smollm2", "prompt": "Hi", "max_new_tokens": 8,
    "timeout_s": 60}

`timeout_s` is how long the job may run (the job queue fails it past that and goes on to the next);
it is not `ster submit --timeout`, which only stops the submitter waiting.

It is validated on arrival against the request model of its kind (the same model the command line
is generated from, so the job queue, the CLI and the Python API can never disagree on a field),
with the rules a queued job needs beyond a command line (a sampled job states its seed so a retry
or a re-run after a restart gives the same answer, no standard input): every refusal names the
field and happens before any model is touched. Specs and results travel as msgpack; spec files
may be JSON or YAML (read with the safe loader only).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgpack

from ster_dist.errors import Refusal
from ster_dist.schema import JOB_REQUESTS, BatchMergeRequest, Request
from ster_dist.schema.base import kind_of_value, shown

PROTOCOL_FIELDS = ("kind", "id", "priority", "timeout_s")
MAX_TIMEOUT_S = 365 * 86400.0  # a job's timeout_s: a year is "none"; leave the field out instead
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True)
class JobSpec:
    """A validated job: its id, kind, priority, typed request and how long it may run (None: the
    job queue's default)."""

    id: str
    kind: str
    priority: int
    request: Request
    timeout_s: float | None = None

    @property
    def fields(self) -> dict:
        """The fields the spec stated (not the request's defaults)."""
        return self.request.given()

    def to_dict(self) -> dict:
        timeout = {} if self.timeout_s is None else {"timeout_s": self.timeout_s}
        return {
            "kind": self.kind,
            "id": self.id,
            "priority": self.priority,
            **timeout,
            **self.fields,
        }


def available_kinds() -> list[str]:
    return list(JOB_REQUESTS)


def request_class(kind, fields: dict) -> type[Request]:
    if not isinstance(kind, str):
        raise Refusal(f"job spec field 'kind' must be a string, got {kind_of_value(kind)}")
    if kind not in JOB_REQUESTS:
        raise Refusal(f"unknown job kind {kind!r}; give one of: {', '.join(available_kinds())}")
    if kind == "merge" and "merges" in fields:
        return BatchMergeRequest
    return JOB_REQUESTS[kind]


def camel(name: str) -> str:
    """A snake_case field name as Ster's serve API spells it: max_new_tokens -> maxNewTokens."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def names(cls: type[Request]) -> dict[str, str]:
    """Every spelling a spec may use for a field (max_new_tokens, max-new-tokens, --max-new-tokens,
    maxNewTokens)."""
    out = {}
    for name, info in cls.model_fields.items():
        for spelling in {name, info.alias or name}:
            dashed = spelling.replace("_", "-")
            out[spelling] = out[dashed] = out["--" + dashed] = out[camel(spelling)] = (
                info.alias or name
            )
    return out


def validate(spec, check_model: bool = True, cli: bool = False) -> JobSpec:
    """A JobSpec from a mapping (or msgpack bytes), or a Refusal naming the field at fault (as its
    flag when `cli`: the spec is a command line being run now)."""
    if isinstance(spec, (bytes, bytearray)):
        spec = unpack(spec, "job spec")
    if not isinstance(spec, dict):
        raise Refusal(
            f"a job spec must be a mapping of field names to values, got {kind_of_value(spec)}"
        )
    if "kind" not in spec:
        raise Refusal(
            "job spec is missing the field 'kind'; give one of: " + ", ".join(available_kinds())
        )
    cls = request_class(spec["kind"], spec)
    job_id = spec.get("id")
    if job_id is None:
        job_id = uuid.uuid4().hex[:16]
    elif not isinstance(job_id, str) or not _ID.match(job_id):
        raise Refusal(
            f"job spec field 'id' must be 1-128 letters, digits, '.', '_', ':' or '-', got {job_id!r}"
        )
    priority = spec.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise Refusal(
            f"job spec field 'priority' must be an integer, got {kind_of_value(priority)}"
        )
    timeout_s = spec.get("timeout_s")
    if timeout_s is not None and (
        not isinstance(timeout_s, (int, float))
        or isinstance(timeout_s, bool)
        or not 0 < timeout_s < MAX_TIMEOUT_S
    ):
        raise Refusal(
            f"job spec field 'timeout_s' must be a number of seconds above 0 and below "
            f"{MAX_TIMEOUT_S:.0f}, got {shown(timeout_s)}"
        )
    fields = {key: value for key, value in spec.items() if key not in PROTOCOL_FIELDS}
    request = parse_fields(cls, fields, f"{spec['kind']} jobs", cli=cli, check_model=check_model)
    return JobSpec(
        job_id, spec["kind"], priority, request, None if timeout_s is None else float(timeout_s)
    )


def parse_fields(
    cls: type[Request], spec: dict, what: str, cli: bool = False, check_model: bool = True
) -> Request:
    """The typed request of a mapping of fields in any spelling names() knows, validated as a queued
    job's (as a command line's when `cli`); a refusal names a field as the mapping wrote it. `what`
    names the requests in the refusal of an unknown field ("generate jobs")."""
    spelled, fields, written = names(cls), {}, {}
    for key, value in spec.items():
        if not isinstance(key, str):
            raise Refusal(f"job spec field names must be strings, got {kind_of_value(key)}")
        name = spelled.get(key)
        if name is None:
            known = sorted(n for n in cls.model_fields if n not in cls.submitter_fields)
            if key != key.lower():  # a camelCase spec hears of the fields in camelCase
                known = sorted(map(camel, known))
            raise Refusal(f"unknown field {key!r} for {what}; known fields: {', '.join(known)}")
        if name in cls.submitter_fields and not cli:
            raise Refusal(
                f"job spec field {key!r} is not a job setting: {cls.submitter_fields[name]}"
            )
        if name in fields:
            raise Refusal(f"job spec gives the field {name!r} twice (as {key!r} too); keep one")
        fields[name] = value
        if key != name:
            written[name] = key
    return cls.parse(fields, cli=cli, queued=not cli, check_model=check_model, written=written)


def job_from_request(request: Request, job_id: str | None = None, priority: int = 0) -> JobSpec:
    """A command line's (or the API's) typed request as a job, without a round trip through a
    dict."""
    return JobSpec(job_id or uuid.uuid4().hex[:16], request.kind, priority, request)


# ---- msgpack and files -------------------------------------------------------------------------


def pack(value) -> bytes:
    """msgpack bytes of a JSON-like value (paths and other objects as their text)."""
    return msgpack.packb(_plain(value), use_bin_type=True)


def unpack(data: bytes, what: str = "message"):
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
        ValueError,
        TypeError,
    ) as exc:
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
STATUSES = ("done", "failed", "cancelled")


def make_result(
    job: JobSpec,
    status: str,
    result=None,
    error: str | None = None,
    attempts: int = 1,
    exit_code: int = 0,
    batch: int = 1,
) -> dict:
    """The record of a finished job (a JobSpec, or a journal's raw spec that no longer
    validates)."""
    record = {
        "id": job.id,
        "kind": job.kind,
        "status": status,
        "result": _plain(result),
        "error": error,
        "attempts": attempts,
        "exit_code": exit_code,
        "batch": batch,
    }
    check_result(record)
    return record


def check_result(record) -> dict:
    """A result as it arrives from a job queue: its fields and their types, or a Refusal."""
    if not isinstance(record, dict):
        raise Refusal(f"a job result must be a mapping, got {kind_of_value(record)}")
    for name, kind in RESULT_FIELDS.items():
        if not isinstance(record.get(name), kind):
            raise Refusal(
                f"job result field {name!r} must be {kind.__name__}, got {shown(record.get(name))}"
            )
    if record["status"] not in STATUSES:
        raise Refusal(
            f"job result field 'status' must be one of {', '.join(STATUSES)}, got {record['status']!r}"
        )
    if record["status"] != "done" and not isinstance(record.get("error"), str):
        raise Refusal(f"a {record['status']} job result must carry its error")
    return record


MAX_SPEC_FILE_BYTES = 16 << 20  # a spec file past this is refused before it is parsed


def load_spec_file(path: str) -> list[dict]:
    """The job specs in a JSON or YAML file: one spec, a list of specs, or {"jobs": [...]}. Bounded:
    the file's size, YAML aliases (a "billion laughs" expands from a few lines) and nesting
    depth."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_SPEC_FILE_BYTES:
            raise Refusal(
                f"job spec file {path} is {size} bytes, more than the {MAX_SPEC_FILE_BYTES >> 20} MiB a "
                "spec file may hold; name prompts in a prompts file instead"
            )
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"job spec file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise Refusal(f"job spec file {path} is not UTF-8 text") from None
    try:
        return _specs_in(text, path)
    except RecursionError:
        raise Refusal(
            f"job spec file {path} nests too deeply; a spec is a flat mapping of fields"
        ) from None


def _specs_in(text: str, path: str) -> list[dict]:
    suffix = Path(path).suffix.lower()
    data = None
    if suffix in (".yaml", ".yml"):
        data = _yaml(text, path)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if suffix == ".json":
                raise Refusal(
                    f"job spec file {path} is not JSON: {exc.msg} at line {exc.lineno}"
                ) from None
            data = _yaml(text, path)
    if isinstance(data, dict) and "jobs" in data and "kind" not in data:
        data = data["jobs"]
    specs = data if isinstance(data, list) else [data]
    if not specs:
        raise Refusal(f"job spec file {path} lists no jobs")
    for spec in specs:
        if not isinstance(spec, dict):
            raise Refusal(
                f"job spec file {path}: every job must be a mapping, got {kind_of_value(spec)}"
            )
    return specs


def _yaml(text: str, path: str):
    import yaml

    class NoAliases(yaml.SafeLoader):
        """The safe loader without aliases: a spec never needs one, and an alias of an alias of ...
        expands a few lines into gigabytes."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.events.AliasEvent):
                mark = self.peek_event().start_mark
                raise Refusal(
                    f"job spec file {path} uses a YAML alias at line {mark.line + 1}; write the value out"
                )
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=NoAliases)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise Refusal(
            f"job spec file {path} is not YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None

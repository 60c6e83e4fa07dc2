"""A decide request (TypeSafe's System One shape, as Ster reads it): a state and a map of typed
questions, checked whole before any weight is read, each refusal naming its question.

Questions are kept in id order and choice options in name order (Ster's BTreeMaps: code-point
order); a request field that is not a string reaches the model as its pretty JSON.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ster_dist.errors import Refusal

MAX_OPTIONS = 26
TYPES = ("choice", "score", "noul")


def text_of(value) -> str:
    """A request field as the text the model reads: a string as itself, null as nothing, anything
    else as its JSON (two-space indent, as serde_json's pretty printer writes it)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, indent=2, ensure_ascii=False)


def _describe(name: str, description) -> str:
    text = text_of(description)
    return f"{name}: {text}" if text.strip() else name


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    instructions: object
    # choice: {name: description}; score: [level, ...]; noul: {"true"?, "false"?} or None
    criteria: object

    def options(self) -> list[str]:
        """Option texts in canonical order: choice names sorted, score levels in order, yes then
        no."""
        if self.type == "choice":
            return [_describe(name, self.criteria[name]) for name in self.names()]
        if self.type == "score":
            return [text_of(level) for level in self.criteria]
        criteria = self.criteria or {}
        return [_describe("yes", criteria.get("true")), _describe("no", criteria.get("false"))]

    def names(self) -> list[str]:
        return sorted(self.criteria) if self.type == "choice" else []


@dataclass(frozen=True)
class Request:
    state: object
    questions: tuple[Question, ...]  # in id order


def load_request(path: str) -> Request:
    """Read `path` (or standard input for "-") and check it; every refusal before any model work."""
    if path == "-":
        raw, where = sys.stdin.read(), "on standard input"
    else:
        try:
            raw = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise Refusal(
                f"failed to read {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        where = path
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Refusal(f"invalid decide request {where}: {exc.msg} at line {exc.lineno}") from None
    return parse_request(data, where)


def parse_request(data, where: str = "") -> Request:
    def bad(why: str):
        return Refusal(f"invalid decide request {where}: {why}".replace("request :", "request:"))

    if not isinstance(data, dict) or "state" not in data or "questions" not in data:
        raise bad(
            'expected {"state": ..., "questions": {"id": {"type": ..., "instructions": ...}}}'
        )
    if not isinstance(data["questions"], dict):
        raise bad("questions must map question ids to questions")
    if data.get("model") is not None and not isinstance(data["model"], str):
        raise bad(
            "model must be a string (it is ignored: the model is the one on the command line)"
        )
    questions = []
    for qid in sorted(data["questions"]):
        body = data["questions"][qid]
        if not isinstance(body, dict) or body.get("type") not in TYPES:
            raise bad(f"question '{qid}' needs a type of choice, score or noul")
        if "instructions" not in body:
            raise bad(f"question '{qid}' has no instructions")
        kind, criteria = body["type"], body.get("criteria")
        if kind == "choice" and not isinstance(criteria, dict):
            raise bad(
                f"choice question '{qid}' needs criteria mapping option names to descriptions"
            )
        if kind == "score" and not isinstance(criteria, list):
            raise bad(f"score question '{qid}' needs criteria listing its levels in order")
        if (
            kind == "noul"
            and criteria is not None
            and (not isinstance(criteria, dict) or set(criteria) - {"true", "false"})
        ):
            raise bad(f'noul question \'{qid}\' criteria may only carry "true" and "false"')
        questions.append(Question(qid, kind, body["instructions"], criteria))
    request = Request(data["state"], tuple(questions))
    validate(request)
    return request


def validate(request: Request) -> None:
    """Ster's request refusals, in Ster's order."""
    if not text_of(request.state).strip():
        raise Refusal("a decide request has an empty state")
    if not request.questions:
        raise Refusal("a decide request needs at least one question")
    for q in request.questions:
        if not q.id.strip():
            raise Refusal("a decide request has a question with an empty id")
        if not text_of(q.instructions).strip():
            raise Refusal(f"question '{q.id}' has empty instructions")
        if q.type in ("choice", "score"):
            noun = "options" if q.type == "choice" else "levels"
            if len(q.criteria) < 2:
                raise Refusal(f"{q.type} question '{q.id}' needs at least two {noun}")
            if len(q.criteria) > MAX_OPTIONS:
                raise Refusal(
                    f"{q.type} question '{q.id}' has {len(q.criteria)} {noun}; Ster labels at most "
                    f"{MAX_OPTIONS}"
                )
        if q.type == "choice":
            empty = next((n for n in q.names() if not n.strip()), None)
            if empty is not None:
                raise Refusal(
                    f"choice question '{q.id}' has an option with an empty name {json.dumps(empty)}"
                )
        if q.type == "score":
            level = next((i for i, d in enumerate(q.criteria) if not text_of(d).strip()), None)
            if level is not None:
                raise Refusal(f"score question '{q.id}' has an empty description at level {level}")

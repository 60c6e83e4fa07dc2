"""Labelled decisions for `ster calibrate`: decide requests, each with the right answer to every
question, checked whole before any weight is read.

A file is JSON Lines (one item per non-blank line) or, when it starts with `[`, one JSON array
of items. An item is a decide request (request.parse_request reads it, with decide's refusals)
plus `labels`, mapping every question id to its right answer: a choice's option name, a score's
level index, a noul's true or false. Each labelled question is one decision. A key repeated in
one JSON object (two options of one name, which JSON would silently collapse) is refused, as are
two score levels of the same text: the model could not tell them apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ster_dist.decide.request import Question, Request, parse_request, text_of
from ster_dist.errors import Refusal
from ster_dist.inputs import read_text

MIN_DECISIONS = 8  # fewer and the fit and its metrics say little


@dataclass(frozen=True)
class Labelled:
    request: Request
    # per question, in the request's (id) order: the right option's canonical index
    labels: tuple[int, ...]
    where: str


class _Repeated(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _Repeated(key)
        seen[key] = value
    return seen


def _parse(text: str, where: str):
    try:
        return json.loads(text, object_pairs_hook=_no_repeats)
    except _Repeated as repeated:
        raise Refusal(
            f"{where} repeats the key {json.dumps(repeated.key)} in one object (a duplicate option or "
            "question); keep one"
        ) from None
    except json.JSONDecodeError as exc:
        raise Refusal(f"{where} is not JSON: {exc.msg} at column {exc.colno}") from None


def _label_index(question: Question, label, where: str) -> int:
    qid = question.id
    if question.type == "choice":
        names = question.names()
        if not isinstance(label, str) or label not in names:
            raise Refusal(
                f"{where}: label {json.dumps(label)} of question '{qid}' is not among its options "
                f"({', '.join(names)}); label it with one of them"
            )
        return names.index(label)
    if question.type == "score":
        levels = len(question.criteria)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < levels:
            raise Refusal(
                f"{where}: label {json.dumps(label)} of score question '{qid}' is not among its levels; "
                f"label it with a level index from 0 to {levels - 1}"
            )
        return label
    if not isinstance(label, bool):
        raise Refusal(
            f"{where}: label {json.dumps(label)} of noul question '{qid}' is not among its options; "
            "label it true or false"
        )
    return 0 if label else 1  # options are yes, then no


def parse_item(data, where: str) -> Labelled:
    if not isinstance(data, dict):
        raise Refusal(
            f"{where} is not a decide request with labels: write "
            '{"state": ..., "questions": {...}, "labels": {"question id": answer}}'
        )
    body = {k: v for k, v in data.items() if k != "labels"}
    request = parse_request(body, where)
    labels = data.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise Refusal(
            f'{where} has no labels: add "labels" mapping each question id to its right answer'
        )
    asked = {q.id for q in request.questions}
    stray = sorted(set(labels) - asked)
    if stray:
        raise Refusal(
            f"{where}: labels name question '{stray[0]}', which it does not ask; label only its questions"
        )
    indexes = []
    for question in request.questions:
        if question.id not in labels:
            raise Refusal(
                f"{where}: question '{question.id}' has no label; add its right answer to \"labels\""
            )
        if question.type == "score":
            texts = [text_of(level).strip() for level in question.criteria]
            twice = next((t for i, t in enumerate(texts) if t in texts[:i]), None)
            if twice is not None:
                raise Refusal(
                    f"{where}: score question '{question.id}' lists the level {json.dumps(twice)} twice; "
                    "keep one"
                )
        indexes.append(_label_index(question, labels[question.id], where))
    return Labelled(request, tuple(indexes), where)


def load_labelled(path: str, field: str) -> list[Labelled]:
    """Every item of `path` (named as `field` in refusals), checked; an empty file is refused."""
    text = read_text(path, field)
    if not text.strip():
        raise Refusal(f"{field} {path} is empty: write one decide request with its labels per line")
    if text.lstrip().startswith("["):
        items = _parse(text, f"{field} {path}")
        return [parse_item(item, f"{field} {path} item {i}") for i, item in enumerate(items, 1)]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            where = f"{field} {path} line {number}"
            out.append(parse_item(_parse(line, where), where))
    return out


def decisions_in(items: list[Labelled]) -> int:
    return sum(len(item.labels) for item in items)


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def split(
    items: list[Labelled], control: list[Labelled] | None, every: int, path: str, control_label: str
) -> tuple[list[Labelled], list[Labelled], str]:
    """(fit items, control items, where the control came from): the control file's items when there
    is one, else every `every`-th item held out of `items`; each side refused when too small."""
    if control is not None:
        fit, held, source = items, control, "the control file"
        if decisions_in(fit) < MIN_DECISIONS:
            raise Refusal(
                f"{path} has {decisions_in(fit)} labelled decisions; calibration fits on at least "
                f"{MIN_DECISIONS}: label more"
            )
        return fit, held, source
    fit = [item for i, item in enumerate(items, 1) if i % every]
    held = [item for i, item in enumerate(items, 1) if not i % every]
    source = f"every {ordinal(every)} item"
    if decisions_in(fit) < MIN_DECISIONS:
        raise Refusal(
            f"{path} has {decisions_in(items)} labelled decisions, {decisions_in(fit)} once every {ordinal(every)} "
            f"item is held out as the control; calibration fits on at least {MIN_DECISIONS}: label more, "
            f"or give the control as {control_label}"
        )
    if not held:
        raise Refusal(
            f"{path} has {len(items)} items, so holding out every {ordinal(every)} leaves no control: add items, "
            f"lower the hold-out, or give the control as {control_label}"
        )
    return fit, held, source

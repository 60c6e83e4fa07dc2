"""One input row of `ster batch` as a generate request: its prompt (`prompt` text, or chat
`messages`), the per-row sampling fields `ster generate` takes, and the key a rerun knows it by.

A row's fields are validated as a queued generate job's are (a sampling row states its seed), and
a bad row is refused naming its key and the field. The key is the row's `id` when it has one,
else a digest of its content: a rerun into the same output skips rows whose key is written.
"""

from __future__ import annotations

import hashlib
import json

from ster_dist.errors import Refusal

# the fields of `ster generate` a row may carry (every other column is passed through untouched)
ROW_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
ANSWER_COLUMNS = ("answer", "prompt_tokens", "completion_tokens", "finish_reason", "row_key")


def plain(value):
    """A column value as plain Python (numpy scalars and arrays, as Ray Data hands them,
    included)."""
    if hasattr(value, "tolist"):
        return plain(value.tolist())
    if isinstance(value, float) and value != value:  # pandas' NaN: a column this row does not have
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _canonical(value):
    value = plain(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def row_key(row: dict) -> str:
    """The row's `id` (as text), else a digest of its content (keys sorted)."""
    if row.get("id") is not None:
        return str(row["id"])
    # canonical: absent columns and nulls alike, 13.0 as 13 (a pandas batch and an Arrow row differ
    # so)
    text = json.dumps(
        {
            k: _canonical(v)
            for k, v in row.items()
            if k not in ANSWER_COLUMNS and _canonical(v) is not None
        },
        sort_keys=True,
        default=str,
    )
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


INTEGER_FIELDS = ("max_new_tokens", "top_k", "seed")


def _integral(name: str, value):
    """An integer field that a column with gaps made a float (pandas: 13 -> 13.0) is its integer
    again."""
    return (
        int(value)
        if name in INTEGER_FIELDS and isinstance(value, float) and value.is_integer()
        else value
    )


def row_request(row: dict, model: str, defaults: dict):
    """(the row's GenerateRequest, its messages or None), or a Refusal naming the row."""
    from ster_dist.schema import GenerateRequest

    where = f"row {row_key(row)!r}"
    prompt, messages = row.get("prompt"), row.get("messages")
    if (prompt is None) == (messages is None):
        raise Refusal(
            f"{where}: give a 'prompt' (text) or 'messages' (a chat), not "
            f"{'both' if prompt is not None else 'neither'}"
        )
    if messages is not None and (
        not isinstance(messages, list)
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
        or not messages
    ):
        raise Refusal(f'{where}: \'messages\' must be a list of {{"role": ..., "content": "..."}}')
    fields = {**defaults, **{k: _integral(k, row[k]) for k in ROW_FIELDS if row.get(k) is not None}}
    try:
        request = GenerateRequest.parse(
            {"model": model, "prompt": prompt if prompt is not None else "-", **fields},
            queued=True,
            check_model=False,
        )
    except Refusal as refusal:
        raise Refusal(f"{where}: {refusal}") from None
    return request, messages

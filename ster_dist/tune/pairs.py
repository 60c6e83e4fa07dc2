"""Preference pairs as token ids: a prompt, the completion preferred and the one rejected.

The pairs file is JSONL, one {"prompt": "...", "chosen": "...", "rejected": "...", "system": "..."}
(system optional) per line. Both completions are encoded as `tune sft` encodes a completion
(tune/data.py): the prompt exactly as `ster generate` encodes it, then the completion's plain tokens
and the end-of-sequence token generation stops at. Unlike sft, nothing is cut at --max-sequence: a
cut could remove the very tokens the two completions differ in, so a pair past it is refused, as is
one whose completions are the same. Every refusal names the line and comes before a weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ster_dist.errors import Refusal
from ster_dist.tokenizer import Tokenizer
from ster_dist.tune.data import Example, jsonl_objects, stop_token

FIELDS = ("prompt", "chosen", "rejected")
SHAPE = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example

    @property
    def completion_tokens(self) -> int:
        return self.chosen.completion_tokens + self.rejected.completion_tokens


def read_pairs(path: str) -> list[dict]:
    """The pairs of the JSONL file `path`, each refused by its line number when it cannot teach a
    preference."""
    rows = []
    for number, row, where in jsonl_objects(path, "--pairs", SHAPE):
        for key in FIELDS:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise Refusal(
                    f"{where} has no {key} text; give every pair a prompt, a chosen and a rejected "
                    "completion"
                )
        if row["chosen"] == row["rejected"]:
            raise Refusal(
                f"{where}: chosen and rejected are the same text, which teaches no preference; "
                "fix or drop the pair"
            )
        if row.get("system") is not None and not isinstance(row["system"], str):
            raise Refusal(f"{where}: system must be text")
        rows.append({**row, "line": number})
    if not rows:
        raise Refusal(f"--pairs {path} holds no pairs; write one {SHAPE} object per line")
    return rows


def encode_pairs(
    tokenizer: Tokenizer,
    rows: list[dict],
    chat_template: str,
    system: str | None,
    eos: tuple[int, ...],
    max_sequence: int,
) -> list[Pair]:
    stop = stop_token(tokenizer, eos)
    out = []
    for row in rows:
        prompt = tokenizer.prompt_ids(row["prompt"], row.get("system", system), chat_template)
        sides = []
        for key in ("chosen", "rejected"):
            ids = prompt + tokenizer.encode(row[key], add_special_tokens=False) + [stop]
            if len(ids) > max_sequence:
                raise Refusal(
                    f"pair on line {row['line']} is {len(ids)} tokens with its {key} completion, past "
                    f"--max-sequence {max_sequence}; raise --max-sequence or shorten the pair (a "
                    "preference pair is never cut)"
                )
            sides.append(Example(tuple(ids), len(prompt)))
        if sides[0].ids == sides[1].ids:
            raise Refusal(
                f"pair on line {row['line']}: chosen and rejected encode to the same tokens, which "
                "teaches no preference; fix or drop the pair"
            )
        out.append(Pair(*sides))
    return out


def collate_whole(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, valid), right-padded, every token of each sequence an input (a reward head reads the
    last)."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        valid[row, : len(e.ids)] = True
    return ids, valid

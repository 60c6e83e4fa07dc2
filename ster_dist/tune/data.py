"""Training and evaluation examples as token ids, and the seeded order they are stepped through.

An example is a prompt and the completion the model should answer it with (and optionally its own
system message). The prompt is encoded exactly as `ster generate` encodes it (Tokenizer.prompt_ids:
a user turn through the chat template awaiting the answer, or plain text with the tokenizer's
special tokens), so what the model learns to continue is what generation will hand it. The
completion follows as its plain tokens and one end-of-sequence token, the token generation stops at:
a trained adapter answers, then stops. Only completion tokens carry loss.

The examples file is JSON: {"examples": [{"prompt": "...", "completion": "...", "system": "..."}]}
(or the bare list).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ster_dist.errors import Refusal
from ster_dist.inputs import read_json, read_text
from ster_dist.tokenizer import Tokenizer

IGNORE = -100  # a target position without loss (Transformers' ignore_index)


@dataclass(frozen=True)
class Example:
    # prompt then completion (with its end-of-sequence token), cut to --max-sequence
    ids: tuple[int, ...]
    prompt_tokens: int  # the first completion token is ids[prompt_tokens]

    @property
    def completion_tokens(self) -> int:
        return len(self.ids) - self.prompt_tokens


def read_examples(path: str) -> list[dict]:
    """The examples of `path`, each with a non-empty prompt and completion (refused by index
    otherwise)."""
    data = read_json(path, "--examples")
    rows = data.get("examples") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not rows:
        raise Refusal(
            f'--examples {path} must be {{"examples": [{{"prompt": "...", "completion": "..."}}, ...]}} '
            "with at least one example"
        )
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise Refusal(
                f"--examples {path}: example {index} is not an object with prompt and completion"
            )
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise Refusal(
                    f"--examples {path}: example {index} has no {key} text; give every example a "
                    "prompt and a completion"
                )
        if row.get("system") is not None and not isinstance(row["system"], str):
            raise Refusal(f"--examples {path}: example {index}'s system must be text")
    return rows


def jsonl_objects(path: str, flag: str, shape: str) -> Iterator[tuple[int, dict, str]]:
    """(line number, object, where) for every non-blank line of the JSONL file `path` given as
    `flag`; a line
    that is not a JSON object is refused by its number, naming the `shape` each line should have."""
    for number, line in enumerate(read_text(path, flag).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{flag} {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise Refusal(
                f"{where} is not JSON ({exc.msg}); write one {shape} object per line"
            ) from None
        if not isinstance(row, dict):
            raise Refusal(f"{where} is not an object; write one {shape} object per line")
        yield number, row, where


def stop_token(tokenizer: Tokenizer, eos: tuple[int, ...]) -> int:
    """The end-of-sequence token a completion ends with: the tokenizer's own when generation stops
    at it."""
    own = tokenizer.eos_token_id
    if own is not None and (not eos or own in eos):
        return own
    if eos:
        return eos[0]
    raise Refusal(
        f"{tokenizer.directory} names no end-of-sequence token (tokenizer or generation config), so a "
        "completion cannot be taught to stop; add eos_token to tokenizer_config.json"
    )


def encode_examples(
    tokenizer: Tokenizer,
    rows: list[dict],
    chat_template: str,
    system: str | None,
    eos: tuple[int, ...],
    max_sequence: int,
) -> tuple[list[Example], int]:
    """(examples, how many had their completion cut at --max-sequence)."""
    stop = stop_token(tokenizer, eos)
    out, truncated = [], 0
    for index, row in enumerate(rows):
        prompt = tokenizer.prompt_ids(row["prompt"], row.get("system", system), chat_template)
        completion = tokenizer.encode(row["completion"], add_special_tokens=False) + [stop]
        if len(prompt) + 1 > max_sequence:
            raise Refusal(
                f"example {index}'s prompt is {len(prompt)} tokens, leaving no completion token within "
                f"--max-sequence {max_sequence}; raise --max-sequence or shorten the prompt"
            )
        ids = (prompt + completion)[:max_sequence]
        truncated += len(prompt) + len(completion) > max_sequence
        out.append(Example(tuple(ids), len(prompt)))
    return out, truncated


def schedule(count: int, epochs: int, step_examples: int, seed: int) -> list[list[int]]:
    """Example indices of every optimizer step: each epoch a seeded permutation cut into steps of
    `step_examples` (the last step of an epoch may be short)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator).tolist()
        steps += [order[i : i + step_examples] for i in range(0, count, step_examples)]
    return steps


def micro_batches(
    step: list[int], batch_size: int, accumulation: int, dp: int, dp_rank: int
) -> list[list[int]]:
    """This data-parallel rank's `accumulation` micro-batches of one step (some empty when the step
    is short).

    The step's examples are laid out in dp x accumulation slots of batch_size, rank-major, so the
    same step is the same set of examples whatever dp and accumulation split it."""
    slots = [step[i * batch_size : (i + 1) * batch_size] for i in range(dp * accumulation)]
    return slots[dp_rank * accumulation : (dp_rank + 1) * accumulation]


def collate(
    examples: list[Example], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, valid, targets), right-padded: position t predicts targets[t], IGNORE outside the
    completion."""
    width = max(len(e.ids) for e in examples) - 1
    inputs = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    valid = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        ids = torch.tensor(e.ids, dtype=torch.long)
        n = len(e.ids) - 1
        inputs[row, :n] = ids[:-1]
        valid[row, :n] = True
        targets[row, e.prompt_tokens - 1 : n] = ids[e.prompt_tokens :]
    return inputs, valid, targets

"""batch: a dataset of prompts answered by N replicas of a model over Ray Data (ster_dist/batch)."""

from __future__ import annotations

from typing import Literal

from ster_dist.schema.base import field
from ster_dist.schema.common import ChatTemplate, Runtime, chat_template_field
from ster_dist.schema.engine_fields import EngineFields


class BatchRequest(Runtime, EngineFields):
    command = ("batch",)
    summary = "answer a dataset of prompts (JSONL or Parquet) with N replicas over Ray Data"

    input: str = field(
        help="a JSONL or Parquet file, or a directory of them; each row a 'prompt' or 'messages', "
        "with optional sampling fields as `ster generate` takes them"
    )
    output: str = field(
        help="the directory the answered rows are written to (a rerun skips rows already there)"
    )
    format: Literal["parquet", "jsonl"] | None = field(
        None, help="the output's format (default: the input's)"
    )
    replicas: int = field(1, ge=1, help="replicas of the model, each in a Ray actor of its own")
    batch_size: int = field(
        64, ge=1, help="rows handed to a replica at once (all in its engine together)"
    )
    max_new_tokens: int = field(
        64, ge=0, help="the most tokens generated per row (a row's own field wins)"
    )
    chat_template: ChatTemplate = chat_template_field()

"""merge: fold a LoRA adapter into a base checkpoint; a batch of merges fanned out over a
cluster."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import Request, field, label_in
from ster_dist.schema.common import ModelRef


class MergeRequest(ModelRef):
    kind = "merge"
    command = ("merge",)
    ster_command = ("tune", "merge")
    summary = "merge a LoRA adapter (PEFT or Ster format) into a base checkpoint"

    adapter: str = field(help="a PEFT adapter directory or a Ster adapter .safetensors")
    output: str = field(help="the merged checkpoint directory (must not exist)")
    max_shard_size: str = field("5GB", help="largest output shard, like 5GB or 500MB")


class MergeItem(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    adapter: str
    output: str
    revision: str | None = None

    @field_validator("model", "adapter", "output")
    @classmethod
    def _named(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise ValueError(f"field {info.field_name!r} must be a non-empty string")
        return value


class BatchMergeRequest(Request):
    """{"kind": "merge", "merges": [...]}: every shard of every merge one Ray task
    (jobs/merge.py)."""

    kind = "merge"
    command = ()  # a job spec only

    merges: list[MergeItem] = field(help="the merges: {model, adapter, output, revision?} each")
    max_shard_size: str | None = field(None, help="largest output shard, like 5GB or 500MB")

    @field_validator("merges")
    @classmethod
    def _distinct(cls, merges: list[MergeItem], info: ValidationInfo) -> list[MergeItem]:
        where = label_in(info, "merges")
        if not merges:
            raise Refusal(f"{where} must list at least one {{model, adapter, output}} mapping")
        outputs = set()
        for index, item in enumerate(merges):
            output = str(Path(item.output).resolve())
            if output in outputs:
                raise Refusal(
                    f"{where} item {index} writes {item.output} again; give each merge its own output"
                )
            outputs.add(output)
        return merges

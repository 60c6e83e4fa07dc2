"""extract: residual-stream hidden states at named layers."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import field, label_in
from ster_dist.schema.common import (
    ChatTemplate,
    LayersMixin,
    Runtime,
    adapter_field,
    chat_template_field,
    no_stdin,
)


class ExtractRequest(LayersMixin, Runtime):
    kind = "extract"
    command = ("extract",)
    summary = (
        "hidden states at named layers, written as safetensors or as Ster's activation artifact"
    )

    input: str = field(help='a {"prompts": [...]} JSON file')
    output: str = field(help="the .safetensors file to write")
    layers: str = field("all", help="all, a comma list, or a half-open range such as 8..16")
    positions: Literal["last", "all"] = field(
        "last", help="one row per prompt (its last token), or every token"
    )
    chat_template: ChatTemplate = chat_template_field()
    batch_size: int = field(8, ge=1, help="prompts per forward pass")
    adapter: str | None = adapter_field("a LoRA adapter applied unmerged while reading")
    format: Literal["safetensors", "ster-json"] = field(
        "safetensors",
        help="safetensors (streamed, any size), or ster-json: Ster's activation artifact "
        "(records of prompt and layers, last positions only)",
    )

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo):
        no_stdin(self, ("input",), info)
        if self.format == "ster-json" and self.positions != "last":
            raise Refusal(
                f"{label_in(info, 'format')} ster-json holds the final token of each prompt only; "
                f"drop {label_in(info, 'positions')} all or write safetensors"
            )
        return self

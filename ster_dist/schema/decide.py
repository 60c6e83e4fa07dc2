"""decide: typed questions answered from option-letter probabilities (Ster's decisions page)."""

from __future__ import annotations

from pydantic import ValidationInfo, model_validator

from ster_dist.schema.base import field
from ster_dist.schema.common import (
    ChatTemplate,
    Runtime,
    adapter_field,
    chat_template_field,
    no_stdin,
)


class DecideRequest(Runtime):
    kind = "decide"
    command = ("decide",)
    summary = "answer typed questions about a state from option-letter probabilities"

    request: str = field(help="the request JSON file, or - for standard input")
    chat_template: ChatTemplate = chat_template_field()
    permutations: int = field(
        0,
        ge=0,
        help="option orders per question: 0 shows every option under every letter; 1 is one pass",
    )
    explain: bool = field(False, help="add each order's letters and probabilities")
    output: str | None = field(None, help="also write the response to this file")
    adapter: str | None = adapter_field()
    calibration: str | None = field(
        None, help="a ster-calibration/1 file (ster calibrate): probabilities at its temperature"
    )

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo):
        no_stdin(self, ("request",), info)
        return self

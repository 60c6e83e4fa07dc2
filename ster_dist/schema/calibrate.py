"""calibrate: a decision temperature fitted on labelled decide requests (temperature scaling)."""

from __future__ import annotations

from pydantic import ValidationInfo, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import field, label_in
from ster_dist.schema.common import ChatTemplate, Runtime, chat_template_field


class CalibrateRequest(Runtime):
    kind = "calibrate"
    command = ("calibrate",)
    summary = (
        "fit a decision temperature on labelled decide requests and write a ster-calibration/1 file"
    )

    decisions: str = field(
        help="labelled decisions: JSON Lines (or a JSON array) of decide requests, each with "
        '"labels" mapping its question ids to the right answers'
    )
    output: str = field(help="the ster-calibration/1 artifact (JSON) to write")
    control: str | None = field(
        None,
        help="labelled decisions held out to check the fit on (default: every "
        "--control-every-th item of --decisions)",
    )
    control_every: int = field(
        5, ge=2, help="without --control, hold out every n-th item of --decisions as the control"
    )
    chat_template: ChatTemplate = chat_template_field()
    permutations: int = field(
        0,
        ge=0,
        help="option orders per question, as decide reads them (fit with the value "
        "decide will run with)",
    )

    @model_validator(mode="after")
    def _one_control(self, info: ValidationInfo):
        if self.control is not None and "control_every" in self.model_fields_set:
            raise Refusal(
                f"{label_in(info, 'control_every')} holds items of {label_in(info, 'decisions')} out, and "
                f"{label_in(info, 'control')} gives the control instead: give one of them"
            )
        for name in ("decisions", "control"):
            if getattr(self, name) == "-":
                raise Refusal(
                    f"{label_in(info, name)} is '-', but labelled decisions are read from a file: name one"
                )
        return self

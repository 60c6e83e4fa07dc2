"""Field groups many operations share: the model reference, the runtime (precision, device, ranks),
the chat template switch, adapters, and the --layers grammar checked against a local config."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ValidationInfo, field_validator, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import Request, context_of, field, label_in

# the layer count assumed when only the grammar of a layer list is checked (a Hub model's config is
# not read on arrival): above any real model, small enough that `all` can be listed
SYNTAX_ONLY = 1 << 16

ChatTemplate = Literal["auto", "on", "off"]
Precision = Literal["f32", "bf16", "f16"]
Device = Literal["cpu", "cuda"]
Weights = Literal["dequantize", "fp8", "blocks"]


class ModelRef(Request):
    model: str = field(help="a local model directory or a Hugging Face Hub id")
    revision: str | None = field(
        None, help="Hub revision (default main); metadata only for a directory"
    )

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():
            raise Refusal(f"{label_in(info, 'model')} is empty; give a model directory or a Hub id")
        return value


class Runtime(ModelRef):
    """Where and how the model runs: the worker group a request needs (the job queue's pool key)."""

    submitter_fields = {
        "address": "give the cluster to `ster submit --address` or Engine(address=...), "
        "not to a job"
    }

    precision: Precision = field("f32", help="the dtype weights are held and multiplied in")
    device: Device = field("cpu", help="cpu or cuda")
    weights: Weights = field(
        "dequantize",
        help="an FP8 checkpoint's weights: dequantize (to --precision, while "
        "loading) or fp8 (kept as stored, with their block scales, and multiplied through them); "
        "blocks: a .gguf's Q8_0/Q4_0/Q4_1 weights kept in their blocks on the CPU",
    )
    tp: int = field(1, ge=1, help="tensor-parallel ranks (Ray actors when above 1)")
    ep: int = field(
        1, ge=1, help="expert-parallel ranks for mixture-of-experts models (tp x ep ranks in all)"
    )
    pp: int = field(
        1,
        ge=1,
        help="pipeline-parallel stages, each holding a contiguous share of the layers "
        "balanced by parameter bytes (tp x ep x pp ranks in all)",
    )
    address: str | None = field(
        None, help="an existing Ray cluster (else RAY_ADDRESS, else a local one)"
    )

    def group_key(self) -> tuple:
        return (
            self.model,
            self.revision,
            self.precision,
            self.device,
            self.tp,
            self.ep,
            self.weights,
            self.pp,
        )


def layers_text(value) -> str:
    """A --layers value as its text: a spec may give a list of indexes or one index."""
    if (
        isinstance(value, list)
        and value
        and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value)
    ):
        return ",".join(map(str, value))
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def check_layer_text(request: Request, name: str, info: ValidationInfo | None) -> None:
    """Layers written wrongly, always; a layer the model does not have when the model is a local
    directory (its config only: no weight is read)."""
    from ster_dist.steer.layers import parse_layers

    text = getattr(request, name)
    if text is None:
        return
    where = label_in(info, name)
    try:
        parse_layers(text, SYNTAX_ONLY)
    except Refusal as refusal:
        raise Refusal(f"{where}: {refusal}") from None
    model = getattr(request, "model", None)
    if (
        not context_of(info, "check_model", True)
        or not isinstance(model, str)
        or not Path(model).is_dir()
    ):
        return
    try:
        count = local_layer_count(model, getattr(request, "revision", None))
    except Refusal:
        return  # the model itself is refused when the job runs, with its own words
    try:
        parse_layers(text, count)
    except Refusal as refusal:
        raise Refusal(f"{where}: {refusal}") from None


def local_layer_count(model: str, revision: str | None) -> int:
    from ster_dist.config.load import model_config
    from ster_dist.resolve import resolve

    return model_config(resolve(model, revision)).num_layers


def no_stdin(request: Request, names: tuple[str, ...], info: ValidationInfo | None) -> None:
    if not context_of(info, "queued"):
        return
    for name in names:
        if getattr(request, name, None) == "-":
            raise Refusal(
                f"{label_in(info, name)} is '-' (standard input), which a queued job does not have; "
                "give a file"
            )


class LayersMixin(Request):
    """--layers: all, a comma list, or a half-open range such as 8..16."""

    @field_validator("layers", mode="before", check_fields=False)
    @classmethod
    def _layers_text(cls, value):
        return layers_text(value)

    @model_validator(mode="after")
    def _layers_exist(self, info: ValidationInfo):
        check_layer_text(self, "layers", info)
        return self


def chat_template_field():
    return field(
        "auto",
        help="render prompts through the model's chat template: auto (when it has one), on, off",
    )


def adapter_field(
    help_text: str = "a LoRA adapter (PEFT directory or Ster .safetensors) applied unmerged",
):
    return field(None, help=help_text)

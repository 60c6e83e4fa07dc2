"""Commands that run no job: the family table, a model's description, a tiny checkpoint, a GGUF
import."""

from __future__ import annotations

from typing import Literal

from ster_dist.schema.base import Request, field
from ster_dist.schema.common import ModelRef


class FamiliesRequest(Request):
    command = ("families",)
    summary = "every family of the architecture gate with its status"


class InspectModelRequest(ModelRef):
    command = ("inspect-model",)
    summary = "resolve a model and describe it, reading no weights"


class ToyModelRequest(Request):
    command = ("toy-model",)
    summary = "write a tiny random checkpoint (Llama or DeepSeek-V3) with a tokenizer"

    directory: str = field(help="the model directory to write", cli={"positional": True})
    family: Literal["llama", "deepseek_v3"] = field(
        "llama", help="the layout: Llama, or DeepSeek-V3's MoE and MLA"
    )
    experts: int = field(8, ge=1, help="routed experts (deepseek_v3)")
    layers: int = field(2, ge=1, help="decoder layers")
    hidden: int = field(64, ge=8, help="hidden size")
    seed: int = field(0, ge=0, help="the weights' random seed")
    force: bool = field(False, help="replace a directory that holds another model")


class GgufImportRequest(Request):
    command = ("gguf-import",)
    summary = "turn a .gguf file into a model directory"

    file: str = field(help="the .gguf file", cli={"positional": True})
    directory: str = field(help="the model directory to write", cli={"positional": True})
    safetensors: bool = field(
        False, help="write dequantized safetensors instead of linking the .gguf"
    )
    force: bool = field(False, help="replace a directory that holds another import")

"""Reading config.json (or Mistral's params.json) bytes, and the architecture gate.

These run on the config alone, before any weight is mapped or downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from ster_dist.config_quant import quantization
from ster_dist.errors import Refusal
from ster_dist.families.names import FAMILY_NAMES

# Image-text wrappers whose language model is one of the families (seeds/000):
# the text_config is read, its weights below language_model.
TEXT_WRAPPERS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "gemma4_unified": "gemma4_unified_text",
                 "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def load_raw_config(path: Path) -> dict:
    """Parse config JSON; Python's Infinity / -Infinity / NaN are read as unstated (None)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"failed to read {path}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text, parse_constant=lambda _: None)
    except json.JSONDecodeError as exc:
        raise Refusal(f"invalid model config {path}: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(raw, dict):
        raise Refusal(f"invalid model config {path}: the top level is not a JSON object")
    return raw


def architecture_message(model_type: object) -> str:
    shown = "null" if model_type is None else str(model_type)
    return (f'model architecture "{shown}" is unsupported by this ster_dist build; use a Hugging Face '
            f"checkpoint whose model_type is one of {', '.join(FAMILY_NAMES)}")


def family_of(raw: dict) -> str:
    """The family a config belongs to, after unwrapping image-text wrappers; refuses the rest."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):  # a list or object is no family name (and is unhashable)
        raise Refusal(architecture_message(model_type))
    if model_type in TEXT_WRAPPERS:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise Refusal(architecture_message(model_type))
        model_type = text.get("model_type") or TEXT_WRAPPERS[model_type]
    if not isinstance(model_type, str) or model_type not in FAMILY_NAMES:
        raise Refusal(architecture_message(model_type))
    return model_type


def gate(raw: dict, model: str) -> str:
    """The architecture gate and the quantized-checkpoint refusal (config_quant); returns the family name."""
    family = family_of(raw)
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].get("quantization_config")
    quantization(quant, model)  # refuses every quantization but FP8 with block scales
    return family

"""Reading config.json (or Mistral's params.json) bytes, the architecture gate, and text wrappers.

These run on the config alone, before any weight is mapped or downloaded.

A text wrapper is an image-text (or audio) checkpoint whose language model is one of the families
(seeds/000): its text_config is read as that family's config, and its weights are the text family's
names below the language model. Which names those are is one rule for every wrapper
(`text_weight_names`): Transformers' older saves put the text model's names below `language_model.`
(language_model.model.layers.0..., language_model.lm_head), Transformers 5 writes
model.language_model.* for the text model's `model.*` and keeps lm_head at the root, and HyperCLOVA
X SEED keeps the whole text model below model.language_model
(model.language_model.model.layers.0..., model.language_model.lm_head); Inkling keeps its text model
below model.llm, which its family's map names as it stands. Every other tensor of a wrapped
checkpoint belongs to a tower (vision, audio) or its projector and is never mapped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ster_dist.config.quant import quantization
from ster_dist.errors import Refusal
from ster_dist.families.names import FAMILY_NAMES
from ster_dist.families.registry import SPECS


@dataclass(frozen=True)
class TextWrapper:
    """A wrapper model_type: the family its text_config is when that states no model_type of its
    own."""

    text_family: str
    # the text weights lie at the root (model.*, lm_head.*) rather than below language_model
    # (Step3-VL)
    text_at_root: bool = False
    # the text weights are the names below this prefix, kept whole (Inkling's model.llm.); every
    # other is a tower's
    text_prefix: str | None = None


# Wrappers whose language model is one of the families (seeds/000). A wrapper loads whenever its
# text
# family runs; until then it is refused naming that family.
TEXT_WRAPPERS: dict[str, TextWrapper] = {
    "gemma3": TextWrapper("gemma3_text"),
    "gemma3n": TextWrapper("gemma3n_text"),
    "gemma4": TextWrapper("gemma4_text"),
    "gemma4_unified": TextWrapper("gemma4_unified_text"),
    # Mistral Small 3.1; Ministral 3 states ministral3
    "mistral3": TextWrapper("mistral"),
    "llama4": TextWrapper("llama4_text"),
    "qwen3_5": TextWrapper("qwen3_5_text"),
    "qwen3_5_moe": TextWrapper("qwen3_5_moe_text"),
    "kimi_k25": TextWrapper("kimi_k2"),  # Kimi-K2.5: a Kimi-K2 decoder
    "kimi_k3": TextWrapper("kimi_linear"),
    "hyperclovax_vision_v2": TextWrapper("hyperclovax"),
    "minimax_m3_vl": TextWrapper("minimax_m3_vl_text"),
    "glm5_next": TextWrapper("glm5_next_text"),
    "step3_vl": TextWrapper("step3_text", text_at_root=True),
    "muse_glimmer": TextWrapper("muse_glimmer_text"),
    "inkling_mm_model": TextWrapper("inkling_text", text_prefix="model.llm."),
}
# model_types that are another family's checkpoints under their own name: Kimi-K2 is DeepSeek-V3
# (Transformers' Kimi_K25Config reads a kimi_k2 text_config as deepseek_v3 too)
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}
# configs that may leave model_type out, read by the one class their architectures name (seeds/000)
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LongcatFlashNgramForCausalLM": "longcat_flash_ngram",
    "MiniMaxM3SparseForCausalLM": "minimax_m3_vl_text",
}
# keys a wrapper's text_config takes from the outer config when it leaves them out (seeds/000, Gemma
# 3)
_OUTER_KEYS = ("eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config")


# a config.json is kilobytes (a tokenizer_config.json naming 256k added tokens some tens of MiB);
# past this
# the file is not one, and reading it whole would cost memory in proportion to whatever it is
MAX_CONFIG_BYTES = 64 << 20


def load_raw_config(path: Path, what: str = "model config") -> dict:
    """Parse config JSON; Python's Infinity / -Infinity / NaN are read as unstated (None).
    `what` names the file in a refusal (model config, generation config, ...)."""
    try:
        size = Path(path).stat().st_size
        # checked before reading: never the whole of a file too large to be a config
        if size > MAX_CONFIG_BYTES:
            raise Refusal(
                f"invalid {what} {path}: it is {size} bytes, larger than the {MAX_CONFIG_BYTES >> 20} MiB "
                f"any {what} is; re-download it"
            )
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"failed to read {path}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text, parse_constant=lambda _: None)
    except json.JSONDecodeError as exc:
        raise Refusal(
            f"invalid {what} {path}: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (ValueError, RecursionError) as exc:
        # json.loads raises these past its own limits, on files no config writer produces
        raise Refusal(
            f"invalid {what} {path}: {json_limit(exc)}; correct it or re-download it"
        ) from None
    if not isinstance(raw, dict):
        raise Refusal(f"invalid {what} {path}: the top level is not a JSON object")
    return raw


def json_limit(exc: Exception) -> str:
    """What a JSON file broke, for json.loads' two errors past its limits: RecursionError (arrays or
    objects nested past Python's recursion limit) and ValueError (an integer of over 4300
    digits)."""
    if isinstance(exc, RecursionError):
        return "its arrays or objects nest too deeply to be read"
    return f"it holds a number too long to read ({' '.join(str(exc).split(';')[0].split())[:100]})"


def architecture_message(model_type: object) -> str:
    shown = "null" if model_type is None else str(model_type)
    return (
        f'model architecture "{shown}" is unsupported by this ster_dist build; use a Hugging Face '
        f"checkpoint whose model_type is one of {', '.join(FAMILY_NAMES)}"
    )


def family_of(raw: dict) -> str:
    """The family a config belongs to, after unwrapping text wrappers and aliases; refuses the
    rest."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures")
    if model_type is None and isinstance(architectures, list) and len(architectures) == 1:
        model_type = (
            ARCHITECTURE_FAMILIES.get(architectures[0])
            if isinstance(architectures[0], str)
            else None
        )
    if not isinstance(model_type, str):  # a list or object is no family name (and is unhashable)
        raise Refusal(architecture_message(model_type))
    wrapper = TEXT_WRAPPERS.get(model_type)
    if wrapper is not None:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise Refusal(architecture_message(model_type))
        model_type = text.get("model_type") or wrapper.text_family
    if isinstance(model_type, str):
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if not isinstance(model_type, str) or model_type not in FAMILY_NAMES:
        raise Refusal(architecture_message(model_type))
    return model_type


def wrapper_of(raw: dict) -> str | None:
    """The wrapper model_type of a wrapped config, None for a plain one."""
    model_type = raw.get("model_type")
    return model_type if isinstance(model_type, str) and model_type in TEXT_WRAPPERS else None


def text_config(raw: dict) -> dict:
    """The config the family reads: a wrapper's text_config, with a few keys from the outer
    config."""
    if wrapper_of(raw) is None:
        return raw
    text = dict(raw["text_config"])
    for key in _OUTER_KEYS:
        if text.get(key) is None and raw.get(key) is not None:
            text[key] = raw[key]
    # the wrapper's own class ties (or unties) its head by the outer config's key, whatever the text
    # config says
    if isinstance(raw.get("tie_word_embeddings"), bool):
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def not_runnable(raw: dict, family: str) -> Refusal:
    """The refusal for a recognised family without a spec, naming the text family inside a
    wrapper."""
    wrapper = wrapper_of(raw)
    inside = f" (the text decoder inside {wrapper})" if wrapper else ""
    return Refusal(
        f'model architecture "{family}"{inside} is recognised but not yet runnable in this '
        "ster_dist build; `ster families` lists the runnable ones"
    )


def text_weight_names(wrapper: str, name: str) -> list[str]:
    """The names the text family's map may know a wrapped checkpoint's tensor by; [] for a tower's.

    One rule for every wrapper (the module docstring): below language_model, below
    model.language_model (as the text model's model.* or as the whole text model), or the root's
    lm_head; at the root for a wrapper whose text weights lie there."""
    if TEXT_WRAPPERS[wrapper].text_prefix:
        return [name] if name.startswith(TEXT_WRAPPERS[wrapper].text_prefix) else []
    if TEXT_WRAPPERS[wrapper].text_at_root:
        return [name] if name.startswith(("model.", "lm_head.")) else []
    if name.startswith("model.language_model."):
        rest = name[len("model.language_model.") :]
        return [f"model.{rest}", rest]
    if name.startswith("language_model."):
        return [name[len("language_model.") :]]
    if name.startswith("lm_head."):
        return [name]
    return []


def gate(raw: dict, model: str) -> str:
    """The architecture gate and the quantized-checkpoint refusal (config_quant); returns the family
    name."""
    family = family_of(raw)
    quant = raw.get("quantization_config")
    if quant is None and isinstance(raw.get("text_config"), dict):
        quant = raw["text_config"].get("quantization_config")
    quantization(quant, model)  # refuses every quantization but FP8 with block scales
    why = SPECS[family].refuse_keys.get("quantization_config") if family in SPECS else None
    if quant and why:  # a family whose quantized releases are not read (DeepSeek-V3.2, DeepSeek-V4)
        raise Refusal(f"invalid model config {model}: quantization_config is set; {why}")
    return family

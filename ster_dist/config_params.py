"""Mistral's own params.json put in the Transformers shape, as vLLM's adapter reads it
(vllm/transformers_utils/configs/mistral.py), then normalised by config.from_hf like any
config.json: config.py stays the one reader of Transformers' keys, this file of params.json's."""

from __future__ import annotations

from ster_dist.config import ModelConfig, from_hf
from ster_dist.config_ranges import LAYERS, check_int
from ster_dist.errors import Refusal

# params.json key -> the Transformers key it is read as (vLLM's adapter, transformers_utils/configs/mistral.py)
_PARAMS_RENAMED = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                   "n_kv_heads": "num_key_value_heads", "hidden_dim": "intermediate_size",
                   "norm_eps": "rms_norm_eps", "activation": "hidden_act", "tied_embeddings": "tie_word_embeddings"}
_PARAMS_KEPT = ("head_dim", "vocab_size", "rope_theta", "max_position_embeddings", "max_seq_len", "layer_types")
_USE_TRANSFORMERS = "use the repository's Transformers-format files (config.json with model-*.safetensors)"


def from_params(raw: dict, path: str = "params.json") -> ModelConfig:
    """Mistral's params.json put in the Transformers shape as vLLM reads it, then read by from_hf.

    A dense params.json is mistral with its tensors under Mistral's names (weight_format "mistral").
    Latent attention or experts are refused here, before any weight is read.
    """
    for key in ("moe", "multimodal", "yarn"):  # the blocks read below with .get
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise Refusal(f"invalid model config {path}: {key} is not a JSON object; correct it in params.json")
    stated = raw.get("model_type")
    if stated not in (None, "transformer", "mistral"):  # vLLM's default, for a params.json stating none
        raise Refusal(f"{path} states model_type {stated!r}; ster_dist reads Mistral's own format for dense "
                      f"transformers only; {_USE_TRANSFORMERS}")
    moe = raw.get("moe") or {}
    if moe and not (moe.get("num_shared_experts") or 0):
        raise Refusal(f"{path} describes experts without a shared one (Mixtral's layout) in Mistral's own format, "
                      f"which ster_dist refuses; {_USE_TRANSFORMERS}")
    if moe or raw.get("qk_nope_head_dim") or raw.get("kv_lora_rank"):
        raise Refusal(f"{path} describes latent attention and shared experts (Mistral Large 3, read as deepseek_v3) "
                      f"in Mistral's own format, which this ster_dist build does not load yet; {_USE_TRANSFORMERS}")
    if raw.get("vision_encoder") or (raw.get("multimodal") or {}).get("vision_encoder_args"):
        raise Refusal(f"{path} describes an image-text model (vision_encoder) in Mistral's own format, which this "
                      f"ster_dist build does not load; {_USE_TRANSFORMERS}")
    if raw.get("llama_4_scaling"):
        raise Refusal(f"{path} sets llama_4_scaling (Llama 4's query temperature), which ster_dist runs on no dense "
                      f"model; {_USE_TRANSFORMERS}")
    hf = {"model_type": "mistral"}
    for key, value in raw.items():
        if key in _PARAMS_RENAMED:
            hf[_PARAMS_RENAMED[key]] = value
        elif key in _PARAMS_KEPT:
            hf[key] = value
    if "max_position_embeddings" not in hf and "max_seq_len" not in hf:
        hf["max_position_embeddings"] = 128_000  # vLLM's default when params.json states neither
    hf.update(_params_window(raw, hf.get("num_hidden_layers"), path))
    if raw.get("yarn"):
        hf["rope_parameters"] = _params_yarn(raw["yarn"], path)
    return from_hf(hf, path, weight_format="mistral")


def _params_window(raw: dict, num_layers, path: str) -> dict:
    """sliding_window: one window for every layer, or a per-layer pattern (None: full attention) repeated."""
    window = raw.get("sliding_window")
    if not isinstance(window, list):
        return {"sliding_window": window} if window else {}
    if num_layers is not None:  # the pattern is repeated over the layers: a billion would build a billion
        check_int(path, "n_layers", num_layers, *LAYERS)
    if not all(w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window):
        raise Refusal(f"invalid model config {path}: sliding_window {str(window)[:80]} must list window sizes "
                      "(integers) or null per layer; correct it in params.json")
    sizes = {w for w in window if w is not None}
    if len(sizes) > 1 or not window or num_layers is None or num_layers % len(window):
        raise Refusal(f"invalid model config {path}: sliding_window {window} is not one window repeated over "
                      f"{num_layers} layers")
    pattern = window * (num_layers // len(window))
    return {"sliding_window": sizes.pop() if sizes else None,
            "layer_types": ["full_attention" if w is None else "sliding_attention" for w in pattern]}


def _params_yarn(yarn: dict, path: str) -> dict:
    """Mistral's yarn block as Transformers' rope_parameters (beta -> beta_fast, alpha -> beta_slow)."""
    params = {"rope_type": "yarn", "mscale_all_dim": 1}
    for key, name in (("factor", "factor"), ("original_max_position_embeddings", "original_max_position_embeddings"),
                      ("beta", "beta_fast"), ("alpha", "beta_slow")):
        if yarn.get(key) is not None:
            params[name] = yarn[key]
    if not yarn.get("apply_scale", True):
        params["attention_factor"] = 1.0  # no magnitude correction
    unread = set(yarn) - {"factor", "original_max_position_embeddings", "beta", "alpha", "apply_scale"}
    if unread:
        raise Refusal(f"invalid model config {path}: yarn sets {', '.join(sorted(unread))}, which ster_dist "
                      "does not read")
    return params

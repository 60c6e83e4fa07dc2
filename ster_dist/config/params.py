"""Mistral's own params.json put in the Transformers shape, as vLLM's adapter reads it
(vllm/transformers_utils/configs/mistral.py), then normalised by config.from_hf like any
config.json: config.py stays the one reader of Transformers' keys, this file of params.json's.
A dense params.json becomes mistral; Mistral Large 3's (latent attention, experts beside a shared
one) becomes deepseek_v3."""

from __future__ import annotations

from ster_dist.config.model import ModelConfig, from_hf
from ster_dist.config.ranges import LAYERS, check_int
from ster_dist.errors import Refusal

# params.json key -> the Transformers key it is read as (vLLM's adapter,
# transformers_utils/configs/mistral.py)
_PARAMS_RENAMED = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "activation": "hidden_act",
    "tied_embeddings": "tie_word_embeddings",
}
_PARAMS_KEPT = (
    "head_dim",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
    "max_seq_len",
    "layer_types",
)
# Mistral Large 3's latent attention sizes, kept as they are named
_LATENT_KEPT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# its moe block -> Transformers' DeepSeek keys (vLLM's _remap_moe_args)
_MOE_RENAMED = {
    "route_every_n": "moe_layer_freq",
    "first_k_dense_replace": "first_k_dense_replace",
    "num_experts_per_tok": "num_experts_per_tok",
    "num_experts": "n_routed_experts",
    "expert_hidden_dim": "moe_intermediate_size",
    "routed_scale": "routed_scaling_factor",
    "num_shared_experts": "n_shared_experts",
    "num_expert_groups": "n_group",
    "num_expert_groups_per_tok": "topk_group",
}
_USE_TRANSFORMERS = (
    "use the repository's Transformers-format files (config.json with model-*.safetensors)"
)


def from_params(raw: dict, path: str = "params.json") -> ModelConfig:
    """Mistral's params.json put in the Transformers shape as vLLM reads it, then read by from_hf.

    A dense params.json is mistral with its tensors under Mistral's names (weight_format "mistral");
    one with experts beside a shared one is Mistral Large 3, deepseek_v3 (`_large3`). Experts
    without a shared one, image-text models and Llama 4's temperature on a dense model are refused
    here, before any weight is read.
    """
    for key in ("moe", "multimodal", "yarn"):  # the blocks read below with .get
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise Refusal(
                f"invalid model config {path}: {key} is not a JSON object; correct it in params.json"
            )
    stated = raw.get("model_type")
    # vLLM's default, for a params.json stating none
    if stated not in (None, "transformer", "mistral"):
        raise Refusal(
            f"{path} states model_type {stated!r}; ster_dist reads Mistral's own format for dense "
            f"transformers only; {_USE_TRANSFORMERS}"
        )
    moe = raw.get("moe") or {}
    if moe and not (moe.get("num_shared_experts") or 0):
        raise Refusal(
            f"{path} describes experts without a shared one (Mixtral's layout) in Mistral's own format, "
            f"which ster_dist refuses; {_USE_TRANSFORMERS}"
        )
    if raw.get("vision_encoder") or (raw.get("multimodal") or {}).get("vision_encoder_args"):
        raise Refusal(
            f"{path} describes an image-text model (vision_encoder) in Mistral's own format, which this "
            f"ster_dist build does not load; {_USE_TRANSFORMERS}"
        )
    large3 = bool(moe)
    if not large3 and (raw.get("qk_nope_head_dim") or raw.get("kv_lora_rank")):
        raise Refusal(
            f"{path} describes latent attention without experts in Mistral's own format, which ster_dist "
            f"reads only as Mistral Large 3 (experts beside a shared one); {_USE_TRANSFORMERS}"
        )
    if raw.get("llama_4_scaling") and not large3:
        raise Refusal(
            f"{path} sets llama_4_scaling (Llama 4's query temperature), which ster_dist runs on no dense "
            f"model; {_USE_TRANSFORMERS}"
        )
    hf = {"model_type": "deepseek_v3" if large3 else "mistral"}
    for key, value in raw.items():
        if key in _PARAMS_RENAMED:
            hf[_PARAMS_RENAMED[key]] = value
        elif key in _PARAMS_KEPT or (large3 and key in _LATENT_KEPT):
            hf[key] = value
    if "max_position_embeddings" not in hf and "max_seq_len" not in hf:
        hf["max_position_embeddings"] = 128_000  # vLLM's default when params.json states neither
    hf.update(_params_window(raw, hf.get("num_hidden_layers"), path))
    if raw.get("yarn"):
        hf["rope_parameters"] = _params_yarn(raw["yarn"], path)
    if large3:
        hf.update(_large3(raw, hf.get("rope_parameters") or {}, path))
    return from_hf(hf, path, weight_format="mistral")


def _large3(raw: dict, rope: dict, path: str) -> dict:
    """Mistral Large 3's moe and llama_4_scaling blocks as DeepSeek-V3's keys (vLLM's adapter):
    softmax scores, the chosen weights renormalised, Llama 4's query temperature in the rotation's
    parameters."""
    moe = dict(raw["moe"])
    hf = {_MOE_RENAMED[key]: moe.pop(key) for key in list(moe) if key in _MOE_RENAMED}
    if moe:
        raise Refusal(
            f"invalid model config {path}: moe sets {', '.join(sorted(moe))}, which ster_dist does not read"
        )
    if (hf.get("n_group") or 1) != 1 or (hf.get("topk_group") or 1) != 1:
        raise Refusal(
            f"invalid model config {path}: moe routes within expert groups (num_expert_groups "
            f"{hf.get('n_group')}), which ster_dist does not read in Mistral's own format; "
            f"{_USE_TRANSFORMERS}"
        )
    hf.update(scoring_func="softmax", norm_topk_prob=True)
    # what vLLM reads where the moe block is silent (one expert group, no dense layers, no scaling),
    # stated
    # here so DeepSeek-V3's own normalisation (Transformers' defaults) does not fill them
    for key, value in (
        ("n_group", 1),
        ("topk_group", 1),
        ("first_k_dense_replace", 0),
        ("routed_scaling_factor", 1.0),
    ):
        if hf.get(key) is None:
            hf[key] = value
    # vLLM's deepseek_yarn: mscale one unless stated, so the tables keep
    if rope.get("rope_type") == "yarn":
        # their size and only the scores are sharpened (by mscale_all_dim)
        rope = {"mscale": 1, **rope}
        hf["rope_parameters"] = rope
    scaling = raw.get("llama_4_scaling")
    if scaling is None:
        return hf
    if (
        not isinstance(scaling, dict)
        or scaling.get("beta") is None
        or not scaling.get("original_max_position_embeddings")
    ):
        raise Refusal(
            f"invalid model config {path}: llama_4_scaling must state beta and "
            "original_max_position_embeddings"
        )
    length = scaling["original_max_position_embeddings"]
    if rope.get("original_max_position_embeddings", length) != length:
        raise Refusal(
            f"invalid model config {path}: llama_4_scaling counts positions in {length}, the yarn block "
            f"in {rope['original_max_position_embeddings']}; ster_dist reads one length for both"
        )
    hf["rope_parameters"] = {
        **rope,
        "llama_4_scaling_beta": scaling["beta"],
        "original_max_position_embeddings": length,
    }
    return hf


def _params_window(raw: dict, num_layers, path: str) -> dict:
    """sliding_window: one window for every layer, or a per-layer pattern (None: full attention)
    repeated."""
    window = raw.get("sliding_window")
    if not isinstance(window, list):
        return {"sliding_window": window} if window else {}
    # the pattern is repeated over the layers: a billion would build a billion
    if num_layers is not None:
        check_int(path, "n_layers", num_layers, *LAYERS)
    if not all(w is None or (isinstance(w, int) and not isinstance(w, bool)) for w in window):
        raise Refusal(
            f"invalid model config {path}: sliding_window {str(window)[:80]} must list window sizes "
            "(integers) or null per layer; correct it in params.json"
        )
    sizes = {w for w in window if w is not None}
    if len(sizes) > 1 or not window or num_layers is None or num_layers % len(window):
        raise Refusal(
            f"invalid model config {path}: sliding_window {window} is not one window repeated over "
            f"{num_layers} layers"
        )
    pattern = window * (num_layers // len(window))
    return {
        "sliding_window": sizes.pop() if sizes else None,
        "layer_types": ["full_attention" if w is None else "sliding_attention" for w in pattern],
    }


def _params_yarn(yarn: dict, path: str) -> dict:
    """Mistral's yarn block as Transformers' rope_parameters (beta -> beta_fast, alpha ->
    beta_slow)."""
    params = {"rope_type": "yarn", "mscale_all_dim": 1}
    for key, name in (
        ("factor", "factor"),
        ("original_max_position_embeddings", "original_max_position_embeddings"),
        ("beta", "beta_fast"),
        ("alpha", "beta_slow"),
    ):
        if yarn.get(key) is not None:
            params[name] = yarn[key]
    if not yarn.get("apply_scale", True):
        params["attention_factor"] = 1.0  # no magnitude correction
    unread = set(yarn) - {
        "factor",
        "original_max_position_embeddings",
        "beta",
        "alpha",
        "apply_scale",
    }
    if unread:
        raise Refusal(
            f"invalid model config {path}: yarn sets {', '.join(sorted(unread))}, which ster_dist "
            "does not read"
        )
    return params

"""The types and ranges of config.json values, checked in one place before config.py builds
anything.

config.py reads sizes with int() and float() and builds per-layer lists from them, so a value of the
wrong type was a traceback and an absurd one a hang (num_hidden_layers 1e9 grew a list for minutes)
or a ZeroDivisionError deep in the build. Here every key config.py reads is stated with its kind and
range; a stated value outside it is refused in one line naming the key, the value and the fix.
Unstated (missing or null) keys are not checked: the families' defaults fill them.
"""

from __future__ import annotations

import math

from ster_dist.errors import Refusal

FIX = "correct it in config.json (or re-download the checkpoint)"
LAYERS = (1, 10_000)
SIZE = (1, 1 << 20)  # widths and head counts
VOCAB = (1, 1 << 24)
POSITIONS = (1, 1 << 32)  # max_position and windows: a bound on tables built per position
COUNT = (0, 1 << 20)  # optional counts where 0 means none
EXPERTS = (1, 1 << 16)

# name -> (lo, hi): integers (not floats, not booleans) in [lo, hi]
INTS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("hidden_size", "n_embd", "n_embed", "d_model"), SIZE),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads"), SIZE),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv"), SIZE),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), LAYERS),
    **dict.fromkeys(("n_inner", "ffn_dim", "ffn_hidden_size"), SIZE),
    "laurel_rank": SIZE,  # Gemma 3n
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "seq_length",
            "max_seq_len",
            "original_max_position_embeddings",
        ),
        POSITIONS,
    ),
    "sliding_window": (0, POSITIONS[1]),  # 0: no window (Qwen2-MoE and others write it so)
    "head_dim": SIZE,
    "vocab_size": VOCAB,
    "rotary_dim": SIZE,
    # widths one family states beside hidden_size / intermediate_size (OPT; Cohere 2 MoE, and its
    # generic name)
    **dict.fromkeys(
        ("word_embed_proj_dim", "prefix_dense_intermediate_size", "dense_intermediate_size"), SIZE
    ),
    # 0 for a pattern: none (Transformers writes it so for EXAONE 4 without sliding layers)
    "max_window_layers": (0, LAYERS[1]),
    "sliding_window_pattern": (0, LAYERS[1]),
    "_sliding_window_pattern": (0, LAYERS[1]),
    "decoder_sparse_step": LAYERS,
    "moe_layer_interval": LAYERS,
    "first_k_dense_replace": (0, LAYERS[1]),
    "moe_layer_start_index": (0, LAYERS[1]),
    "moe_layer_num_skipped": (0, LAYERS[1]),
    "moe_layer_end_index": (-1, LAYERS[1]),
    "n_group": EXPERTS,
    "topk_group": EXPERTS,
    **dict.fromkeys(("n_shared_experts", "moe_num_shared_experts", "num_shared_experts"), COUNT),
    "shared_intermediate_size": COUNT,
    "shared_expert_intermediate_size": COUNT,
    "q_lora_rank": COUNT,
    "kv_lora_rank": SIZE,
    "qk_nope_head_dim": COUNT,
    "qk_rope_head_dim": COUNT,
    "v_head_dim": SIZE,
    "value_head_dim": SIZE,
    "bos_token_id": (0, VOCAB[1]),
}
# mixture-of-experts sizes stated once or once per layer (HunYuan's lists)
PER_LAYER: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("n_routed_experts", "moe_num_experts"), EXPERTS),
    # 0: no experts (Granite 4.0's and K2-Horizon's dense models state it); a family that routes
    # refuses it
    # (config_moe's top-k check)
    **dict.fromkeys(("num_local_experts", "num_experts"), (0, EXPERTS[1])),
    "num_experts_per_tok": (0, EXPERTS[1]),
    **dict.fromkeys(("moe_top_k", "moe_k", "moe_topk"), EXPERTS),
    "moe_intermediate_size": SIZE,
    "num_shared_expert": COUNT,
    # Gemma 3n states a width per layer (config.py refuses widths that differ)
    "intermediate_size": SIZE,
    # DeepSeek's interval, or MiMo-V2-Flash's 0/1 per layer (its normalisation turns that into
    # mlp_layer_types)
    "moe_layer_freq": (0, LAYERS[1]),
}
# numbers that must be finite and > 0 (a zero base, epsilon or scale is a damaged config, not
# "none")
POSITIVE = (
    "rope_theta",
    "rotary_emb_base",
    "rope_local_base_freq",
    "rms_norm_eps",
    "layer_norm_eps",
    "norm_epsilon",
    "norm_eps",
    "layer_norm_epsilon",
    "partial_rotary_factor",
    "rotary_pct",
    "query_pre_attn_scalar",
    "logits_scaling",
    "dim_model_base",
    "expansion_ratio",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "clip_qkv",
    "swiglu_limit",
    "swiglu_alpha",
)
# numbers a config may also state once per layer (Step 3.5's rope_theta; its normalisation reads the
# list)
PER_LAYER_NUMBERS = ("rope_theta",)
# numbers that must only be finite
FINITE = (
    "attention_multiplier",
    "embedding_multiplier",
    "scale_emb",
    "logit_scale",
    "residual_multiplier",
    "scale_depth",
    "routed_scaling_factor",
    "router_jitter_noise",
    "attention_value_scale",
    "query_temperature_beta",
)
# lists and objects config.py indexes into
INT_LISTS = ("mlp_only_layers", "attn_type_list", "no_rope_layers")
STR_LISTS = ("layer_types", "mlp_layer_types")
NUMBER_LISTS = ("layer_rope_theta",)
OBJECTS = ("rope_scaling", "rope_parameters", "ffn_act_fn")
STRINGS = ("torch_dtype", "dtype")
# switches config.py and the families read with bool(): the string "false" would read as true (a
# bias, a tied
# head the weights do not have), so a stated switch is true, false, 0 or 1
BOOLS = (
    "alibi",
    "altup_correct_scale",
    "attention_bias",
    "attention_k_eq_v",
    "attention_out_bias",
    "attn_output_gate",
    "bidirectional_prompt",
    "dense_layers_rotate",
    "enable_moe_block",
    "index_rope_tail",
    "layer_scalar",
    "lm_head_bias",
    "loop_pass_norm",
    "mamba_conv_bias",
    "mamba_norm_before_gate",
    "mamba_out_proj_bias",
    "mamba_proj_bias",
    "mamba_rms_norm",
    "mla_lora_rescale",
    "mlp_bias",
    "mlp_down_bias",
    "mlp_output_scale",
    "moe_apply_router_weight_on_input",
    "moe_gate_bias",
    "norm_topk_prob",
    "recurrent_pre_norm",
    "residual_from_norm",
    "residual_in_fp32",
    "rope_interleave",
    "rotate_adjacent_pairs",
    "sigmoid_head_gate",
    "tie_word_embeddings",
    "use_head_wise_attn_gate",
    "use_parallel_residual",
    "use_post_norm",
    "use_shared_attention_adapter",
    "value_norm",
)
# inside a rope_scaling / rope_parameters object
ROPE_POSITIVE = (
    "rope_theta",
    "factor",
    "partial_rotary_factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "alpha",
)
ROPE_FINITE = (
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "short_mscale",
    "long_mscale",
    "llama_4_scaling_beta",
)


def _refuse(path: str, key: str, value, why: str) -> Refusal:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return Refusal(f"invalid model config {path}: {key} is {shown}; {why}; {FIX}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite JSON number (an integer too big for a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_int(path: str, key: str, value, lo: int, hi: int) -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise _refuse(path, key, value, f"it must be an integer from {lo} to {hi}")


def _check_per_layer(path: str, key: str, value, lo: int, hi: int) -> None:
    values = value if isinstance(value, list) and value else [value]
    for item in values:
        if not _is_int(item) or not lo <= item <= hi:
            raise _refuse(
                path,
                key,
                value,
                f"it must be an integer from {lo} to {hi}, or a list of them per layer",
            )


def _check_number(path: str, key: str, value, positive: bool) -> None:
    if not _is_number(value) or (positive and value <= 0):
        raise _refuse(
            path, key, value, "it must be a finite number" + (" above 0" if positive else "")
        )


def _check_list(path: str, key: str, value, ok) -> None:
    if not isinstance(value, list) or not all(ok(item) for item in value):
        raise _refuse(path, key, value, f"it must be a list of {ok.__doc__}")


def _int_item(item) -> bool:
    """integers"""
    return _is_int(item)


def _str_item(item) -> bool:
    """strings"""
    return isinstance(item, str)


def _number_item(item) -> bool:
    """numbers"""
    return _is_number(item)


def check_rope(path: str, key: str, params) -> None:
    """One rotation's parameters (rope_scaling, or a rope_parameters object or one of its per-kind
    objects)."""
    if not isinstance(params, dict):
        raise _refuse(path, key, params, "it must be a JSON object")
    # Transformers 5: one object per layer kind
    for name in ("full_attention", "sliding_attention"):
        if params.get(name) is not None:
            check_rope(path, f"{key}.{name}", params[name])
    for name in ("rope_type", "type"):
        if params.get(name) is not None and not isinstance(params[name], str):
            raise _refuse(path, f"{key}.{name}", params[name], "it must be a string")
    for name in ROPE_POSITIVE + ROPE_FINITE:
        if params.get(name) is not None:
            _check_number(path, f"{key}.{name}", params[name], name in ROPE_POSITIVE)
    if params.get("original_max_position_embeddings") is not None:
        check_int(
            path,
            f"{key}.original_max_position_embeddings",
            params["original_max_position_embeddings"],
            *POSITIONS,
        )
    if "truncate" in params and not isinstance(params["truncate"], bool):
        raise _refuse(path, f"{key}.truncate", params["truncate"], "it must be true or false")
    if (params.get("rope_type") or params.get("type")) == "longrope":
        for name in ("short_factor", "long_factor"):  # the rotation reads both tables
            _check_list(path, f"{key}.{name}", params.get(name), _number_item)


def check_stated(raw: dict, path: str) -> None:
    """Every stated value config.py reads has its type and range."""
    stated = {key: value for key, value in raw.items() if value is not None}
    for key, value in stated.items():
        if key in INTS:
            check_int(path, key, value, *INTS[key])
        elif key in PER_LAYER:
            _check_per_layer(path, key, value, *PER_LAYER[key])
        elif key in PER_LAYER_NUMBERS and isinstance(value, list) and value:
            for item in value:
                _check_number(path, key, item, key in POSITIVE)
        elif key in POSITIVE or key in FINITE:
            _check_number(path, key, value, key in POSITIVE)
        elif key in INT_LISTS:
            _check_list(path, key, value, _int_item)
        elif key in STR_LISTS:
            _check_list(path, key, value, _str_item)
        elif key in NUMBER_LISTS:
            _check_list(path, key, value, _number_item)
        elif key in ("rope_scaling", "rope_parameters"):
            check_rope(path, key, value)
        elif key in OBJECTS and not isinstance(value, dict):
            raise _refuse(path, key, value, "it must be a JSON object")
        elif key in STRINGS and not isinstance(value, str):
            raise _refuse(path, key, value, "it must be a string")
        elif key in BOOLS and not (isinstance(value, bool) or (_is_int(value) and value in (0, 1))):
            raise _refuse(path, key, value, "it must be true or false")
    eos = stated.get("eos_token_id")
    if (
        eos is not None
        and not (_is_int(eos) and eos >= 0)
        and not (isinstance(eos, list) and all(_is_int(i) and i >= 0 for i in eos))
    ):
        raise _refuse(path, "eos_token_id", eos, "it must be a token id or a list of token ids")


def check_sizes(
    path: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    head_dim_stated: bool,
    kv_stated: bool,
    layers: int,
    no_rope_layers,
) -> None:
    """How the sizes relate: whole heads of the width, key/value heads that group the query
    heads."""
    if not head_dim_stated and hidden % heads:
        raise Refusal(
            f"invalid model config {path}: hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads}, and no head_dim is stated; {FIX}"
        )
    if head_dim < 1:
        raise Refusal(
            f"invalid model config {path}: head_dim is {head_dim}; it must be at least 1; {FIX}"
        )
    # kv_stated: a family's default count (EXAONE's 8) is the family's rule, read as Transformers
    # reads it
    if kv_stated and heads % kv_heads:
        raise Refusal(
            f"invalid model config {path}: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}; each key/value head must serve whole query heads; {FIX}"
        )
    if no_rope_layers is not None and len(no_rope_layers) != layers:
        raise Refusal(
            f"invalid model config {path}: no_rope_layers lists {len(no_rope_layers)} layers for "
            f"{layers} hidden layers; {FIX}"
        )

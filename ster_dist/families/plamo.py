"""PLaMo 3 (Preferred Networks), published as remote code on the Hub (no Transformers class), as
data.

Llama's block under its own names, as seeds/000 describes it: model.layers.layers.{i} with
mixer.qkv_proj (queries, keys, values stacked), mixer.o_proj and mlp.gate_up_proj (gate rows above
up rows), and sandwich norms whose stored scales are offsets: from one for pre_mixer_norm,
pre_mlp_norm, the final norm and the per-head q_norm / k_norm, from 1/5 for post_mixer_norm and from
5^-1.5 for post_mlp_norm (as modeling_plamo.py fixes them). Every sliding_window_pattern-th layer
attends fully and rotates at rope_theta, by YaRN over initial_context_length positions (beta 32 to
1, bounds not rounded) when rope_scaling_factor is not one; the others attend through window_size
and rotate at rope_local_theta. Under scale_embedding the embedding is multiplied by
sqrt(hidden_size). Its tokenizer is the tokenizer.jsonl tokenizer_files.py reads.

ster_dist never runs its remote code: tests/families/test_plamo3.py checks it against Transformers'
Gemma 3 on the same weights (Gemma 3's block with the post norms' offsets moved into their weights).
"""

from __future__ import annotations

import math

from ster_dist.families.layouts import fused_gate_up, fused_qkv, weight_and_bias
from ster_dist.families.normalize import ConfigProblem, never_biased, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

_LAYER = "model.layers.layers.{i}."
_RULES = (
    Rule("model.embed_tokens.weight", "embed.weight"),
    *weight_and_bias("lm_head", "lm_head"),
    *weight_and_bias("model.norm", "final_norm"),
    *fused_qkv(f"{_LAYER}mixer.qkv_proj"),
    *weight_and_bias(f"{_LAYER}mixer.o_proj", "layers.{i}.attn.o"),
    *weight_and_bias(f"{_LAYER}mixer.q_norm", "layers.{i}.attn.q_norm"),
    *weight_and_bias(f"{_LAYER}mixer.k_norm", "layers.{i}.attn.k_norm"),
    *fused_gate_up(f"{_LAYER}mlp.gate_up_proj"),
    *weight_and_bias(f"{_LAYER}mlp.down_proj", "layers.{i}.mlp.down"),
    *(
        rule
        for name, target in (
            ("pre_mixer_norm", "attn_norm"),
            ("post_mixer_norm", "post_attn_norm"),
            ("pre_mlp_norm", "mlp_norm"),
            ("post_mlp_norm", "post_mlp_norm"),
        )
        for rule in weight_and_bias(f"{_LAYER}{name}", f"layers.{{i}}.{target}")
    ),
)
# Plamo3Config's defaults
_DEFAULTS = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "rms_norm_eps": 1e-6,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 2048,
    "window_size": 128,
    "sliding_window_pattern": 8,
    "rope_theta": 150_000,
    "rope_local_theta": 10_000,
    "rope_scaling_factor": 1,
    "intermediate_size": 13312,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "linear_type": "normal",
}


def _plamo3(raw: dict) -> dict:
    """Plamo3Config's reading: the legacy rope_global_theta and sliding_window (one size, or one per
    layer with None on the full layers) spellings, the layer pattern, and the two rotations as the
    generic keys."""
    out = never_biased(with_defaults(raw, _DEFAULTS))
    if out.get("linear_type") != "normal":
        raise ConfigProblem(
            f"linear_type is {out.get('linear_type')!r}; only PLaMo 3's normal linear layers are "
            "supported: use a checkpoint whose linear_type is normal"
        )
    if raw.get("rope_global_theta") is not None and raw.get("rope_theta") is None:
        out["rope_theta"] = raw["rope_global_theta"]
    window = out.get("window_size")
    legacy = raw.get("sliding_window")
    if isinstance(legacy, list):
        sizes = {w for w in legacy if w is not None}
        if len(sizes) == 1:
            window = sizes.pop()
    elif legacy is not None:
        window = legacy
    pattern, layers = out.get("sliding_window_pattern"), out.get("num_hidden_layers")
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigProblem(
            f"sliding_window_pattern is {pattern!r}; state every how many layers one attends "
            "fully, a whole number from 1"
        )
    if isinstance(layers, int) and not isinstance(layers, bool):
        out["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)
        ]
    out["sliding_window"] = window
    out["rope_local_base_freq"] = out.get("rope_local_theta")
    out.pop("rope_parameters", None)
    factor = stated(out, "rope_scaling_factor", default=1)
    if factor != 1:
        length = out.get("initial_context_length")
        if length is None:
            raise ConfigProblem(
                f"rope_scaling_factor is {factor!r} without initial_context_length, the positions "
                "its YaRN stretches; state initial_context_length"
            )
        out["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": length,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    else:
        out.pop("rope_scaling", None)
    hidden = out.get("hidden_size")
    if switch(out, "scale_embedding") and isinstance(hidden, (int, float)) and hidden > 0:
        out["embedding_multiplier"] = math.sqrt(hidden)
    else:
        out["embedding_multiplier"] = 1.0
    return out


PLAMO_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "plamo3",
        _RULES,
        attention=AttentionSpec(sliding="pattern", qk_norm=QKNormSpec("head")),
        norms=NormSpec(offset=1.0, post=True, post_offsets=(1 / 5, 5**-1.5)),
        embedding=EmbeddingSpec(tied=True),
        positions=PositionSpec(),
        normalize=_plamo3,
        parity_reference="tests/families/test_plamo3.py",
    ),
)

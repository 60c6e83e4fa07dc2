"""Llama, the families Transformers builds from Llama's or Mistral's classes with Llama's names, and
the remote-code families (no Transformers class) that are Llama's block with Llama's names and a
switch or two.

- llama: the reference block (RMS norms, gated SiLU feed-forward, rotated halves).
- mistral: Llama with a sliding window on every layer.
- ministral3: Mistral with Llama 4's query temperature (rope_parameters' llama_4_scaling_beta).
- smollm3: Llama whose no_rope_layers leave some layers unrotated, Qwen2's max_window_layers window,
  a tied head.
- seed_oss: Llama with query/key/value biased by default and the output's bias under its own key.
- iquestcoder: Llama with mlp_bias, clip_qkv and Qwen2's max_window_layers window; Transformers has
  no model class of its own and runs it as LlamaForCausalLM, its parity reference.
- starcoder2: Mistral's block with biased LayerNorms and a plain c_fc / c_proj feed-forward.
- minicpm (remote code): a tied head by default, the embedding times scale_emb, each sublayer's
  output times scale_depth / sqrt(layers) and the logits times dim_model_base / hidden_size
  (config.from_hf reads these three keys for every family). MiniCPM-MoE's experts, and MiniCPM 4's
  use_mup false, are refused. MiniCPM3's latent attention is in deepseek.py.
- orion (remote code): biased LayerNorms (epsilon under rms_norm_eps).
- solar (Solar Pro, remote code): block skip connections: the hidden state kept before the layers
  bskcn_1 (and bskcn_2) list is mixed back in before those bskcn_3 (and bskcn_4) list, weighted by
  bskcn_tv's second number (the inference weight; the first is training's), written as the generic
  block_skips.

ster_dist never runs remote code: the remote families are checked against the plain-torch reference
written in tests/families/test_internlm_minicpm_orion_solar.py from seeds/000's description.

Mistral's own checkpoint format (params.json) is mistral_format.py; Mixtral is mixtral.py.
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.families.layouts import llama_rules
from ster_dist.families.normalize import biases, biases_from, defaults, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    FeedForwardSpec,
    NormSpec,
)

_LLAMA = llama_rules(q_norm=None, k_norm=None)
_SLIDING = AttentionSpec(sliding="all")
_MAX_WINDOW_LAYERS = AttentionSpec(sliding="max_window_layers")
# what Transformers' config classes assume where a config is silent
_MINISTRAL3_DEFAULTS = {
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
_IQUESTCODER_DEFAULTS = {"head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
# and what MiniCPM's remote configuration class assumes
_MINICPM_DEFAULTS = {"scale_emb": 1, "scale_depth": 1, "dim_model_base": 1, "rms_norm_eps": 1e-6}
_REMOTE_REFERENCE = "tests/families/test_internlm_minicpm_orion_solar.py"


def _seed_oss(raw: dict) -> dict:
    """Query/key/value biased unless attention_bias says not; the output's bias under its own key,
    off by default."""
    raw = with_defaults(raw, {"head_dim": 128, "num_key_value_heads": 8})
    return {
        **raw,
        "attention_bias": bool(stated(raw, "attention_bias", default=True)),
        "attention_out_bias": bool(stated(raw, "attention_out_bias", default=False)),
    }


def _minicpm(raw: dict) -> dict:
    return biases(
        with_defaults(raw, _MINICPM_DEFAULTS), bool(stated(raw, "attention_bias", default=False))
    )


def _orion(raw: dict) -> dict:
    raw = with_defaults(raw, {"rms_norm_eps": 1e-5})
    return biases(raw, bool(stated(raw, "attention_bias", default=False)))


def _solar(raw: dict) -> dict:
    skips = [raw.get(key) for key in ("bskcn_1", "bskcn_2", "bskcn_3", "bskcn_4")]
    weights = raw.get("bskcn_tv")
    if (
        any(not isinstance(s, list) for s in skips)
        or not isinstance(weights, list)
        or len(weights) != 2
    ):
        raise Refusal(
            "invalid model config: solar needs bskcn_1, bskcn_2, bskcn_3 and bskcn_4 (lists of layers) "
            "and bskcn_tv (the training and inference weights); state them as Solar Pro's config does"
        )
    keep_1, keep_2, mix_1, mix_2 = skips
    return {**raw, "block_skips": [[keep_1, mix_1, weights[1]], [keep_2, mix_2, weights[1]]]}


_MINICPM_MOE = "MiniCPM-MoE's experts are not supported; use a dense MiniCPM checkpoint"
# MiniCPM 4's switch for its muP scales; ster_dist applies them always, as the seed describes
# MiniCPM
_NO_MUP = "MiniCPM without its muP scales is not supported; use a checkpoint that applies them (use_mup true)"
LLAMA_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("llama", _LLAMA, parity_reference="LlamaForCausalLM"),
    FamilySpec("mistral", _LLAMA, attention=_SLIDING, parity_reference="MistralForCausalLM"),
    # Mistral's block with Llama 4's query temperature (rope_parameters' llama_4_scaling_beta)
    FamilySpec(
        "ministral3",
        _LLAMA,
        attention=AttentionSpec(sliding="all", query_temperature=True),
        normalize=defaults(_MINISTRAL3_DEFAULTS),
        parity_reference="Ministral3ForCausalLM",
    ),
    FamilySpec(
        "smollm3",
        _LLAMA,
        attention=_MAX_WINDOW_LAYERS,
        embedding=EmbeddingSpec(tied=True),
        parity_reference="SmolLM3ForCausalLM",
    ),
    FamilySpec("seed_oss", _LLAMA, normalize=_seed_oss, parity_reference="SeedOssForCausalLM"),
    # IQuest-Coder: Llama with mlp_bias, clip_qkv and Qwen2's max_window_layers sliding window (the
    # last two are
    # refused by Transformers' config class, so parity covers the biases only)
    FamilySpec(
        "iquestcoder",
        _LLAMA,
        attention=_MAX_WINDOW_LAYERS,
        normalize=defaults(_IQUESTCODER_DEFAULTS),
        parity_reference="LlamaForCausalLM",
    ),
    FamilySpec(
        "starcoder2",
        llama_rules(gate=None, up="c_fc", down="c_proj", q_norm=None, k_norm=None),
        norms=NormSpec(kind="layer", bias=True),
        feed_forward=FeedForwardSpec(gated=False),
        attention=_SLIDING,
        embedding=EmbeddingSpec(tied=True),
        normalize=lambda raw: biases_from(raw, "use_bias"),
        parity_reference="Starcoder2ForCausalLM",
    ),
    FamilySpec(
        "minicpm",
        _LLAMA,
        embedding=EmbeddingSpec(tied=True),
        normalize=_minicpm,
        refuse_keys={"num_experts": _MINICPM_MOE},
        require_values={"use_mup": (True, _NO_MUP)},
        parity_reference=_REMOTE_REFERENCE,
    ),
    FamilySpec(
        "orion",
        _LLAMA,
        norms=NormSpec(kind="layer", bias=True),
        normalize=_orion,
        parity_reference=_REMOTE_REFERENCE,
    ),
    FamilySpec("solar", _LLAMA, normalize=_solar, parity_reference=_REMOTE_REFERENCE),
)

"""DeepSeek's latent attention and its router, and the families Transformers builds from them.

Latent attention's decoder parameters: layers.{i}.attn.{q_a,q_a_norm,q_b,q,kv_a,kv_a_norm,kv_b,o}.

- deepseek_v2: latent attention over softmax routing (greedy or group-limited) and shared experts,
  scaled without renormalising.
- deepseek_v3: DeepSeek-V2 with a sigmoid router, a selection bias beside it and group-limited
  noaux_tc selection (`DEEPSEEK_V3_ROUTER`, which GLM-4-MoE, EXAONE MoE and Sarvam MoE reuse).
- glm4_moe_lite (GLM-4.7-Flash): DeepSeek-V3's attention and router, its sparse layers named by
  mlp_layer_types (Transformers builds it from DeepseekV3 and Glm4Moe classes).
- deepseek_v32 (DeepSeek-V3.2): DeepSeek-V3 (GLM-4.7-Flash's config class) with DeepSeek Sparse
  Attention: every layer's indexer (layers.{i}.attn.indexer.{wq_b,wk,k_norm,weights_proj},
  model/indexer.py) keeps each query's index_topk best keys, rotating its own heads by halves.
  DeepSeek's own releases are FP8 (quantization_config) and refused; their BF16 exports load.
- glm_moe_dsa (GLM-5): DeepSeek-V3.2 whose indexers rotate adjacent pairs (indexer_rope_interleave,
  on unless stated off) and run only on the layers indexer_types marks "full" (else derived from
  index_topk_pattern, or index_topk_freq and index_skip_topk_offset, as GlmMoeDsaConfig derives it);
  a "shared" layer reuses the last full layer's choice.
- minicpm3: DeepSeek-V2's latent attention in a dense block with MiniCPM's multipliers and a tied
  head.
- sarvam_mla (Sarvam-105B, which Transformers runs as DeepSeek-V3): DeepSeek-V3's names, adjacent
  pairs rotating, Sarvam's own config spellings (a deepseek_yarn rope_scaling, score_function,
  moe_router_enable_expert_bias, moe_shared_expert_intermediate_size, a head_dim meant for vLLM)
  read as DeepSeek-V3's keys.
- axk1 (A.X-K1): DeepSeek-V3's latent attention (always a compressed query) with a
  post_mlp_layernorm over each sparse layer's feed-forward output (dense layers store one too and
  never apply it); its topk_method none is group-limited greedy over sigmoid scores without a
  selection bias, each group ranked by its best expert.
- deepseek (DeepSeek-MoE, the first DeepSeek mixture, published as remote code): Llama's attention,
  rotating by halves, with DeepSeek's experts: softmax over n_routed_experts, greedy, renormalised
  only under norm_topk_prob and never scaled, beside n_shared_experts ungated shared ones; dense
  before first_k_dense_replace and off moe_layer_freq. ster_dist never runs its remote code: it is
  checked against the reference written in tests/families/test_pangu_ultra_deepseek_moe_ling.py from
  seeds/000's description (Transformers' Llama with DeepSeek-V2's sparse blocks).
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import deepseek_moe_rules
from ster_dist.families.normalize import ConfigProblem, stated, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    MoESpec,
    PositionSpec,
    Rule,
)

# DeepSeek-V3's router: sigmoid scores, a selection bias, group-limited top-k, always scaled, shared
# experts
DEEPSEEK_V3_ROUTER = MoESpec(
    scoring="sigmoid",
    topk_method="noaux_tc",
    scaling="always",
    correction_bias=True,
    shared="deepseek",
)


def latent_rules(attn: str = "model.layers.{i}.self_attn") -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for name, target in (
        ("q_a_proj", "q_a"),
        ("q_a_layernorm", "q_a_norm"),
        ("q_b_proj", "q_b"),
        ("q_proj", "q"),
        ("kv_a_proj_with_mqa", "kv_a"),
        ("kv_a_layernorm", "kv_a_norm"),
        ("kv_b_proj", "kv_b"),
    ):
        rules += weight_and_bias(f"{attn}.{name}", f"layers.{{i}}.attn.{target}")
    return tuple(rules)


# Llama's block with latent attention in place of q/k/v
_LATENT_BLOCK = llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None) + latent_rules()
DEEPSEEK_RULES = _LATENT_BLOCK + deepseek_moe_rules()
# latent attention, its rotation by adjacent pairs
_LATENT = dict(attention=AttentionSpec(latent=True), positions=PositionSpec(interleaved=True))


def _latent_biases(raw: dict, defaults: dict | None = None) -> dict:
    """attention_bias switches every attention projection's bias; the feed-forward has none,
    whatever mlp_bias (which DeepseekV2Config and MiniCPM3's state) says."""
    return {**with_defaults(raw, defaults or {}), "mlp_bias": False}


_SARVAM_MLA_DEFAULTS = {
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
}


def _sarvam_mla(raw: dict) -> dict:
    """SarvamMLAConfig's defaults, and Sarvam's own spellings as DeepSeek-V3's: deepseek_yarn is
    YaRN; the selection bias (on unless moe_router_enable_expert_bias says not) chooses within
    groups as DeepSeek-V3 does; without it the experts are chosen greedily, which only one group
    allows."""
    own = {
        "n_routed_experts": stated(raw, "n_routed_experts", "num_experts"),
        "n_shared_experts": stated(raw, "n_shared_experts", "num_shared_experts"),
    }
    # Sarvam's spellings before the defaults
    raw = {**raw, **{k: v for k, v in own.items() if v is not None}}
    raw = {
        k: v
        for k, v in with_defaults(raw, _SARVAM_MLA_DEFAULTS).items()
        if k not in ("head_dim", "q_head_dim")
    }
    scaling = raw.get("rope_scaling") or {}
    if "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        raw["rope_scaling"] = {
            **{k: v for k, v in scaling.items() if k != "type"},
            "rope_type": "yarn",
        }
    width = stated(raw, "moe_shared_expert_intermediate_size", default=raw["moe_intermediate_size"])
    shared = int(stated(raw, "n_shared_experts", default=0))
    method = "noaux_tc"
    if not stated(raw, "moe_router_enable_expert_bias", default=True):
        if int(raw["n_group"] or 1) > 1:
            raise ConfigProblem(
                "moe_router_enable_expert_bias is false with n_group above one: groups are ranked "
                "only with the selection bias; set n_group to 1 or enable the bias"
            )
        method = "greedy"
    return {
        **_latent_biases(raw),
        "scoring_func": stated(raw, "score_function", default="sigmoid"),
        "topk_method": method,
        "shared_intermediate_size": width * shared,
    }


_AXK1_DEFAULTS = {
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 8,
    "topk_group": 4,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "scoring_func": "sigmoid",
    "topk_method": "none",
}


def _axk1(raw: dict) -> dict:
    """AXK1Config's defaults; topk_method none (A.X-K1's own) is group-limited greedy without a
    selection bias, as A.X-K1's vLLM code routes. Transformers' class ranks groups by their best two
    experts' sum over a zero bias instead: the two agree whenever topk_group keeps every group."""
    raw = with_defaults(raw, _AXK1_DEFAULTS)
    method = "group_limited_greedy" if raw["topk_method"] in (None, "none") else raw["topk_method"]
    return {**_latent_biases(raw), "topk_method": method, "post_mlp_norm_sparse_only": True}


# A.X-K1's norm over a sparse layer's feed-forward output, stored in every layer
_AXK1_RULES = DEEPSEEK_RULES + tuple(
    Rule(r.checkpoint, r.target, optional=True)
    for r in weight_and_bias("model.layers.{i}.post_mlp_layernorm", "layers.{i}.post_mlp_norm")
)

INDEXER_RULES = tuple(
    rule
    for name in ("wq_b", "wk", "k_norm", "weights_proj")
    for rule in weight_and_bias(
        f"model.layers.{{i}}.self_attn.indexer.{name}", f"layers.{{i}}.attn.indexer.{name}"
    )
)
_SPARSE_DEFAULTS = {
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "index_topk": 2048,
    "index_head_dim": 128,
    "qk_rope_head_dim": 64,
}


def sparse_attention_keys(raw: dict, defaults: dict, kinds) -> dict:
    """DeepSeek Sparse Attention's keys over the latent families': the indexers' sizes, which layers
    run one (indexer_types) and how they rotate. Latent attention always rotates adjacent pairs here
    (the config classes drop rope_interleave) and the layer_types Transformers writes only name the
    cache's kind."""
    raw = _latent_biases(raw, {**_SPARSE_DEFAULTS, **defaults})
    if not raw.get("q_lora_rank"):
        raise ConfigProblem(
            "q_lora_rank is null: the sparse-attention indexer reads the query's compressed latent; "
            "state q_lora_rank"
        )
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1:
            raise ConfigProblem(f"{key} is {raw[key]!r}: state a positive integer")
    if raw["index_head_dim"] < (raw["qk_rope_head_dim"] or 0):
        raise ConfigProblem(
            f"index_head_dim {raw['index_head_dim']} is narrower than the rotated qk_rope_head_dim "
            f"{raw['qk_rope_head_dim']}: state an index_head_dim at least that wide"
        )
    layers = raw["num_hidden_layers"]
    kinds = list(kinds(raw, layers))
    if len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
        raise ConfigProblem(
            f'indexer_types {kinds} must name "full" or "shared" for each of the {layers} '
            f"layers, the first full (a shared layer reuses the last full layer's choice)"
        )
    return {
        **raw,
        "indexer_types": kinds,
        "index_rope_interleave": bool(raw["indexer_rope_interleave"]),
        "rope_interleave": True,
        "layer_types": None,
    }


def _glm_indexer_types(raw: dict, layers: int) -> list[str]:
    """GlmMoeDsaConfig's derivation: stated, from index_topk_pattern ("F"/"S" per layer), or full on
    every index_topk_freq-th layer from index_skip_topk_offset - 1 (and every layer before it)."""
    if raw.get("indexer_types"):
        return raw["indexer_types"]
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return (
            [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            if isinstance(pattern, str)
            else pattern
        )
    freq, offset = (
        max(int(stated(raw, "index_topk_freq", default=1)), 1),
        stated(raw, "index_skip_topk_offset", default=2),
    )
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _deepseek(raw: dict) -> dict:
    """DeepseekConfig's defaults (every layer sparse, the chosen weights kept as scored);
    attention_bias biases every attention projection, the feed-forward never."""
    raw = with_defaults(
        raw, {"first_k_dense_replace": 0, "moe_layer_freq": 1, "norm_topk_prob": False}
    )
    bias = bool(stated(raw, "attention_bias", default=False))
    return {**raw, "attention_bias": bias, "attention_out_bias": bias, "mlp_bias": False}


_DEEPSEEK_REQUIRED = {
    "scoring_func": ("softmax", "DeepSeek-MoE scores its experts by softmax only"),
    "topk_method": ("greedy", "DeepSeek-MoE chooses its experts greedily only"),
}


DEEPSEEK_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "deepseek_v2",
        DEEPSEEK_RULES,
        **_LATENT,
        normalize=_latent_biases,
        moe=MoESpec(scaling="without_renormalize", shared="deepseek"),
        parity_reference="DeepseekV2ForCausalLM",
    ),
    FamilySpec(
        "deepseek_v3",
        DEEPSEEK_RULES,
        **_LATENT,
        normalize=lambda raw: _latent_biases(
            raw,
            {
                "n_group": 8,
                "topk_group": 4,
                "routed_scaling_factor": 2.5,
                "first_k_dense_replace": 3,
                "norm_topk_prob": True,
            },
        ),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="DeepseekV3ForCausalLM",
    ),
    FamilySpec(
        "glm4_moe_lite",
        DEEPSEEK_RULES,
        **_LATENT,
        normalize=lambda raw: _latent_biases(
            raw, {"first_k_dense_replace": 1, "norm_topk_prob": True}
        ),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="Glm4MoeLiteForCausalLM",
    ),
    FamilySpec(
        "sarvam_mla",
        DEEPSEEK_RULES,
        **_LATENT,
        normalize=_sarvam_mla,
        moe=MoESpec(scaling="always", shared="stated"),
        parity_reference="DeepseekV3ForCausalLM",
    ),
    FamilySpec(
        "axk1",
        _AXK1_RULES,
        **_LATENT,
        normalize=_axk1,
        moe=MoESpec(scoring="sigmoid", scaling="always", shared="deepseek"),
        parity_reference="AXK1ForCausalLM",
    ),
    FamilySpec(
        "deepseek_v32",
        DEEPSEEK_RULES + INDEXER_RULES,
        **_LATENT,
        normalize=lambda raw: sparse_attention_keys(
            raw,
            {
                "n_group": 8,
                "topk_group": 4,
                "index_n_heads": 64,
                "rms_norm_eps": 1e-6,
                "indexer_rope_interleave": False,
                "num_hidden_layers": 61,
                "q_lora_rank": 1536,
            },
            lambda raw, layers: ["full"] * layers,
        ),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="DeepseekV32ForCausalLM",
        refuse_keys={
            "quantization_config": "DeepSeek's own V3.2 checkpoints are FP8, which is not read for "
            "this family; load a BF16 export"
        },
    ),
    FamilySpec(
        "glm_moe_dsa",
        DEEPSEEK_RULES + tuple(Rule(r.checkpoint, r.target, optional=True) for r in INDEXER_RULES),
        **_LATENT,
        normalize=lambda raw: sparse_attention_keys(
            raw,
            {
                "n_group": 1,
                "topk_group": 1,
                "index_n_heads": 32,
                "rms_norm_eps": 1e-5,
                "indexer_rope_interleave": True,
                "num_hidden_layers": 78,
                "q_lora_rank": 2048,
            },
            _glm_indexer_types,
        ),
        moe=DEEPSEEK_V3_ROUTER,
        parity_reference="GlmMoeDsaForCausalLM",
    ),
    FamilySpec(
        "minicpm3",
        _LATENT_BLOCK,
        attention=AttentionSpec(latent=True),
        embedding=EmbeddingSpec(tied=True),
        normalize=_latent_biases,
        parity_reference="MiniCPM3ForCausalLM",
    ),
    FamilySpec(
        "deepseek",
        llama_rules(q_norm=None, k_norm=None) + deepseek_moe_rules(),
        normalize=_deepseek,
        moe=MoESpec(shared="deepseek"),
        require_values=_DEEPSEEK_REQUIRED,
        parity_reference="tests/families/test_pangu_ultra_deepseek_moe_ling.py",
    ),
)

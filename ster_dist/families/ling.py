"""inclusionAI's Ling mixtures (and Param2-MoE, built on Ling 2.0), published as remote code on the
Hub (no Transformers class), as data. Sarvam MoE, which keeps Ling's layout under GLM-4-MoE's
router, is in glm.py beside
`ling_rules`.

- bailing_moe (Ling 1.x and Ling 2.0): Llama's block under Ling's names (glm.ling_rules:
  word_embeddings, one attention.query_key_value biased under use_qkv_bias, per-head query/key norms
  under use_qk_norm, attention.dense biased under use_bias), the first first_k_dense_replace layers
  dense, the rest routing beside num_shared_experts shared experts. Ling 1.x scores by softmax,
  greedy, renormalised under norm_topk_prob; Ling 2.0's score_function sigmoid chooses by the scores
  plus mlp.gate.expert_bias (under moe_router_enable_expert_bias) within its best topk_group of
  n_group groups, always renormalised and scaled by routed_scaling_factor.
- param2moe (Param2-MoE): Ling 2.0's block and router under Ling's names, its sigmoid scores stated
  or not, with Param2MoEConfig's defaults (query/key norms on, first_k_dense_replace 1,
  routed_scaling_factor 2.5, rope_theta 1e6, a tied head).

ster_dist never runs their remote code: each is checked against the reference written in
tests/families/test_pangu_ultra_deepseek_moe_ling.py from seeds/000's description (Ling 2.0:
Transformers' GLM-4-MoE on renamed weights; Ling 1.x: Llama with DeepSeek-V2's sparse blocks).
"""

from __future__ import annotations

from ster_dist.families.glm import ling_rules
from ster_dist.families.normalize import ConfigProblem, biases, stated, switch, with_defaults
from ster_dist.families.spec import (
    AttentionSpec,
    EmbeddingSpec,
    FamilySpec,
    MoESpec,
    PositionSpec,
    QKNormSpec,
)

_REFERENCE = "tests/families/test_pangu_ultra_deepseek_moe_ling.py"


def _bailing_moe(raw: dict) -> dict:
    """Ling 1.x (softmax: greedy, renormalised under norm_topk_prob, unscaled) or Ling 2.0
    (score_function sigmoid: grouped selection by the biased scores, always renormalised, scaled);
    use_qkv_bias biases query, key and value, use_bias the output projection."""
    scoring = stated(raw, "score_function", default="softmax")
    # BailingMoeConfig (Ling 1.x, which states no score_function) biases the output projection
    # unless told not;
    # BailingMoeV2Config does not
    raw = with_defaults(
        raw,
        {
            "first_k_dense_replace": 0,
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
            "use_bias": "score_function" not in raw,
        },
    )
    out = {
        **biases(raw, switch(raw, "use_qkv_bias"), out=switch(raw, "use_bias")),
        "use_qk_norm": switch(raw, "use_qk_norm"),
    }
    if scoring == "softmax":
        return {
            **out,
            "scoring_func": "softmax",
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
        }
    if scoring != "sigmoid":
        raise ConfigProblem(
            f"score_function is {scoring!r}; Ling scores its experts by softmax (Ling 1.x) or "
            "sigmoid (Ling 2.0) only"
        )
    method = "noaux_tc"
    if not stated(raw, "moe_router_enable_expert_bias", default=True):
        if int(raw["n_group"] or 1) > 1:
            raise ConfigProblem(
                "moe_router_enable_expert_bias is false with n_group above one: groups are ranked "
                "only with the selection bias here; set n_group to 1 or enable the bias"
            )
        method = "greedy"
    return {**out, "scoring_func": "sigmoid", "topk_method": method, "norm_topk_prob": True}


def _param2moe(raw: dict) -> dict:
    """Ling 2.0's reading under Param2MoEConfig's defaults; its score function (score_function, or
    scoring_func as Transformers' class spells it) must be sigmoid."""
    scoring = stated(raw, "score_function", "scoring_func", default="sigmoid")
    if scoring != "sigmoid":
        raise ConfigProblem(
            f"score_function is {scoring!r}; Param2-MoE scores its experts by sigmoid only"
        )
    raw = with_defaults(
        raw,
        {
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "use_bias": False,
        },
    )
    qkv_bias = stated(raw, "use_qkv_bias", "attention_bias", default=False)
    return _bailing_moe({**raw, "score_function": "sigmoid", "use_qkv_bias": qkv_bias})


_BAILING_REFUSED = {
    "norm_head": "Ling's normalised head (norm_head) is not supported; use a checkpoint without it",
    "norm_softmax": "Ling's normalised softmax (norm_softmax) is not supported; use a checkpoint without it",
}

LING_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "bailing_moe",
        ling_rules(),
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        normalize=_bailing_moe,
        moe=MoESpec(scaling="always", shared="deepseek"),
        refuse_keys=_BAILING_REFUSED,
        parity_reference=_REFERENCE,
    ),
    FamilySpec(
        "param2moe",
        ling_rules(),
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        positions=PositionSpec(theta=1000000.0),
        embedding=EmbeddingSpec(tied=True),
        normalize=_param2moe,
        moe=MoESpec(scaling="always", shared="deepseek"),
        refuse_keys=_BAILING_REFUSED,
        parity_reference=_REFERENCE,
    ),
)

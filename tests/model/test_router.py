"""The router against references: Transformers' own router modules for every family, and a direct
per-token loop for every combination of scoring, selection, renormalisation and scaling. Also the
config rules that decide them (which layers are sparse, when routed_scaling_factor applies) and
the refusals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ster_dist.config import MoEConfig, from_hf
from ster_dist.errors import Refusal
from ster_dist.moe.router import Router, route

HIDDEN = 32


def dense(weights: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """[tokens, experts] with each chosen expert's weight and zeros elsewhere: comparable whatever
    the order."""
    return torch.zeros(ids.shape[0], experts, dtype=torch.float64).scatter(1, ids, weights.double())


def _x(tokens: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _reference_loop(
    logits: torch.Tensor, moe: MoEConfig, correction: torch.Tensor | None
) -> torch.Tensor:
    """seeds/000's routing read literally, one token at a time, in float64."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    per_group = moe.num_experts // moe.n_group
    for t, row in enumerate(logits.double()):
        if moe.scoring == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row.tolist()]
        else:
            z = sum(math.exp(v) for v in row.tolist())
            scores = [math.exp(v) / z for v in row.tolist()]
        choice = [
            s + (float(correction[e]) if correction is not None else 0.0)
            for e, s in enumerate(scores)
        ]
        allowed = set(range(moe.num_experts))
        if moe.topk_method != "greedy":
            groups = [choice[g * per_group : (g + 1) * per_group] for g in range(moe.n_group)]
            if moe.topk_method == "noaux_tc":
                rank = [sum(sorted(g, reverse=True)[:2]) for g in groups]
            else:
                rank = [max(g) for g in groups]
            kept = sorted(range(moe.n_group), key=lambda g: -rank[g])[: moe.topk_group]
            allowed = {g * per_group + j for g in kept for j in range(per_group)}
        chosen = sorted(allowed, key=lambda e: -choice[e])[: moe.top_k]
        weights = {e: scores[e] for e in chosen}
        if moe.renormalize:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        for e, w in weights.items():
            out[t, e] = w * moe.scaling_factor
    return out


CASES = [
    dict(scoring=s, topk_method=m, renormalize=r, scaling_factor=f)
    for s, m, r, f in itertools.product(
        ("softmax", "sigmoid"),
        ("greedy", "group_limited_greedy", "noaux_tc"),
        (False, True),
        (1.0, 2.5),
    )
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_every_routing_variant_matches_a_direct_reference(case):
    moe = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, n_group=4, topk_group=2, **case)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(48, 16, generator=gen) * 2
    correction = torch.randn(16, generator=gen) * 0.3 if case["topk_method"] == "noaux_tc" else None
    weights, ids = route(logits, moe, correction)
    assert weights.dtype == torch.float32 and ids.shape == (48, 4)
    assert torch.allclose(
        dense(weights, ids, 16), _reference_loop(logits, moe, correction), atol=1e-6
    )


def test_the_correction_bias_chooses_but_never_weighs():
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        intermediate_size=8,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
    )
    logits = torch.zeros(1, 8)
    logits[0, 0] = 3.0  # expert 0 scores best
    correction = torch.zeros(8)
    correction[5] = correction[6] = 10.0  # but 5 and 6 are chosen
    weights, ids = route(logits, moe, correction)
    assert sorted(ids[0].tolist()) == [5, 6]
    assert torch.allclose(weights, torch.full((1, 2), 0.5))  # sigmoid(0), not shifted by the bias


def _transformers_router(module: str, cls: str, config_cls: str, **kwargs):
    import importlib

    import transformers

    config = getattr(transformers, config_cls)(hidden_size=HIDDEN, num_attention_heads=4, **kwargs)
    router = getattr(
        importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls
    )(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, t in list(router.named_parameters()) + list(router.named_buffers()):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.5 if t.dim() > 1 else 0.2))
    return router.eval()  # PhiMoE's SparseMixer samples in training


def _ours(router, moe: MoEConfig) -> Router:
    ours = Router(moe, HIDDEN)
    params = dict(router.named_parameters())
    buffers = dict(router.named_buffers())
    with torch.no_grad():
        ours.weight.copy_(params.get("weight", params.get("layer.weight")))
        if ours.bias is not None:
            ours.bias.copy_(params["bias"])
        if ours.correction is not None:
            ours.correction.copy_(buffers["e_score_correction_bias"])
    return ours


TRANSFORMERS_ROUTERS = {
    "mixtral": (
        (
            "mixtral",
            "MixtralTopKRouter",
            "MixtralConfig",
            dict(num_local_experts=8, num_experts_per_tok=2),
        ),
        dict(num_experts=8, top_k=2, renormalize=True),
    ),
    "qwen2_moe": (
        (
            "qwen2_moe",
            "Qwen2MoeTopKRouter",
            "Qwen2MoeConfig",
            dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
        ),
        dict(num_experts=8, top_k=3),
    ),
    "qwen3_moe": (
        (
            "qwen3_moe",
            "Qwen3MoeTopKRouter",
            "Qwen3MoeConfig",
            dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        ),
        dict(num_experts=8, top_k=3, renormalize=True),
    ),
    "olmoe": (
        ("olmoe", "OlmoeTopKRouter", "OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2)),
        dict(num_experts=8, top_k=2),
    ),
    "granitemoe": (
        (
            "granitemoe",
            "GraniteMoeTopKRouter",
            "GraniteMoeConfig",
            dict(num_local_experts=8, num_experts_per_tok=2),
        ),
        dict(num_experts=8, top_k=2, renormalize=True),
    ),
    "gpt_oss": (
        (
            "gpt_oss",
            "GptOssTopKRouter",
            "GptOssConfig",
            dict(num_local_experts=8, num_experts_per_tok=3),
        ),
        dict(num_experts=8, top_k=3, renormalize=True, router_bias=True),
    ),
    "deepseek_v2_greedy": (
        (
            "deepseek_v2",
            "DeepseekV2TopkRouter",
            "DeepseekV2Config",
            dict(
                n_routed_experts=16,
                num_experts_per_tok=4,
                topk_method="greedy",
                routed_scaling_factor=1.5,
            ),
        ),
        dict(num_experts=16, top_k=4, scaling_factor=1.5),
    ),
    "deepseek_v2_group": (
        (
            "deepseek_v2",
            "DeepseekV2TopkRouter",
            "DeepseekV2Config",
            dict(
                n_routed_experts=16,
                num_experts_per_tok=4,
                topk_method="group_limited_greedy",
                n_group=4,
                topk_group=2,
                routed_scaling_factor=1.5,
            ),
        ),
        dict(
            num_experts=16,
            top_k=4,
            scaling_factor=1.5,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
        ),
    ),
    "deepseek_v3": (
        (
            "deepseek_v3",
            "DeepseekV3TopkRouter",
            "DeepseekV3Config",
            dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
        ),
        dict(
            num_experts=16,
            top_k=4,
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=4,
            topk_group=2,
            renormalize=True,
            scaling_factor=2.5,
            correction_bias=True,
        ),
    ),
    "glm4_moe": (
        (
            "glm4_moe",
            "Glm4MoeTopkRouter",
            "Glm4MoeConfig",
            dict(
                n_routed_experts=16,
                num_experts_per_tok=4,
                n_group=2,
                topk_group=1,
                routed_scaling_factor=1.8,
            ),
        ),
        dict(
            num_experts=16,
            top_k=4,
            scoring="sigmoid",
            topk_method="noaux_tc",
            n_group=2,
            topk_group=1,
            renormalize=True,
            scaling_factor=1.8,
            correction_bias=True,
        ),
    ),
    "phimoe": (
        (
            "phimoe",
            "PhimoeTopKRouter",
            "PhimoeConfig",
            dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.01),
        ),
        dict(num_experts=8, top_k=2, sparsemixer_eps=0.01),
    ),
    "phimoe_jitter": (
        (
            "phimoe",
            "PhimoeTopKRouter",
            "PhimoeConfig",
            dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.5),
        ),
        dict(num_experts=8, top_k=2, sparsemixer_eps=0.5),
    ),
}


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_ROUTERS))
def test_router_matches_the_transformers_router(family):
    spec, fields = TRANSFORMERS_ROUTERS[family]
    reference = _transformers_router(*spec[:3], **spec[3])
    moe = MoEConfig(intermediate_size=8, **fields)
    ours = _ours(reference, moe)
    x = _x()
    with torch.no_grad():
        out = reference(x)
        if isinstance(out, tuple) and len(out) == 3:
            _, ref_weights, ref_ids = out
        # GraniteMoE returns (logits, weights, ids) too; DBRX-style modules return logits only
        else:
            raise AssertionError(f"unexpected router output for {family}")
        weights, ids = ours(x)
    assert torch.allclose(
        dense(weights, ids, moe.num_experts),
        dense(ref_weights, ref_ids, moe.num_experts),
        atol=1e-6,
    ), family


def test_dbrx_p1_normalisation_matches_transformers():
    import transformers
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN

    config = transformers.DbrxConfig(
        d_model=HIDDEN,
        n_heads=4,
        ffn_config=dict(moe_num_experts=8, moe_top_k=3, ffn_hidden_size=8),
    )
    config.attn_config.rope_theta = 10000.0
    ffn = DbrxFFN(config)
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    ref_weights, ref_ids = ffn.route_tokens_to_experts(logits)
    weights, ids = route(
        logits, MoEConfig(num_experts=8, top_k=3, intermediate_size=8, renormalize=True)
    )
    assert torch.allclose(dense(weights, ids, 8), dense(ref_weights, ref_ids, 8), atol=1e-6)


def test_the_router_runs_in_f32_whatever_the_weights():
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=8)
    router = Router(moe, HIDDEN)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(4)))
    x = _x().to(torch.bfloat16)
    weights, ids = router.to(torch.bfloat16)(x)
    assert weights.dtype == torch.float32
    reference = route(x.float() @ router.weight.float().t(), moe)
    assert torch.equal(ids, reference[1]) and torch.equal(weights, reference[0])


# -- config rules
# ------------------------------------------------------------------------------------


def _cfg(family: str, **keys):
    base = {
        "model_type": family,
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_experts_per_tok": 2,
    }
    if family.startswith("deepseek") or family == "glm4_moe":
        base.update(
            n_routed_experts=8,
            moe_intermediate_size=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_group=2,
            topk_group=1,
        )
    else:
        base.update(num_experts=8, num_local_experts=8)
    return from_hf({**base, **keys})


def test_which_layers_are_sparse():
    assert _cfg("qwen3_moe", mlp_only_layers=[1, 4]).moe_layers == (
        True,
        False,
        True,
        True,
        False,
        True,
    )
    assert _cfg("qwen2_moe", decoder_sparse_step=2).moe_layers == (
        False,
        True,
        False,
        True,
        False,
        True,
    )
    assert _cfg("deepseek_v3", first_k_dense_replace=2).moe_layers == (
        False,
        False,
        True,
        True,
        True,
        True,
    )
    assert _cfg("deepseek_v2", first_k_dense_replace=1, moe_layer_freq=2).moe_layers == (
        False,
        False,
        True,
        False,
        True,
        False,
    )
    assert _cfg("mixtral").moe_layers == (True,) * 6


def test_routed_scaling_factor_on_v3_always_and_on_v2_only_without_renormalisation():
    assert _cfg("deepseek_v3", routed_scaling_factor=2.5).moe.scaling_factor == 2.5
    assert (
        _cfg("deepseek_v2", routed_scaling_factor=2.0, norm_topk_prob=False).moe.scaling_factor
        == 2.0
    )
    v2 = _cfg("deepseek_v2", routed_scaling_factor=2.0, norm_topk_prob=True).moe
    assert v2.scaling_factor == 1.0 and v2.renormalize
    assert _cfg("qwen3_moe", routed_scaling_factor=2.0).moe.scaling_factor == 1.0
    assert _cfg("mixtral", norm_topk_prob=False).moe.renormalize  # always for Mixtral


def test_the_v3_router_is_implicit_for_glm4_moe_and_stated_keys_win():
    glm = _cfg("glm4_moe").moe
    assert (glm.scoring, glm.topk_method, glm.correction_bias, glm.renormalize) == (
        "sigmoid",
        "noaux_tc",
        True,
        True,
    )
    v3 = _cfg("deepseek_v3", scoring_func="softmax", topk_method="group_limited_greedy").moe
    assert (v3.scoring, v3.topk_method) == ("softmax", "group_limited_greedy")


def test_shared_experts_widths():
    assert _cfg("deepseek_v3", n_shared_experts=2).moe.shared_intermediate_size == 32
    qwen = _cfg("qwen2_moe", shared_expert_intermediate_size=40).moe
    assert qwen.shared_intermediate_size == 40 and qwen.shared_gate


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(n_group=3), "do not form n_group 3 groups"),
        (dict(n_group=8, topk_group=1), "ranks each group by its best two"),
        (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "hold fewer than the 3 experts"),
        (dict(scoring_func="tanh"), "scoring_func 'tanh' is not supported"),
        (dict(topk_method="random"), "topk_method 'random' is not supported"),
        (dict(num_experts_per_tok=9), "9 experts per token out of 8"),
    ],
)
def test_routing_refusals(keys, message):
    with pytest.raises(Refusal, match=message):
        _cfg("deepseek_v3", **keys)


def test_dbrx_refuses_other_normalisation_powers():
    raw = {
        "model_type": "dbrx",
        "vocab_size": 100,
        "d_model": 32,
        "n_heads": 4,
        "n_layers": 2,
        "attn_config": {"kv_n_heads": 2},
        "ffn_config": {
            "moe_num_experts": 4,
            "moe_top_k": 2,
            "ffn_hidden_size": 16,
            "moe_normalize_expert_weights": 2.0,
        },
    }
    with pytest.raises(Refusal, match="moe_normalize_expert_weights 2.0 is not supported"):
        from_hf(raw)
    raw["ffn_config"]["moe_normalize_expert_weights"] = 1.0
    cfg = from_hf(raw)
    assert (
        cfg.moe.renormalize
        and cfg.moe.num_experts == 4
        and cfg.num_kv_heads == 2
        and cfg.norm_eps == 1e-5
    )


def test_phimoe_sparsemixer_masks_by_the_jitter_and_refuses_other_configs():
    logits = torch.tensor([[4.0, 3.9, 1.0, -2.0]])
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=8, sparsemixer_eps=0.5)
    weights, ids = route(logits, moe)
    assert ids.tolist() == [[0, 1]]
    # round one: experts 0, 1 and 2 lie within 2 * 0.5 of 4.0 relative to max(|logit|, 4.0); round
    # two: 1 and 2
    first = torch.softmax(torch.tensor([4.0, 3.9, 1.0]), 0)[0]
    second = torch.softmax(torch.tensor([3.9, 1.0]), 0)[0]
    assert torch.allclose(weights, torch.stack([first, second]).unsqueeze(0))
    small = route(
        logits, MoEConfig(num_experts=4, top_k=2, intermediate_size=8, sparsemixer_eps=0.001)
    )[0]
    assert torch.allclose(small, torch.ones(1, 2))
    base = {
        "model_type": "phimoe",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "num_local_experts": 8,
    }
    assert (
        from_hf({**base, "num_experts_per_tok": 2, "router_jitter_noise": 0.01}).moe.sparsemixer_eps
        == 0.01
    )
    with pytest.raises(Refusal, match="two experts, not 3"):
        from_hf({**base, "num_experts_per_tok": 3, "router_jitter_noise": 0.01})
    with pytest.raises(Refusal, match="router_jitter_noise is not stated"):
        from_hf({**base, "num_experts_per_tok": 2})

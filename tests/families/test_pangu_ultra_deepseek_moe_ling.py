"""pangu_ultra_moe, deepseek, bailing_moe and param2moe (families/pangu.py, deepseek.py and ling.py)
against references written here from seeds/000's description, since Transformers (as installed) has
none of their classes.

openPangu-Ultra-MoE is DeepSeek-V3 (latent attention, adjacent pairs rotating) under Pangu's key
names, its router sigmoid without a selection bias: the reference is Transformers' DeepseekV3 with
one expert group and its zero correction bias (greedy over sigmoid scores), renormalised and scaled.
Under sandwich_norm two norms DeepSeek-V3 lacks (over attention's and the feed-forward's outputs)
are added to it by forward hooks, and its post_attention_layernorm is stored as Pangu's
pre_mlp_layernorm. DeepSeek-MoE (deepseek) is Llama's attention with DeepSeek's experts: the
reference is Transformers' Llama whose sparse layers' feed-forward is Transformers' DeepseekV2Moe
(softmax, greedy, routed_scaling_factor 1, ungated shared experts). Ling 2.0 (bailing_moe with
score_function sigmoid) and Param2-MoE (Ling 2.0 under Param2MoEConfig's defaults) are Transformers'
GLM-4-MoE block (as Sarvam MoE is); Ling 1.x is Llama with DeepSeek-V2's sparse blocks. Each is
written to the checkpoint under the family's own tensor names and config keys by the maps below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ster_dist.errors import Refusal
from ster_dist.families.registry import family_table
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import engine_tokens
from tests.remote_checks import (
    check_cache_and_batches,
    check_group_equals_one_rank,
    greedy_by_rereading,
    random_ids,
)
from tests.tiny_tokenizer import build_tiny_tokenizer

VOCAB, HIDDEN, FFN, HEADS, EXPERTS, TOP_K, EXPERT_FFN = 384, 32, 48, 4, 8, 2, 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=FFN,
    num_attention_heads=HEADS,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LATENT = dict(
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12
)
VARIANTS = {
    "pangu_ultra_moe-sandwich": ("pangu_ultra_moe", {"sandwich_norm": True}),
    "pangu_ultra_moe": ("pangu_ultra_moe", {"sandwich_norm": False}),
    "deepseek": ("deepseek", {"first_k_dense_replace": 1, "moe_layer_freq": 2}),
    "bailing_moe-2.0": (
        "bailing_moe",
        {
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.0,
            "num_shared_experts": 1,
            "use_qk_norm": True,
            "use_qkv_bias": True,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "norm_topk_prob": True,
            "use_bias": False,
        },
    ),
    # use_bias unstated: Ling 1.x's config class biases the output projection, as Llama's
    # attention_bias does
    "bailing_moe-1.x": (
        "bailing_moe",
        {"num_shared_experts": 2, "norm_topk_prob": False, "use_qkv_bias": True},
    ),
    # sigmoid scores, query/key norms, one dense layer and the scaling unstated: Param2MoEConfig's
    # defaults
    "param2moe": (
        "param2moe",
        {
            "moe_router_enable_expert_bias": True,
            "n_group": 2,
            "topk_group": 1,
            "num_shared_experts": 1,
            "use_qkv_bias": True,
            "head_dim": 16,
            "rope_theta": 10000.0,
        },
    ),
}
FAMILIES = ("pangu_ultra_moe", "deepseek", "bailing_moe", "param2moe")
# one variant per reference kind runs the cache, batch and parallel checks by default; the others
# under -m slow
CORE = ("pangu_ultra_moe-sandwich", "deepseek", "bailing_moe-2.0")
SPLIT = [
    pytest.param(CORE, id="core"),
    pytest.param(tuple(v for v in VARIANTS if v not in CORE), id="rest", marks=pytest.mark.slow),
]


def _noisy(module: torch.nn.Module, scale: float = 0.2) -> None:
    """Norms away from one and biases away from zero, so a tensor read into the wrong place
    shows."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape) * scale)


def _rms_norm(weight: torch.Tensor, eps: float):
    def norm(x):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    return norm


def _experts(state: dict, hf_prefix: str, prefix: str) -> dict[str, torch.Tensor]:
    """Transformers' stacked experts and router as DeepSeek's per-expert tensors."""
    gate_up, down = (
        state[f"{hf_prefix}experts.gate_up_proj"],
        state[f"{hf_prefix}experts.down_proj"],
    )
    out = {f"{prefix}gate.weight": state[f"{hf_prefix}gate.weight"]}
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2)
        out |= {
            f"{prefix}experts.{e}.gate_proj.weight": gate,
            f"{prefix}experts.{e}.up_proj.weight": up,
            f"{prefix}experts.{e}.down_proj.weight": down[e],
        }
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"{prefix}shared_experts.{name}.weight"] = state[
            f"{hf_prefix}shared_experts.{name}.weight"
        ]
    return out


# --- openPangu-Ultra-MoE: DeepSeek-V3 (plus sandwich norms)
# --------------------------------------------------

PANGU_LAYERS, PANGU_DENSE, PANGU_SCALE = 3, 1, 2.0


def _pangu_config(extra: dict) -> dict:
    return {
        "model_type": "pangu_ultra_moe",
        "architectures": ["PanguUltraMoEForCausalLM"],
        **COMMON,
        "num_hidden_layers": PANGU_LAYERS,
        "num_key_value_heads": HEADS,
        "moe_intermediate_size": EXPERT_FFN,
        "attention_q_lora_dim": LATENT["q_lora_rank"],
        "attention_kv_lora_dim": LATENT["kv_lora_rank"],
        "attention_qk_dim": LATENT["qk_nope_head_dim"],
        "attention_qk_rope_dim": LATENT["qk_rope_head_dim"],
        "attention_v_dim": LATENT["v_head_dim"],
        "num_routed_experts": EXPERTS,
        "num_shared_experts": 1,
        "num_dense_layers": PANGU_DENSE,
        "num_experts_per_tok": TOP_K,
        "routed_scaling_factor": PANGU_SCALE,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        **extra,
    }


def _pangu(directory, extra: dict):
    """Transformers' DeepseekV3 as openPangu-Ultra-MoE routes (one group, zero correction bias),
    with hooks adding the sandwich norms; its weights written under Pangu's names. Returns the
    reference forward."""
    import transformers

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **COMMON,
        **LATENT,
        num_hidden_layers=PANGU_LAYERS,
        num_key_value_heads=HEADS,
        moe_intermediate_size=EXPERT_FFN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=1,
        first_k_dense_replace=PANGU_DENSE,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=PANGU_SCALE,
        rope_interleave=True,
        initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager",
    )
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    _noisy(model)
    s = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if "e_score_correction_bias" not in k
    }
    sandwich = extra["sandwich_norm"]
    state = {k: v for k, v in s.items() if ".mlp." not in k and "post_attention_layernorm" not in k}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        if i >= PANGU_DENSE:
            state |= _experts(s, f"{p}mlp.", f"{p}mlp.")
        else:
            state |= {
                f"{p}mlp.{n}.weight": s[f"{p}mlp.{n}.weight"]
                for n in ("gate_proj", "up_proj", "down_proj")
            }
        if not sandwich:
            state[f"{p}post_attention_layernorm.weight"] = s[f"{p}post_attention_layernorm.weight"]
            continue
        post_attn, post_mlp = (1 + 0.2 * torch.randn(HIDDEN) for _ in range(2))
        state |= {
            f"{p}pre_mlp_layernorm.weight": s[f"{p}post_attention_layernorm.weight"],
            f"{p}post_attention_layernorm.weight": post_attn,
            f"{p}post_mlp_layernorm.weight": post_mlp,
        }
        attn_norm, mlp_norm = (
            _rms_norm(post_attn, COMMON["rms_norm_eps"]),
            _rms_norm(post_mlp, COMMON["rms_norm_eps"]),
        )
        layer.self_attn.register_forward_hook(
            lambda _m, _a, out, n=attn_norm: (n(out[0]), *out[1:])
        )
        layer.mlp.register_forward_hook(lambda _m, _a, out, n=mlp_norm: n(out))
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(_pangu_config(extra)))
    return lambda ids: model(ids).logits


# --- DeepSeek-MoE: Llama's attention, DeepSeek-V2's sparse block
# ----------------------------------------------

DEEPSEEK_LAYERS, DEEPSEEK_SHARED = 5, 2


def _deepseek_config(extra: dict) -> dict:
    return {
        "model_type": "deepseek",
        "architectures": ["DeepseekForCausalLM"],
        **COMMON,
        "num_hidden_layers": DEEPSEEK_LAYERS,
        "num_key_value_heads": 2,
        "moe_intermediate_size": EXPERT_FFN,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": DEEPSEEK_SHARED,
        "num_experts_per_tok": TOP_K,
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        **extra,
    }


def _llama_with_experts(sparse: list[int], seed: int, n_shared: int, **config):
    """Transformers' Llama whose `sparse` layers' feed-forward is Transformers' DeepseekV2Moe
    (softmax, greedy, unscaled, ungated shared experts), and its state with each expert's tensors
    apart, as DeepSeek names them."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **{
                **COMMON,
                "num_key_value_heads": 2,
                "initializer_range": 0.1,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                **config,
            }
        )
    ).eval()
    moe_config = transformers.DeepseekV2Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=EXPERT_FFN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_shared_experts=n_shared,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        hidden_act="silu",
    )
    for i in sparse:
        block = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(moe_config)
        with torch.no_grad():
            for param in block.parameters():
                param.copy_(torch.randn(param.shape) * 0.2)
        model.model.layers[i].mlp = block
    _noisy(model)
    s = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {k: v for k, v in s.items() if not any(f"layers.{i}.mlp." in k for i in sparse)}
    for i in sparse:
        state |= _experts(s, f"model.layers.{i}.mlp.", f"model.layers.{i}.mlp.")
    return model, state


def _deepseek(directory, extra: dict):
    """Llama with DeepSeek-V2's sparse blocks from first_k_dense_replace, every moe_layer_freq-th
    layer, written under DeepSeek-MoE's names. Returns the reference forward."""
    sparse = [
        i
        for i in range(DEEPSEEK_LAYERS)
        if i >= extra["first_k_dense_replace"] and i % extra["moe_layer_freq"] == 0
    ]
    model, state = _llama_with_experts(
        sparse, 1, DEEPSEEK_SHARED, num_hidden_layers=DEEPSEEK_LAYERS
    )
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(_deepseek_config(extra)))
    return lambda ids: model(ids).logits


# --- Ling (bailing_moe): 2.0 is GLM-4-MoE's block, 1.x Llama with DeepSeek-V2's sparse blocks
# -------------------

LING_LAYERS, LING_DENSE, LING_KV, LING_HEAD_DIM = 3, 1, 2, 16
# Transformers' names (Llama, GLM-4-MoE) -> Ling's
_LING_NAMES = (
    ("model.embed_tokens.", "model.word_embeddings."),
    ("self_attn.o_proj.", "attention.dense."),
    ("self_attn.q_norm.", "attention.query_layernorm."),
    ("self_attn.k_norm.", "attention.key_layernorm."),
    ("mlp.gate.e_score_correction_bias", "mlp.gate.expert_bias"),
)


def _as_ling(state: dict, heads: int, kv: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Query, key and value in one attention.query_key_value ([q | k | v] rows), every other name
    renamed."""
    out = {}
    for name, tensor in state.items():
        if any(f"self_attn.{n}_proj." in name for n in ("k", "v")):
            continue
        if "self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", f"{n}_proj")] for n in "qkv"]
            assert [len(t) for t in parts] == [heads * head_dim, kv * head_dim, kv * head_dim]
            out[name.replace("self_attn.q_proj", "attention.query_key_value")] = torch.cat(parts)
            continue
        for theirs, ours in _LING_NAMES:
            name = name.replace(theirs, ours)
        out[name] = tensor
    return out


LING_ARCHITECTURES = {
    "bailing_moe": ("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM"),
    "param2moe": ("Param2MoEForCausalLM",) * 2,
}


def _ling_config(family: str, extra: dict) -> dict:
    v2 = extra.get("score_function") == "sigmoid" or family == "param2moe"
    return {
        "model_type": family,
        "architectures": [LING_ARCHITECTURES[family][v2]],
        **COMMON,
        "num_hidden_layers": LING_LAYERS,
        "num_key_value_heads": LING_KV,
        "moe_intermediate_size": EXPERT_FFN,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "first_k_dense_replace": LING_DENSE,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        **extra,
    }


def _ling(directory, extra: dict, family: str = "bailing_moe"):
    """Ling 2.0: Transformers' GLM-4-MoE (per-head query/key norms, half of each head rotated,
    biased query, key and value, grouped sigmoid routing over a selection bias); Ling 1.x: Llama
    with DeepSeek-V2's sparse blocks. Written under Ling's names. Returns the reference forward."""
    import transformers

    if extra.get("score_function") != "sigmoid" and family != "param2moe":
        model, state = _llama_with_experts(
            list(range(LING_DENSE, LING_LAYERS)),
            2,
            extra["num_shared_experts"],
            num_hidden_layers=LING_LAYERS,
            attention_bias=True,
        )
        state = _as_ling(state, HEADS, LING_KV, HIDDEN // HEADS)
    else:
        torch.manual_seed(3)
        model = transformers.Glm4MoeForCausalLM(
            transformers.Glm4MoeConfig(
                **COMMON,
                num_hidden_layers=LING_LAYERS,
                num_key_value_heads=LING_KV,
                head_dim=LING_HEAD_DIM,
                moe_intermediate_size=EXPERT_FFN,
                n_routed_experts=EXPERTS,
                num_experts_per_tok=TOP_K,
                n_shared_experts=extra["num_shared_experts"],
                first_k_dense_replace=LING_DENSE,
                n_group=extra["n_group"],
                topk_group=extra["topk_group"],
                routed_scaling_factor=extra.get("routed_scaling_factor", 2.5),
                norm_topk_prob=True,
                use_qk_norm=True,
                attention_bias=True,
                initializer_range=0.1,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": extra.get("partial_rotary_factor", 1.0),
                },
            )
        ).eval()
        _noisy(model)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                # zero at init: give the selection its bias
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn(buffer.shape) * 0.1)
        s = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state = {
            k: v
            for k, v in s.items()
            if ".experts." not in k
            and ".shared_experts." not in k
            and not k.endswith("mlp.gate.weight")
        }
        for i in range(LING_DENSE, LING_LAYERS):
            state |= _experts(s, f"model.layers.{i}.mlp.", f"model.layers.{i}.mlp.")
        state = _as_ling(state, HEADS, LING_KV, LING_HEAD_DIM)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(_ling_config(family, extra)))
    return lambda ids: model(ids).logits


BUILDERS = {
    "pangu_ultra_moe": _pangu,
    "deepseek": _deepseek,
    "bailing_moe": _ling,
    "param2moe": lambda directory, extra: _ling(directory, extra, "param2moe"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = {}
    for variant, (family, extra) in VARIANTS.items():
        directory = tmp_path_factory.mktemp(variant)
        reference = BUILDERS[family](directory, extra)
        build_tiny_tokenizer(directory, vocab_size=VOCAB)
        out[variant] = (directory, reference, load_model(resolve(str(directory)), "f32"))
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_tokens_match_the_reference(built, variant):
    _, reference, loaded = built[variant]
    assert loaded.cfg.family == VARIANTS[variant][0]
    ids = random_ids(2, 30)
    with torch.no_grad():
        result = compare(loaded.model(ids), reference(ids))
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, (variant, result)
    prompt = random_ids(1, 7, seed=1)[0].tolist()
    eos = loaded.cfg.eos_token_ids
    assert engine_tokens(loaded, [prompt], 10, eos)[0] == greedy_by_rereading(
        reference, prompt, 10, eos[0]
    )


@pytest.mark.parametrize(
    "variant", [v if v in CORE else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS]
)
def test_decoding_from_cache_equals_reading_whole_and_batches_equal_one_by_one(built, variant):
    check_cache_and_batches(built[variant][2], variant)


def _one_rank(built: dict, variants: tuple[str, ...]) -> dict:
    return {variant: (built[variant][0], built[variant][2]) for variant in variants}


@pytest.mark.parametrize("variants", SPLIT)
def test_tp2_equals_tp1(built, tp2, variants):
    check_group_equals_one_rank(tp2, _one_rank(built, variants))


@pytest.mark.parametrize("variants", SPLIT)
def test_ep2_equals_one_rank(built, ep2, variants):
    check_group_equals_one_rank(ep2, _one_rank(built, variants))


def test_sparse_layers_follow_the_config(built):
    assert built["pangu_ultra_moe"][2].cfg.moe_layers == tuple(
        i >= PANGU_DENSE for i in range(PANGU_LAYERS)
    )
    assert built["deepseek"][2].cfg.moe_layers == (False, False, True, False, True)
    for variant in ("bailing_moe-2.0", "bailing_moe-1.x", "param2moe"):
        assert built[variant][2].cfg.moe_layers == tuple(
            i >= LING_DENSE for i in range(LING_LAYERS)
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_ster_families_lists_each_as_parity_checked_against_this_file(family):
    rows = {row["family"]: row for row in family_table()}
    assert rows[family]["status"] == "parity-checked"
    assert rows[family]["reference"] == str(
        Path(__file__).resolve().relative_to(Path(__file__).resolve().parents[2])
    )


@pytest.mark.parametrize(
    "variant, change, message",
    [
        ("pangu_ultra_moe", {"param_sink_number": 128}, "param_sink_number is set"),
        ("pangu_ultra_moe", {"use_mome": True}, "use_mome is set"),
        ("deepseek", {"scoring_func": "sigmoid"}, "scoring_func is 'sigmoid'"),
        ("deepseek", {"topk_method": "noaux_tc"}, "topk_method is 'noaux_tc'"),
        ("bailing_moe-2.0", {"norm_head": True}, "norm_head is set"),
        ("bailing_moe-2.0", {"norm_softmax": True}, "norm_softmax is set"),
        ("bailing_moe-2.0", {"score_function": "tanh"}, "score_function is 'tanh'"),
        (
            "bailing_moe-2.0",
            {"moe_router_enable_expert_bias": False},
            "moe_router_enable_expert_bias is false",
        ),
        ("param2moe", {"scoring_func": "softmax"}, "score_function is 'softmax'"),
    ],
)
def test_what_each_cannot_state_is_refused_before_any_weight(
    built, tmp_path, variant, change, message
):
    source = built[variant][0]
    config = {**json.loads((source / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    build_tiny_tokenizer(tmp_path, vocab_size=VOCAB)
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)

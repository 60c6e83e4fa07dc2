"""The mixture-of-experts and latent-attention families: one FamilySpec each.

Decoder parameter names of an MoE layer: layers.{i}.mlp.router.{weight,bias,correction},
layers.{i}.mlp.experts.{gate,up,down}[_bias] (stacked [experts, ...]),
layers.{i}.mlp.shared.{gate,up,down}.weight and layers.{i}.mlp.shared_gate.weight.
Latent attention: layers.{i}.attn.{q_a,q_a_norm,q_b,q,kv_a,kv_a_norm,kv_b,o}.

Experts are read from published per-expert tensors (experts.{e}.w1/w3/w2,
experts.{e}.gate_proj/up_proj/down_proj) and from stacked ones: Transformers 5's
own experts.gate_up_proj [experts, 2 * inner, hidden] and down_proj, GraniteMoE's
input_linear / output_linear, DBRX's flat w1 / v1 / w2, GPT-OSS's inputs-first,
interleaved gate_up_proj with biases.
"""

from __future__ import annotations

from ster_dist.families.layouts import fused_qkv, llama_rules, weight_and_bias
from ster_dist.families.spec import FamilySpec, MoESpec, Rule, Stacked

_EXPERTS = "layers.{i}.mlp.experts."


def expert_rules(prefix: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                 stacked: str | None = None) -> tuple[Rule, ...]:
    """Per-expert tensors under `prefix`.experts.{e}, and Transformers 5's stacked layout under `stacked`."""
    rules = tuple(Rule(f"{prefix}.experts.{{e}}.{name}.weight", f"{_EXPERTS}{target}")
                  for name, target in ((gate, "gate"), (up, "up"), (down, "down")))
    where = stacked or prefix
    return rules + (Rule(f"{where}.experts.gate_up_proj", Stacked((f"{_EXPERTS}gate", f"{_EXPERTS}up"))),
                    Rule(f"{where}.experts.down_proj", Stacked((f"{_EXPERTS}down",))))


def shared_rules(prefix: str) -> tuple[Rule, ...]:
    return tuple(Rule(f"{prefix}.{name}.weight", f"layers.{{i}}.mlp.shared.{target}.weight")
                 for name, target in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")))


def router_rules(checkpoint: str) -> tuple[Rule, ...]:
    return (Rule(f"{checkpoint}.weight", "layers.{i}.mlp.router.weight"),
            Rule(f"{checkpoint}.bias", "layers.{i}.mlp.router.bias"),
            Rule(f"{checkpoint}.e_score_correction_bias", "layers.{i}.mlp.router.correction"))


def latent_rules(attn: str = "model.layers.{i}.self_attn") -> tuple[Rule, ...]:
    rules: list[Rule] = []
    for name, target in (("q_a_proj", "q_a"), ("q_a_layernorm", "q_a_norm"), ("q_b_proj", "q_b"), ("q_proj", "q"),
                         ("kv_a_proj_with_mqa", "kv_a"), ("kv_a_layernorm", "kv_a_norm"), ("kv_b_proj", "kv_b")):
        rules += weight_and_bias(f"{attn}.{name}", f"layers.{{i}}.attn.{target}")
    return tuple(rules)


_MLP = "model.layers.{i}.mlp"
_QWEN = llama_rules(q_norm=None, k_norm=None) + expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
_DEEPSEEK = (llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None) + latent_rules() + expert_rules(_MLP)
             + router_rules(f"{_MLP}.gate") + shared_rules(f"{_MLP}.shared_experts"))
_MLA_BIAS = dict(qkv_bias_keys=("attention_bias",), o_bias_keys=("attention_bias",), mlp_bias_keys=())
V3_ROUTER = MoESpec(scoring="sigmoid", topk_method="noaux_tc", scaling="always", correction_bias=True,
                     shared="deepseek")


def mixtral_rules() -> tuple[Rule, ...]:
    moe = "model.layers.{i}.block_sparse_moe"
    return (llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
            + expert_rules(moe, "w1", "w3", "w2", stacked=_MLP) + router_rules(f"{moe}.gate")
            + router_rules(f"{_MLP}.gate"))


def _granitemoe_rules() -> tuple[Rule, ...]:
    moe = "model.layers.{i}.block_sparse_moe"
    return (llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None)
            + (Rule(f"{moe}.input_linear.weight", Stacked((f"{_EXPERTS}gate", f"{_EXPERTS}up"))),
               Rule(f"{moe}.output_linear.weight", Stacked((f"{_EXPERTS}down",))))
            + expert_rules(moe, stacked=moe) + router_rules(f"{moe}.router.layer") + router_rules(f"{moe}.router"))


def _dbrx_rules() -> tuple[Rule, ...]:
    block = "transformer.blocks.{i}."
    experts = f"{block}ffn.experts.mlp."
    return (
        Rule("transformer.wte.weight", "embed.weight"), Rule("lm_head.weight", "lm_head.weight"),
        Rule(f"{block}norm_attn_norm.norm_1.weight", "layers.{i}.attn_norm.weight"),
        *fused_qkv(f"{block}norm_attn_norm.attn.Wqkv"),
        Rule(f"{block}norm_attn_norm.attn.out_proj.weight", "layers.{i}.attn.o.weight"),
        Rule(f"{block}norm_attn_norm.norm_2.weight", "layers.{i}.mlp_norm.weight"),
        Rule(f"{block}ffn.router.layer.weight", "layers.{i}.mlp.router.weight"),
        Rule(f"{experts}w1", Stacked((f"{_EXPERTS}gate",), flat=True)),
        Rule(f"{experts}v1", Stacked((f"{_EXPERTS}up",), flat=True)),
        Rule(f"{experts}w2", Stacked((f"{_EXPERTS}down",), transposed=True, flat=True)),
        Rule("transformer.norm_f.weight", "final_norm.weight"),
    )


def _gpt_oss_rules() -> tuple[Rule, ...]:
    experts = f"{_MLP}.experts."
    return (llama_rules(q_norm=None, k_norm=None, gate=None, up=None, down=None) + router_rules(f"{_MLP}.router")
            + (Rule("model.layers.{i}.self_attn.sinks", "layers.{i}.attn.sinks.weight"),
               Rule(f"{experts}gate_up_proj", Stacked((f"{_EXPERTS}gate", f"{_EXPERTS}up"), interleaved=True,
                                                      transposed=True)),
               Rule(f"{experts}gate_up_proj_bias", Stacked((f"{_EXPERTS}gate_bias", f"{_EXPERTS}up_bias"),
                                                           interleaved=True)),
               Rule(f"{experts}down_proj", Stacked((f"{_EXPERTS}down",), transposed=True)),
               Rule(f"{experts}down_proj_bias", Stacked((f"{_EXPERTS}down_bias",)))))


MOE_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("mixtral", mixtral_rules(), sliding="all", qkv_bias_keys=(), o_bias_keys=(), mlp_bias_keys=(),
               moe=MoESpec(renormalize=True), parity_reference="MixtralForCausalLM"),
    FamilySpec("qwen2_moe", _QWEN + shared_rules(f"{_MLP}.shared_expert")
               + (Rule(f"{_MLP}.shared_expert_gate.weight", "layers.{i}.mlp.shared_gate.weight"),),
               sliding="max_window_layers", qkv_bias_keys=("qkv_bias",), qkv_bias_default=True, o_bias_keys=(),
               mlp_bias_keys=(), moe=MoESpec(shared="qwen"), parity_reference="Qwen2MoeForCausalLM"),
    FamilySpec("qwen3_moe", llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate"),
               sliding="max_window_layers", qk_norm="head", mlp_bias_keys=(), moe=MoESpec(),
               parity_reference="Qwen3MoeForCausalLM"),
    FamilySpec("olmoe", llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate"), qk_norm="proj",
               mlp_bias_keys=(), moe=MoESpec(), parity_reference="OlmoeForCausalLM"),
    FamilySpec("granitemoe", _granitemoe_rules(), mlp_bias_keys=(), moe=MoESpec(renormalize=True),
               parity_reference="GraniteMoeForCausalLM"),
    FamilySpec("dbrx", _dbrx_rules(), norm_kind="layer", norm_bias=False, qkv_bias_keys=(), o_bias_keys=(),
               mlp_bias_keys=(), nested_configs=("attn_config", "ffn_config"),
               config_defaults={"layer_norm_eps": 1e-5, "moe_normalize_expert_weights": 1.0},
               moe=MoESpec(), parity_reference="DbrxForCausalLM"),
    FamilySpec("deepseek_v2", _DEEPSEEK, latent_attention=True, rope_interleaved=True, **_MLA_BIAS,
               moe=MoESpec(scaling="without_renormalize", shared="deepseek"),
               parity_reference="DeepseekV2ForCausalLM"),
    FamilySpec("deepseek_v3", _DEEPSEEK, latent_attention=True, rope_interleaved=True, **_MLA_BIAS,
               config_defaults={"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                                "first_k_dense_replace": 3, "norm_topk_prob": True},
               moe=V3_ROUTER, parity_reference="DeepseekV3ForCausalLM"),
    FamilySpec("glm4_moe", llama_rules() + expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
               + shared_rules(f"{_MLP}.shared_experts"), qk_norm="head", qk_norm_key="use_qk_norm",
               o_bias_keys=(), mlp_bias_keys=(),
               config_defaults={"first_k_dense_replace": 1, "norm_topk_prob": True}, rotary_share=0.5,
               moe=V3_ROUTER, parity_reference="Glm4MoeForCausalLM"),
    FamilySpec("gpt_oss", _gpt_oss_rules(), attn_sinks=True, mlp_bias_keys=(),
               moe=MoESpec(renormalize=True, router_bias=True, expert_bias=True, activation="clamped_swiglu"),
               parity_reference="GptOssForCausalLM"),
    FamilySpec("minicpm3", llama_rules(q=None, k=None, v=None, q_norm=None, k_norm=None) + latent_rules(),
               latent_attention=True, tied_default=True, **_MLA_BIAS, parity_reference="MiniCPM3ForCausalLM"),
)

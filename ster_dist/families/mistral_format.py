"""Mistral's own checkpoint format (params.json beside consolidated*.safetensors): name maps.

The tensors are Transformers' mistral ones under Mistral's names (tok_embeddings,
layers.{i}.attention.wq, feed_forward.w1 = gate, w3 = up, w2 = down, ffn_norm, norm, output). Their
query and key rows keep Mistral's native order, each head's rotation pairs adjacent, where
Transformers' conversion script permutes them into halves; so, as vLLM does, this spec rotates
adjacent pairs and loads every tensor as stored: no tensor is permuted on the way in, and a rank
reads its heads' rows as they lie.

Adapters name Transformers' modules (q_proj, ...) in Transformers' row order: they are placed
through the family's Transformers spec, and their query and key B rows put in pair order
(`pair_rows`).

Mistral Large 3 (deepseek_v3 in this format, as vLLM's MistralLarge3ForCausalLM reads it): latent
attention under attention.wq_a, q_a_norm, wq_b, wkv_a_with_mqa, kv_a_norm, wkv_b and wo, dense
layers' feed_forward, and experts.{e}.w1/w3/w2 beside gate and shared_experts on sparse ones. Its
router scores by softmax, renormalises the chosen weights and scales them by routed_scaling_factor,
with no correction bias; its queries take Llama 4's temperature. The latent rows are stored as
DeepSeek's are (rotated parts in adjacent pairs), so they too load as stored.
"""

from __future__ import annotations

from ster_dist.families.deepseek import DEEPSEEK_FAMILIES
from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.moe_layouts import expert_rules
from ster_dist.families.spec import AttentionSpec, FamilySpec, MoESpec, PositionSpec, Rule

_MISTRAL_NAMES = llama_rules(
    root="",
    attn="attention",
    q="wq",
    k="wk",
    v="wv",
    o="wo",
    mlp="feed_forward",
    gate="w1",
    up="w3",
    down="w2",
    attn_norm="attention_norm",
    mlp_norm="ffn_norm",
    q_norm=None,
    k_norm=None,
    final_norm="norm",
    embed="tok_embeddings",
    head="output",
)


def _latent_names() -> tuple[Rule, ...]:
    rules = list(
        llama_rules(
            root="",
            attn="attention",
            q=None,
            k=None,
            v=None,
            o="wo",
            mlp="feed_forward",
            gate="w1",
            up="w3",
            down="w2",
            attn_norm="attention_norm",
            mlp_norm="ffn_norm",
            q_norm=None,
            k_norm=None,
            final_norm="norm",
            embed="tok_embeddings",
            head="output",
        )
    )
    for name, target in (
        ("wq_a", "q_a"),
        ("q_a_norm", "q_a_norm"),
        ("wq_b", "q_b"),
        ("wkv_a_with_mqa", "kv_a"),
        ("kv_a_norm", "kv_a_norm"),
        ("wkv_b", "kv_b"),
    ):
        rules += weight_and_bias(f"layers.{{i}}.attention.{name}", f"layers.{{i}}.attn.{target}")
    rules += expert_rules("layers.{i}", gate="w1", up="w3", down="w2")
    rules.append(Rule("layers.{i}.gate.weight", "layers.{i}.mlp.router.weight"))
    rules += (
        Rule(
            f"layers.{{i}}.shared_experts.{name}.weight", f"layers.{{i}}.mlp.shared.{target}.weight"
        )
        for name, target in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
    )
    return tuple(rules)


MISTRAL_FORMAT_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "mistral",
        _MISTRAL_NAMES,
        attention=AttentionSpec(sliding="all"),
        positions=PositionSpec(interleaved=True),
        weight_format="mistral",
        pair_rows=("attn.q", "attn.k"),
    ),
    FamilySpec(
        "deepseek_v3",
        _latent_names(),
        attention=AttentionSpec(latent=True, query_temperature=True),
        positions=PositionSpec(interleaved=True),
        normalize=next(spec for spec in DEEPSEEK_FAMILIES if spec.name == "deepseek_v3").normalize,
        moe=MoESpec(scoring="softmax", renormalize=True, scaling="always", shared="deepseek"),
        weight_format="mistral",
    ),
)

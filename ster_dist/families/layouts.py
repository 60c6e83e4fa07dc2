"""Name maps shared by several families (data, built by small functions).

Internal parameter names are the decoder's own: embed, pos_embed, layers.{i}.
attn_norm / attn.{q,k,v,o} / attn.{q,k}_norm / post_attn_norm / mlp_norm /
mlp.{gate,up,down} / post_mlp_norm, final_norm, lm_head.
"""

from __future__ import annotations

from ster_dist.families.spec import Fused, Rule

# OLMo 2's block as renames for llama_rules: no norm before a sublayer, one over each sublayer's
# output
# (OLMo 2 and 3, FlexOlmo, EXAONE 4)
OLMO2_POST_NORMS = dict(
    attn_norm=None,
    mlp_norm=None,
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
# query, key and value rows grouped by key-value head: each group that head's queries, then its key
# and value.
# With one key-value head this is all queries, then the key and the value (multi-query); with one
# per head it
# is each head's query, key and value in turn (BLOOM, Falcon without multi_query, GPT-BigCode
# without it).
QKV_PER_KV_GROUP = dict(groups="kv_heads", q_count="heads_per_kv", kv_count="one")
# GPT-OSS's learned sink per head, also stored by Granite SWA and GraniteMoE SWA
ATTENTION_SINKS = Rule("model.layers.{i}.self_attn.sinks", "layers.{i}.attn.sinks.weight")


def weight_and_bias(checkpoint: str, target: str, transposed: bool = False) -> tuple[Rule, ...]:
    """A module with .weight and .bias (the bias is loaded only when the config turns it on)."""
    return (
        Rule(f"{checkpoint}.weight", f"{target}.weight", transposed),
        Rule(f"{checkpoint}.bias", f"{target}.bias"),
    )


def llama_rules(
    root: str = "model.",
    attn: str = "self_attn",
    q: str | None = "q_proj",
    k: str | None = "k_proj",
    v: str | None = "v_proj",
    o: str = "o_proj",
    gate: str | None = "gate_proj",
    up: str | None = "up_proj",
    down: str = "down_proj",
    mlp: str = "mlp",
    attn_norm: str = "input_layernorm",
    mlp_norm: str | None = "post_attention_layernorm",
    post_attn_norm: str | None = None,
    post_mlp_norm: str | None = None,
    q_norm: str | None = "q_norm",
    k_norm: str | None = "k_norm",
    final_norm: str = "norm",
    embed: str = "embed_tokens",
    head: str = "lm_head",
) -> tuple[Rule, ...]:
    """Llama's layout; each argument renames one module, None drops it."""
    layer = f"{root}layers.{{i}}."
    rules: list[Rule] = [
        Rule(f"{root}{embed}.weight", "embed.weight"),
        *weight_and_bias(head, "lm_head"),
    ]
    rules += weight_and_bias(f"{root}{final_norm}", "final_norm")
    for name, target in ((q, "q"), (k, "k"), (v, "v"), (o, "o")):
        if name:
            rules += weight_and_bias(f"{layer}{attn}.{name}", f"layers.{{i}}.attn.{target}")
    for name, target in ((gate, "gate"), (up, "up"), (down, "down")):
        if name:
            rules += weight_and_bias(f"{layer}{mlp}.{name}", f"layers.{{i}}.mlp.{target}")
    for name, target in (
        (attn_norm, "attn_norm"),
        (mlp_norm, "mlp_norm"),
        (post_attn_norm, "post_attn_norm"),
        (post_mlp_norm, "post_mlp_norm"),
    ):
        if name:
            rules += weight_and_bias(f"{layer}{name}", f"layers.{{i}}.{target}")
    for name, target in ((q_norm, "q_norm"), (k_norm, "k_norm")):
        if name:
            rules += weight_and_bias(f"{layer}{attn}.{name}", f"layers.{{i}}.attn.{target}")
    return tuple(rules)


def fused_qkv(
    checkpoint: str,
    groups: str = "one",
    q_count: str = "heads",
    kv_count: str = "kv_heads",
    transposed: bool = False,
) -> tuple[Rule, ...]:
    """One tensor (and its bias) holding query, key and value rows in `groups` repetitions."""
    layout = Fused(
        (
            ("layers.{i}.attn.q.weight", q_count),
            ("layers.{i}.attn.k.weight", kv_count),
            ("layers.{i}.attn.v.weight", kv_count),
        ),
        groups=groups,
    )
    bias = Fused(tuple((p.replace(".weight", ".bias"), c) for p, c in layout.parts), groups=groups)
    return (Rule(f"{checkpoint}.weight", layout, transposed), Rule(f"{checkpoint}.bias", bias))


def fused_gate_up(checkpoint: str) -> tuple[Rule, ...]:
    layout = Fused(
        (
            ("layers.{i}.mlp.gate.weight", "intermediate"),
            ("layers.{i}.mlp.up.weight", "intermediate"),
        ),
        unit="one",
    )
    return (Rule(f"{checkpoint}.weight", layout),)


def gpt2_rules(transposed: bool, **qkv_layout) -> tuple[Rule, ...]:
    """GPT-2's layout below transformer.h (learned positions, fused c_attn, c_fc/c_proj), stored
    inputs-first as Conv1D (GPT-2) or as plain linears (GPT-BigCode, whose c_attn groups each
    key-value head's queries with it)."""
    h = "transformer.h.{i}."
    return (
        Rule("transformer.wte.weight", "embed.weight"),
        Rule("transformer.wpe.weight", "pos_embed.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
        *weight_and_bias(f"{h}ln_1", "layers.{i}.attn_norm"),
        *fused_qkv(f"{h}attn.c_attn", transposed=transposed, **qkv_layout),
        *weight_and_bias(f"{h}attn.c_proj", "layers.{i}.attn.o", transposed=transposed),
        *weight_and_bias(f"{h}ln_2", "layers.{i}.mlp_norm"),
        *weight_and_bias(f"{h}mlp.c_fc", "layers.{i}.mlp.up", transposed=transposed),
        *weight_and_bias(f"{h}mlp.c_proj", "layers.{i}.mlp.down", transposed=transposed),
        *weight_and_bias("transformer.ln_f", "final_norm"),
    )

"""Looped models: families whose stored layers run on several passes (model/loop.py), as data.

- hrm_text: HRM-Text's two stacks of Llama layers, model.L_module.layers (low) and
  model.H_module.layers (high), num_layers_per_stack each (else num_hidden_layers). Each layer's
  attn.gqkv_proj holds the attention gate's rows, then the query's, key's and value's (every head
  attending: no grouped keys); the gate's sigmoid multiplies attention's output before attn.o_proj,
  the feed-forward is one mlp.gate_up_proj, and every norm is an RMS norm without a scale. The
  stacks run H_cycles times as L_cycles passes of the low stack and one of the
  high:
  the high state starts as the embedding times embedding_scale (else 1 / initializer_range), the low
  state as model.z_L_init; a pass reads both states summed, ends in its stack's norm (the final
  norm, scale-free like it) and replaces its own state; the last high state is what the head reads.
  Every pass is its own run of layers with its own cache slots and hook sites, num_layers_per_stack
  x H_cycles x (L_cycles + 1) in all.

- iquestloopcoder: IQuest-LoopCoder, Llama's block (IQuest-Coder's defaults) whose num_hidden_layers
  stored layers run loop_num times (default 2), with no norm between passes. On every later pass a
  layer's attention (model/loop_attention.py) is g * global + (1 - g) * local: global over the first
  pass's keys and values of the same layer, local over its own pass's within loop_window_size
  (default 64) positions, g = sigmoid(w_h . q_h + b_h) per head of the rotated query, w and b from
  model.gate_projections.{layer}.

- nanbeige: Llama with per-head q_layernorm and k_layernorm under qk_layernorm, a looped model whose
  stored layers run num_loops times (num_hidden_layers counts every pass's), the final norm closing
  every pass unless skip_loop_final_norm.

hrm_text's reference is Transformers' HrmTextForCausalLM (tests/tiny/looped.py,
tests/families/test_looped.py); iquestloopcoder, which Transformers lacks, is checked against the
reference tests/families/test_looped.py writes from the seed's text, nanbeige against the one
tests/families/test_telechat_mimo_pangu_nanbeige.py writes.
"""

from __future__ import annotations

from ster_dist.families.layouts import llama_rules, weight_and_bias
from ster_dist.families.normalize import ConfigProblem, stated, switch, with_defaults
from ster_dist.families.spec import AttentionSpec, FamilySpec, Fused, NormSpec, QKNormSpec, Rule

_STACKS = (("L_module", 0), ("H_module", 1))
# the states: the high one (0) starts as the embedding, the low one (1) as z_L_init
_LOW, _HIGH = 1, 0

_HRM_DEFAULTS = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    head_dim=128,
    H_cycles=2,
    L_cycles=3,
    initializer_range=0.02,
    tie_word_embeddings=False,
    prefix_lm=True,
    attention_bias=False,
    mlp_bias=False,
    max_position_embeddings=2048,
)


def _hrm_stack_rules(name: str, stack: int) -> tuple[Rule, ...]:
    src, dst = f"model.{name}.layers.{{i}}.", f"stacks.{stack}.{{i}}."
    attn = tuple(
        (f"{dst}attn.{part}.%s", count)
        for part, count in (("gate", "heads"), ("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads"))
    )
    return (
        Rule(f"{src}attn.gqkv_proj.weight", Fused(tuple((p % "weight", c) for p, c in attn))),
        Rule(f"{src}attn.gqkv_proj.bias", Fused(tuple((p % "bias", c) for p, c in attn))),
        Rule(f"{src}attn.o_proj.weight", f"{dst}attn.o.weight"),
        Rule(f"{src}attn.o_proj.bias", f"{dst}attn.o.bias"),
        Rule(
            f"{src}mlp.gate_up_proj.weight",
            Fused(
                (
                    (f"{dst}mlp.gate.weight", "intermediate"),
                    (f"{dst}mlp.up.weight", "intermediate"),
                ),
                unit="one",
            ),
        ),
        Rule(
            f"{src}mlp.gate_up_proj.bias",
            Fused(
                ((f"{dst}mlp.gate.bias", "intermediate"), (f"{dst}mlp.up.bias", "intermediate")),
                unit="one",
            ),
        ),
        Rule(f"{src}mlp.down_proj.weight", f"{dst}mlp.down.weight"),
        Rule(f"{src}mlp.down_proj.bias", f"{dst}mlp.down.bias"),
    )


_HRM = (
    Rule("model.embed_tokens.weight", "embed.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
    Rule("model.z_L_init", "loop_init.weight"),
    *(rule for name, stack in _STACKS for rule in _hrm_stack_rules(name, stack)),
)


def _count(raw: dict, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigProblem(
            f"{key} is {value!r}; state how many times the stack runs, a whole number from 1"
        )
    return value


def _hrm_text(raw: dict) -> dict:
    """The two stacks' passes as the generic loop keys; every head its own keys; the output gate;
    the embedding scale."""
    out = with_defaults(raw, _HRM_DEFAULTS)
    high, low = _count(out, "H_cycles"), _count(out, "L_cycles")
    per_stack = stated(out, "num_layers_per_stack", "num_hidden_layers")
    if isinstance(per_stack, bool) or not isinstance(per_stack, int) or per_stack < 1:
        raise ConfigProblem(
            f"num_layers_per_stack is {per_stack!r}; state each stack's layer count"
        )
    scale = stated(out, "embedding_scale")
    if scale is None:
        if not out["initializer_range"]:
            raise ConfigProblem(
                "embedding_scale is unstated and initializer_range is 0; state embedding_scale"
            )
        scale = 1.0 / out["initializer_range"]
    low_pass, high_pass = (0, _LOW, (_LOW, _HIGH)), (1, _HIGH, (_HIGH, _LOW))
    schedule = ([low_pass] * low + [high_pass]) * high
    return {
        **out,
        "num_hidden_layers": per_stack * len(schedule),
        "loop_layers": per_stack,
        "loop_schedule": schedule,
        "loop_pass_norm": True,
        "num_key_value_heads": out["num_attention_heads"],
        "attn_output_gate": True,
        "embedding_multiplier": float(scale),
        "attention_out_bias": out["attention_bias"],
        "bidirectional_prompt": bool(out["prefix_lm"]),
    }


_LOOPCODER_DEFAULTS = dict(
    head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-5, loop_num=2, loop_window_size=64
)
_LOOPCODER = llama_rules(q_norm=None, k_norm=None) + weight_and_bias(
    "model.gate_projections.{i}", "layers.{i}.attn.loop_gate"
)


def _loopcoder(raw: dict) -> dict:
    """loop_num passes over the stored layers, the later passes' local reads within loop_window_size
    (their layers' sliding window)."""
    out = with_defaults(raw, _LOOPCODER_DEFAULTS)
    loops, stored, window = out["loop_num"], out.get("num_hidden_layers"), out["loop_window_size"]
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise ConfigProblem(
            f"loop_num is {loops!r}; state how many times the layers run, a whole number from 1"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigProblem(
            f"loop_window_size is {window!r}; state the later passes' local window, a whole "
            "number of positions from 1"
        )
    if loops == 1 or isinstance(stored, bool) or not isinstance(stored, int):
        return out  # not looped, or a layer count the shared reader refuses
    return {
        **out,
        "num_hidden_layers": stored * loops,
        "loop_layers": stored,
        "sliding_window": window,
        "layer_types": ["full_attention"] * stored + ["sliding_attention"] * (stored * (loops - 1)),
    }


def _loopcoder_layers(raw: dict, layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return ("loop_attention" if raw.get("loop_layers") else "attention",) * layers, (
        "dense",
    ) * layers


def _nanbeige(raw: dict) -> dict:
    """qk_layernorm as the generic query/key-norm switch; num_loops passes over the stored
    layers."""
    out = {**raw, "use_qk_norm": switch(raw, "qk_layernorm")}
    loops, stored = stated(raw, "num_loops", default=1), raw.get("num_hidden_layers")
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise ConfigProblem(
            f"num_loops is {loops!r}; state how many times the layers run, a whole number from 1"
        )
    if loops == 1 or isinstance(stored, bool) or not isinstance(stored, int):
        return out  # not looped, or a layer count the shared reader refuses
    return {
        **out,
        "num_hidden_layers": stored * loops,
        "loop_layers": stored,
        "loop_pass_norm": not switch(raw, "skip_loop_final_norm"),
    }


LOOPED_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        "hrm_text",
        _HRM,
        norms=NormSpec(affine=False),
        normalize=_hrm_text,
        parity_reference="HrmTextForCausalLM",
    ),
    FamilySpec(
        "iquestloopcoder",
        _LOOPCODER,
        normalize=_loopcoder,
        layer_kinds=_loopcoder_layers,
        parity_reference="tests/families/test_looped.py",
    ),
    FamilySpec(
        "nanbeige",
        llama_rules(q_norm="q_layernorm", k_norm="k_layernorm"),
        attention=AttentionSpec(qk_norm=QKNormSpec("head")),
        normalize=_nanbeige,
        parity_reference="tests/families/test_telechat_mimo_pangu_nanbeige.py",
    ),
)

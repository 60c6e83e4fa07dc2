"""AllenAI's OLMo families, dense and sparse.

- olmo (OLMo 1): LayerNorms with neither scale nor bias at Transformers' fixed epsilon; clip_qkv
  clamps q, k, v.
- olmo2: no norm before a sublayer, one over each sublayer's output, a norm over the whole query and
  key projections.
- olmo3: OLMo 2 with sliding-window layers (every fourth layer full when layer_types is unstated), a
  top-level rope_scaling kept off the sliding layers as Olmo3Config does.
- olmoe: Llama's pre-norm block with whole-projection query/key norms, over unrenormalised softmax
  experts.
- flex_olmo: OLMo 2's post-norm block over OLMoE's experts.
- olmo_hybrid: Gated DeltaNet (model/gated_delta.py) on the layers layer_types calls
  linear_attention (each fourth from the fourth attending when it lists none) in a pre-norm block
  (input_layernorm, then post_attention_layernorm before the feed-forward, or OLMo-core's
  attention_layer_norm and feedforward_layer_norm); separate q/k/v_proj through OLMo-core's
  q/k/v_conv1d, as Transformers saves them (or Transformers' joined conv1d, split back into the
  three), g_proj the SiLU gate, write strength doubled under linear_allow_neg_eigval, o_norm at
  epsilon 1e-5. Its other layers are OLMo 3's post-norm attention, unrotated when rope_parameters
  states rope_theta null (Transformers rotates at 10000 when it states none).
  post_attention_layernorm is a post-norm in attention layers and a pre-norm in the others: the
  loader takes the rule whose parameter the layer has (shard/plan.py).
"""

from __future__ import annotations

from ster_dist.families.layouts import OLMO2_POST_NORMS, llama_rules
from ster_dist.families.moe_layouts import expert_rules, router_rules
from ster_dist.errors import Refusal
from ster_dist.families.normalize import defaults
from ster_dist.families.spec import (
    Fused,
    AttentionSpec,
    FamilySpec,
    MoESpec,
    NormSpec,
    PositionSpec,
    QKNormSpec,
    Rule,
)

_MLP = "model.layers.{i}.mlp"
_EXPERTS = expert_rules(_MLP) + router_rules(f"{_MLP}.gate")
# OLMo 2's block: no norm before a sublayer, one over each sublayer's output, whole-projection
# query/key norms
_POST_NORMS = NormSpec(pre=False, post=True)
_PROJ_QK_NORMS = AttentionSpec(qk_norm=QKNormSpec("proj"))

_LINEAR, _MIXER = "model.layers.{i}.linear_attn", "layers.{i}.mixer"
# OLMo Hybrid: OLMo 3's attention layers, and the linear ones' pre-norms and Gated DeltaNet
_HYBRID = (
    llama_rules(**OLMO2_POST_NORMS)
    + tuple(
        Rule(f"model.layers.{{i}}.{name}.weight", f"layers.{{i}}.{target}.weight")
        for name, target in (
            ("input_layernorm", "attn_norm"),
            ("post_attention_layernorm", "mlp_norm"),
            ("attention_layer_norm", "attn_norm"),
            ("feedforward_layer_norm", "mlp_norm"),
            # Transformers saves an attention layer's
            # post_attention_layernorm so too
            ("feedforward_layer_norm", "post_attn_norm"),
        )
    )
    + tuple(
        Rule(f"{_LINEAR}.{name}", f"{_MIXER}.{target}")
        for name, target in (
            ("q_proj.weight", "q.weight"),
            ("k_proj.weight", "k.weight"),
            ("v_proj.weight", "v.weight"),
            ("g_proj.weight", "z.weight"),
            ("a_proj.weight", "a.weight"),
            ("b_proj.weight", "b.weight"),
            ("q_conv1d.weight", "q_conv"),
            ("k_conv1d.weight", "k_conv"),
            ("v_conv1d.weight", "v_conv"),
            ("A_log", "A_log"),
            ("dt_bias", "dt_bias"),
            ("o_norm.weight", "norm_weight"),
            ("o_proj.weight", "out.weight"),
        )
    )
    # Transformers' own layout joins the three convolutions into one, queries then keys then
    # values
    + (
        Rule(
            f"{_LINEAR}.conv1d.weight",
            Fused(
                (
                    (f"{_MIXER}.q_conv", "linear_key_dim"),
                    (f"{_MIXER}.k_conv", "linear_key_dim"),
                    (f"{_MIXER}.v_conv", "linear_value_dim"),
                ),
                unit="one",
            ),
        ),
    )
)
_HYBRID_MIXERS = {"linear_attention": "gated_delta", "full_attention": "attention"}


def _hybrid_types(raw: dict, num_layers: int) -> list[str]:
    types = raw.get("layer_types")
    if types is None:  # Transformers' default: each fourth layer attends, the last where none would
        types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
        if "full_attention" not in types:
            types[-1] = "full_attention"
    unknown = sorted({str(t) for t in types} - set(_HYBRID_MIXERS))
    if unknown:
        raise Refusal(
            f"invalid model config: layer type {unknown[0]!r} is not supported for olmo_hybrid; its "
            "layer_types lists linear_attention and full_attention only"
        )
    return list(types)


def _hybrid_normalize(raw: dict) -> dict:
    """Transformers' defaults for OLMo Hybrid: the linear layers' sizes from the attention's,
    negative eigenvalues allowed, o_norm's fixed epsilon, pre-norm linear layers, and no rotation
    where rope_parameters states rope_theta null."""
    out = dict(raw)
    heads, hidden, layers = (
        out.get("num_attention_heads"),
        out.get("hidden_size"),
        out.get("num_hidden_layers"),
    )
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        if out.get(key) is None:
            out[key] = heads
    if (
        out.get("linear_key_head_dim") is None
        and isinstance(hidden, int)
        and isinstance(out.get("linear_num_key_heads"), int)
        and out["linear_num_key_heads"] > 0
    ):
        out["linear_key_head_dim"] = int(0.75 * hidden / out["linear_num_key_heads"])
    if out.get("linear_value_head_dim") is None and isinstance(out.get("linear_key_head_dim"), int):
        out["linear_value_head_dim"] = 2 * out["linear_key_head_dim"]
    out.setdefault("linear_conv_kernel_dim", 4)
    if out.get("linear_allow_neg_eigval") is None:
        out["linear_allow_neg_eigval"] = True
    out["linear_norm_eps"], out["recurrent_pre_norm"], out["linear_separate_convs"] = (
        1e-5,
        True,
        True,
    )
    if isinstance(layers, int) and layers > 0:
        out["layer_types"] = _hybrid_types(out, layers)
        rope = out.get("rope_parameters")
        # Transformers fills rope_theta 10000 into an unstated rotation; only a stated null turns it
        # off
        if isinstance(rope, dict) and "rope_theta" in rope and rope["rope_theta"] is None:
            out["no_rope_layers"] = [0] * layers
    return out


def _hybrid_kinds(raw: dict, num_layers: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(_HYBRID_MIXERS[t] for t in _hybrid_types(raw, num_layers)), ("dense",) * num_layers


OLMO_FAMILIES: tuple[FamilySpec, ...] = (
    # OLMo 1: LayerNorms with neither scale nor bias at Transformers' fixed epsilon; clip_qkv clamps
    # q, k, v
    FamilySpec(
        "olmo",
        llama_rules(attn_norm=None, mlp_norm=None, q_norm=None, k_norm=None),
        norms=NormSpec(kind="layer", affine=False, eps=1e-5),
        parity_reference="OlmoForCausalLM",
    ),
    FamilySpec(
        "olmo2",
        llama_rules(**OLMO2_POST_NORMS),
        norms=_POST_NORMS,
        attention=_PROJ_QK_NORMS,
        parity_reference="Olmo2ForCausalLM",
    ),
    # OLMo 3: OLMo 2 with sliding-window layers (every fourth layer full when layer_types is
    # unstated)
    FamilySpec(
        "olmo3",
        llama_rules(**OLMO2_POST_NORMS),
        norms=_POST_NORMS,
        attention=AttentionSpec(qk_norm=QKNormSpec("proj"), sliding="pattern"),
        positions=PositionSpec(local_unscaled=True, theta=500_000.0),
        normalize=defaults({"sliding_window": 4096, "sliding_window_pattern": 4}),
        parity_reference="Olmo3ForCausalLM",
    ),
    FamilySpec(
        "olmoe",
        llama_rules() + _EXPERTS,
        attention=_PROJ_QK_NORMS,
        moe=MoESpec(),
        parity_reference="OlmoeForCausalLM",
    ),
    FamilySpec(
        "flex_olmo",
        llama_rules(**OLMO2_POST_NORMS, gate=None, up=None, down=None) + _EXPERTS,
        norms=_POST_NORMS,
        attention=_PROJ_QK_NORMS,
        moe=MoESpec(),
        parity_reference="FlexOlmoForCausalLM",
    ),
    FamilySpec(
        "olmo_hybrid",
        _HYBRID,
        norms=_POST_NORMS,
        attention=_PROJ_QK_NORMS,
        parity_reference="OlmoHybridForCausalLM",
        normalize=_hybrid_normalize,
        layer_kinds=_hybrid_kinds,
    ),
)

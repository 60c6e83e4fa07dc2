"""FamilySpec: what one family adds to the shared decoder, as data.

A spec holds the family's conventions (norm kind, block layout, which config
keys switch biases or query/key norms on, how rotation is laid out) and its
checkpoint name map. The map is two-way: the loader reads checkpoint tensors
into decoder parameters through it, and the merge writer walks it backwards.

Name templates use {i} for the layer, {h} for an index stacked along the
parameter's first dimension (per-head norms) and {e} for an expert: a tensor
named per expert fills that expert's row of a stacked [experts, ...]
parameter, and only the rank holding that expert reads it. `Stacked` describes
checkpoint tensors that hold every expert at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Fused:
    """A checkpoint tensor whose rows hold several parameters.

    The rows are `groups` repetitions of the parts in order, each part holding
    `count` units of `unit` rows. Counts and groups are size names resolved
    against the config ("heads", "kv_heads", "heads_per_kv", "intermediate",
    "one"); unit is "head_dim" or "one". This one shape covers Phi-3's qkv_proj
    (one group: all queries, then keys, then values), GPT-NeoX's head-by-head
    query_key_value (a group per head), InternLM2/Falcon's per-KV-group layouts
    and gate_up_proj (unit one).
    """

    parts: tuple[tuple[str, str], ...]  # (parameter template, count name)
    groups: str = "one"
    unit: str = "head_dim"


@dataclass(frozen=True)
class Stacked:
    """A checkpoint tensor holding every expert's matrix (or bias) for one or more stacked parameters.

    Each target parameter is [experts, P, Q] (output rows P, input columns Q) or
    [experts, P] for a bias. The stored tensor is [experts, P * len(parts), Q]:
    the parts' rows one block after another, or alternating row by row when
    `interleaved` (GPT-OSS's gate_up). `transposed`: each expert's matrix is
    stored inputs-first, [experts, Q, P * parts] (GPT-OSS, DBRX's w2). `flat`:
    the expert dimension is merged into the next one (DBRX's [experts * rows, cols]).
    """

    parts: tuple[str, ...]  # parameter templates, in stored order
    interleaved: bool = False
    transposed: bool = False
    flat: bool = False


@dataclass(frozen=True)
class MoESpec:
    """How a mixture-of-experts family routes and computes, beyond what its config states."""

    scoring: str = "softmax"              # "softmax" | "sigmoid" (config scoring_func wins)
    topk_method: str = "greedy"           # "greedy" | "group_limited_greedy" | "noaux_tc" (config topk_method wins)
    renormalize: bool | None = None       # None: norm_topk_prob decides; True: always (Mixtral, GraniteMoE)
    scaling: str = "never"                # routed_scaling_factor: "never" | "always" | "without_renormalize"
    router_bias: bool = False             # a bias on the router's logits (GPT-OSS)
    correction_bias: bool = False         # e_score_correction_bias, added only to choose (DeepSeek-V3)
    shared: str = "none"                  # "none" | "deepseek" (n_shared_experts wide) | "qwen" (sigmoid-gated)
    #                                       | "stated" (shared_intermediate_size wide: GraniteMoE shared)
    #                                       | "dense_width" (num_shared_expert x intermediate_size: HunYuan)
    expert_bias: bool = False             # biased expert projections (GPT-OSS)
    activation: str = "glu"               # "glu": act(gate) * up | "clamped_swiglu": GPT-OSS's
    scoring_keys: tuple[str, ...] = ("scoring_func",)  # config keys naming the scoring (Cohere 2 MoE's own)
    # softmax over the chosen experts' logits: softmax scores are always renormalised, sigmoid ones under
    # norm_topk_prob (Cohere 2 MoE)
    softmax_renormalized: bool = False
    # config key whose value "average" halves the sum of the routed and shared experts ("sum" keeps it: Cohere 2 MoE)
    shared_combination_key: str | None = None
    # SparseMixer as Transformers runs it outside training: two rounds, each taking the best logit not yet chosen,
    # weighed by its softmax over the experts within 2 * router_jitter_noise of it (PhiMoE)
    sparsemixer: bool = False


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor template and where its data goes."""

    checkpoint: str
    target: str | Fused | Stacked
    transposed: bool = False  # stored inputs-first (GPT-2's Conv1D)

    @property
    def pattern(self) -> re.Pattern:
        return _compile(self.checkpoint)


def _compile(template: str) -> re.Pattern:
    escaped = (re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{h\}", r"(?P<h>\d+)")
               .replace(r"\{e\}", r"(?P<e>\d+)"))
    return re.compile(escaped + r"$")


@dataclass(frozen=True)
class FamilySpec:
    name: str
    rules: tuple[Rule, ...]
    # where the family's root prefix may be missing (GPT-2's h.0... beside transformer.h.0...)
    optional_prefix: str = ""
    ignore: tuple[str, ...] = ()          # regexes of checkpoint tensors that carry no weights (buffers)
    # conventions
    norm_kind: str = "rms"
    norm_bias: bool = False
    norm_offset: float = 0.0
    norm_affine: bool = True              # False: norms with neither scale nor bias (OLMo 1)
    norm_eps: float | None = None         # an epsilon Transformers fixes whatever the config states (OLMo 1)
    pre_norm: bool = True
    post_norm: bool = False
    post_norm_key: str | None = None      # config key that turns the post norms on (HyperCLOVA X's use_post_norm)
    parallel_block: bool = False
    parallel_key: str | None = None       # config key that turns the parallel block on
    parallel_shared_norm: bool = True
    positions: str = "rope"               # "rope" | "learned" | "none" | "alibi"
    position_offset: int = 0
    rope_interleaved: bool = False
    rotary_share: float = 1.0             # share of each head rotated when the config states none
    default_rope_theta: float = 10000.0
    default_local_rope_theta: float | None = None  # sliding layers' base when rope_local_base_freq is unstated
    # a top-level rope_scaling applies to full-attention layers only; sliding ones rotate plainly at rope_theta (OLMo 3)
    local_rope_unscaled: bool = False
    sliding: str = "none"                 # "none" | "all" | "max_window_layers" | "even" | "pattern"
    #                                       | "pattern_first" (full attention on the first of each pattern: Granite SWA)
    # "all": every layer rotates; "sliding": where the config states a sliding_window, only sliding-window
    # layers rotate and full-attention ones apply no rotation (Cohere 2, EXAONE 4)
    rope_layers: str = "all"
    embed_scale_sqrt: bool = False
    activation: str | None = None         # fixed activation overriding the config's
    mlp_gated: bool = True
    # config keys that switch biases on (first stated wins), and the value when none is stated
    qkv_bias_keys: tuple[str, ...] = ("attention_bias",)
    qkv_bias_default: bool = False
    o_bias_keys: tuple[str, ...] = ("attention_bias",)
    o_bias_default: bool = False
    mlp_bias_keys: tuple[str, ...] = ("mlp_bias",)
    mlp_bias_default: bool = False
    qk_norm: str = "none"                 # "none" | "head" | "proj"
    qk_norm_key: str | None = None        # config key that turns the query/key norms on
    qk_norm_kind: str = "rms"
    qk_norm_per_head_weight: bool = False
    qk_norm_bias: bool = False
    qk_norm_after_rope: bool = False      # per-head query/key norms applied after the rotation (HunYuan)
    # Llama 4's query temperature: queries times 1 + beta * ln(1 + floor(position / length)), beta and length
    # read from the rotation's llama_4_scaling_beta and original_max_position_embeddings (Ministral 3)
    query_temperature: bool = False
    tied_default: bool = False
    lm_head_bias: bool = False
    lm_head_bias_keys: tuple[str, ...] = ()  # config keys that turn the head's bias on (ERNIE 4.5 MoE's use_bias)
    logits_scaling_multiplies: bool = False  # logits_scaling multiplies the logits rather than dividing (HyperCLOVA X)
    config_defaults: dict = field(default_factory=dict)
    refuse_keys: dict = field(default_factory=dict)  # config key -> why it is refused when truthy
    parity_reference: str | None = None   # the Transformers CausalLM class the parity tests compare with
    moe: MoESpec | None = None            # a mixture-of-experts family: its routing conventions
    latent_attention: bool = False        # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3)
    attn_sinks: bool = False              # a learned sink logit per head (GPT-OSS)
    nested_configs: tuple[str, ...] = ()  # config sub-objects read beside the top-level keys (DBRX)
    # The checkpoint format whose names `rules` reads: "safetensors" (Transformers') or "mistral" (Mistral's
    # own consolidated files). Adapters always name Transformers' modules, so a map of another format
    # places them through the family's Transformers spec.
    weight_format: str = "safetensors"
    # Projections (decoder names after "layers.{i}.") whose rows within each head are stored as adjacent
    # rotation pairs where Transformers' checkpoints store halves: an adapter's B rows, made on Transformers'
    # order, are put in pair order before they touch these weights.
    pair_rows: tuple[str, ...] = ()
    # config key whose stated value makes the block and final norms RMS norms, else `norm_kind` (Cohere 2 MoE's
    # rms_norm_eps beside bias-free LayerNorms)
    rms_norm_key: str | None = None
    # under rope_layers "sliding", layers with a dense feed-forward rotate too when this config key is 1
    # (Cohere 2 MoE's prefix_dense_sliding_window_pattern)
    dense_rope_key: str | None = None
    # config keys stating the dense feed-forward's width where intermediate_size is the experts' (Cohere 2 MoE)
    dense_intermediate_keys: tuple[str, ...] = ()
    # ALiBi (positions "alibi", or alibi_key truthy in the config): each head adds its slope times the key's
    # absolute position to the scores, in place of the family's positions (Falcon's alibi, MPT's attn_config.alibi)
    alibi_key: str | None = None
    alibi_before_scale: bool = False      # the bias is added before the scores are scaled by 1/sqrt(head_dim) (Falcon)
    alibi_bf16: bool = False              # slopes and bias rounded to bf16, as Falcon builds them
    embed_norm: bool = False              # a norm right after the token embedding (BLOOM's word_embeddings_layernorm)
    # a config key under which the stated key-value head count applies; without it a multi_query config has one
    # key-value head and any other every head (Falcon's new_decoder_architecture)
    grouped_kv_key: str | None = None
    # a config key that gives each half of a parallel block its own norm unless num_ln_in_parallel_attn is 1
    # (Falcon's new_decoder_architecture)
    parallel_norms_key: str | None = None
    require_values: dict = field(default_factory=dict)  # config key -> (the one supported value, why), when stated
    width_keys: tuple[str, ...] = ()      # config keys that must equal the model width when stated (OPT)
    # The family's config normalisation: its text config (after the gate) -> the same dict with the keys the
    # shared reader knows filled in (its own names for sizes, its defaults). Runs before anything is read.
    normalize: Callable[[dict], dict] | None = None
    # The kind of each layer's token mixer and feed-forward (model/kinds.py), from the normalised config and
    # the layer count: (mixers, feed_forwards), a name per layer each. None: attention and the dense (or
    # moe_layers') feed-forward everywhere. May raise Refusal for a pattern it cannot read.
    layer_kinds: Callable[[dict, int], tuple[tuple[str, ...], tuple[str, ...]]] | None = None

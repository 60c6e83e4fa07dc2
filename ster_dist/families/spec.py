"""FamilySpec: what one family adds to the shared decoder, as data.

A spec holds the family's conventions, nested by what they shape (attention,
feed-forward, norms and block layout, positions, embedding and head, experts),
each sub-spec defaulting to the common case (Llama's), its config normalisation
(`normalize`: the family's own key names and Transformers' class defaults put
into the generic keys config.from_hf reads, listed in families/normalize.py),
and its checkpoint name map. The map is two-way: the loader reads checkpoint
tensors into decoder parameters through it, and the merge writer walks it
backwards.

Name templates use {i} for the layer, {s} for a numbered submodule carried into the target's name as
is (Zamba2's adapter slots), {h} for an index stacked along the parameter's first dimension
(per-head norms), {half} for one of the two decoder layers a stored layer holds
(FamilySpec.halved_layers) and {e} for an expert: a tensor named per expert fills that expert's row
of a stacked [experts, ...] parameter, and only the rank holding that expert reads it. `Stacked`
describes checkpoint tensors that hold every expert at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field


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
    """A checkpoint tensor holding every expert's matrix (or bias) for one or more stacked
    parameters.

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
class QKNormSpec:
    """Norms over the queries and keys before attention."""

    # "head": over each head | "proj": over the whole projection
    scope: str = "head"
    kind: str = "rms"  # "rms" | "layer"
    # a separate scale per head ([heads, head_dim]: Cohere, StableLM)
    per_head_weight: bool = False
    bias: bool = False
    after_rope: bool = False  # applied after the rotation rather than before (HunYuan)
    # False: no scale, a plain L2 (RMS) norm (Llama 4, Muse Glimmer)
    affine: bool = True


@dataclass(frozen=True)
class AttentionSpec:
    """The family's attention beyond its sizes. Biases are config keys (attention_bias,
    attention_out_bias)."""

    # None: no query/key norms; the generic key use_qk_norm (true unless stated) turns stated ones
    # off
    qk_norm: QKNormSpec | None = None
    # which layers slide when layer_types is unstated: "none" | "all"
    sliding: str = "none"
    #                                       | "max_window_layers" | "even" | "pattern"
    # | "pattern_first" (full attention on the first of each pattern: Granite SWA)
    latent: bool = False  # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3)
    sinks: bool = False  # a learned sink logit per head (GPT-OSS)
    # Llama 4's query temperature: queries times 1 + beta * ln(1 + floor(position / length)), beta
    # and length
    # read from the rotation's llama_4_scaling_beta and original_max_position_embeddings (Ministral
    # 3)
    query_temperature: bool = False


@dataclass(frozen=True)
class FeedForwardSpec:
    """The dense feed-forward. Its bias is the config key mlp_bias; experts are MoESpec."""

    gated: bool = True  # act(gate) * up; False: down(act(up(x)))
    # an activation Transformers fixes whatever the config states
    activation: str | None = None


@dataclass(frozen=True)
class NormSpec:
    """The block and final norms, and where the block places them: before or over each sublayer, or
    before a parallel block."""

    # "rms" | "layer" (the generic key norm_kind, when stated, wins)
    kind: str = "rms"
    bias: bool = False
    offset: float = 0.0  # 1.0 where the stored scale is an offset from one (Gemma)
    # the norms over attention's and the feed-forward's outputs where their offsets differ from
    # `offset`
    # (PLaMo 3: 1/5 and 5^-1.5)
    post_offsets: tuple[float, float] | None = None
    affine: bool = True  # False: norms with neither scale nor bias (OLMo 1)
    # RMS norms apply their scale in f32 before casting back (Gemma 3n)
    scale_f32: bool = False
    # an epsilon Transformers fixes whatever the config states (OLMo 1)
    eps: float | None = None
    pre: bool = True  # a norm before each sublayer
    # a norm over each sublayer's output (the generic key use_post_norm wins)
    post: bool = False
    embed: bool = False  # a norm right after the token embedding (BLOOM)
    embed_affine: bool = True  # False: that norm has no scale (Muse Glimmer)
    # the final norm's offset where it differs from the block's (Muse Glimmer)
    final_offset: float | None = None
    # attention and feed-forward read the same input (the generic key use_parallel_residual wins),
    # from one
    # shared norm or one each (the generic key num_ln_in_parallel_attn wins: 1 shared, else one
    # each)
    parallel: bool = False
    parallel_shared: bool = True


@dataclass(frozen=True)
class PositionSpec:
    """How positions enter: rotation (and its conventions), learned rows, ALiBi or nothing."""

    # "rope" | "learned" | "none" | "alibi" (the generic key alibi switches
    kind: str = "rope"
    #                                       learned or rotated positions to ALiBi: Falcon, MPT)
    offset: int = 0  # learned positions read this many rows in (OPT)
    interleaved: bool = False  # adjacent pairs rotate (GPT-J, Cohere) rather than halves
    rotary_share: float = 1.0  # share of each head rotated when the config states none
    theta: float = 10000.0  # the rotation base when the config states none
    # sliding layers' base when rope_local_base_freq is unstated (Gemma 3)
    local_theta: float | None = None
    # a top-level rope_scaling applies to full-attention layers only; sliding ones rotate plainly
    # (OLMo 3)
    local_unscaled: bool = False
    # "all": every layer rotates; "sliding": where the config states a sliding_window, only
    # sliding-window
    # layers rotate and full-attention ones apply no rotation (Cohere 2, EXAONE 4)
    layers: str = "all"
    # the bias is added before the scores are scaled by 1/sqrt(head_dim) (Falcon)
    alibi_before_scale: bool = False
    alibi_bf16: bool = False  # slopes and bias rounded to bf16, as Falcon builds them
    # the bias is -slope x sqrt(distance), from each query's position (Step1)
    alibi_sqrt: bool = False


@dataclass(frozen=True)
class EmbeddingSpec:
    """The token embedding and the head. The head's bias is the config key lm_head_bias."""

    # the head shares the embedding when tie_word_embeddings is unstated
    tied: bool = False
    scale_sqrt: bool = False  # the embedding times sqrt(hidden) (Gemma)


@dataclass(frozen=True)
class MoESpec:
    """How a mixture-of-experts family routes and computes, beyond what its config states."""

    scoring: str = "softmax"  # "softmax" | "sigmoid" (config scoring_func wins)
    # "greedy" | "group_limited_greedy" | "noaux_tc" (config topk_method wins)
    topk_method: str = "greedy"
    # None: norm_topk_prob decides; True: always (Mixtral, GraniteMoE)
    renormalize: bool | None = None
    # routed_scaling_factor: "never" | "always" | "without_renormalize"
    scaling: str = "never"
    router_bias: bool = False  # a bias on the router's logits (GPT-OSS)
    # e_score_correction_bias, added only to choose (DeepSeek-V3)
    correction_bias: bool = False
    # "none" | "deepseek" (n_shared_experts wide) | "qwen" (sigmoid-gated)
    shared: str = "none"
    # | "stated" (shared_intermediate_size wide: GraniteMoE shared)
    # | "dense_width" (num_shared_expert x intermediate_size: HunYuan)
    # | "routed" (n_shared_experts experts the router scores too: Inkling)
    expert_bias: bool = False  # biased expert projections (GPT-OSS)
    # "glu": act(gate) * up | "clamped_swiglu": GPT-OSS's | "ungated": act(up)
    activation: str = "glu"
    # | "limited_swiglu": act(min(gate, limit)) * clamp(up, +-limit) (HY V4)
    # softmax over the chosen experts' logits: softmax scores are always renormalised, sigmoid ones
    # under
    # norm_topk_prob (Cohere 2 MoE)
    softmax_renormalized: bool = False
    # SparseMixer as Transformers runs it outside training: two rounds, each taking the best logit
    # not yet chosen,
    # weighed by its softmax over the experts within 2 * router_jitter_noise of it (PhiMoE)
    sparsemixer: bool = False
    # each expert reads its input already multiplied by the token's weight for it, and its output is
    # summed
    # unweighted (Llama 4; the config key moe_apply_router_weight_on_input wins)
    weight_input: bool = False
    # the routing weights times the router's stored scale (Inkling)
    router_scale: bool = False
    # Gemma 4's router: it reads its input through a scale-free RMS norm times a stored scale per
    # channel and
    # 1/sqrt(hidden), and the chosen weights are multiplied by a stored scale per expert
    router_input_norm: bool = False


@dataclass(frozen=True)
class MTPSpec:
    """Where a family stores its multi-token-prediction layers and how one is wired (model/mtp.py):
    DeepSeek-V3's by default (GLM-4.5 stores its own the same way), MiMo's (model.mtp_layers.{k}) as
    the other layout."""

    # the prefix of MTP layer k's tensors: "{i}" the decoder index it follows as (num_hidden_layers
    # + k), or
    # "{k}" k itself; the layer's decoder tensors follow the family's rules below it as
    # model.layers.{i}'s do
    prefix: str = "model.layers.{i}."
    token_norm: str = "enorm"  # the next token's embedding passes this norm
    hidden_norm: str = "hnorm"  # the model's hidden state passes this one
    proj: str = "eh_proj"  # [hidden, 2 * hidden] over both
    # proj reads [hidden_norm(h); token_norm(e)] (MiMo), not [e; h]
    hidden_first: bool = False
    out_norm: str = "shared_head.norm"  # over the decoder layer's output, before the head
    head: str | None = "shared_head.head"  # the layer's own head; None: the model's lm_head (MiMo)
    # a chained draft reads the layer's output after out_norm (MiMo's final_layernorm ends the
    # layer), not before
    chain_normed: bool = False


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor template and where its data goes."""

    checkpoint: str
    target: str | Fused | Stacked
    transposed: bool = False  # stored inputs-first (GPT-2's Conv1D)
    # stored also in layers that never apply it (A.X-K1's dense layers keep a post_mlp_layernorm):
    # skipped where
    # the layer has no such parameter, rather than refused
    optional: bool = False

    @property
    def pattern(self) -> re.Pattern:
        return _compile(self.checkpoint)


def _compile(template: str) -> re.Pattern:
    escaped = (
        re.escape(template)
        .replace(r"\{i\}", r"(?P<i>\d+)")
        .replace(r"\{s\}", r"(?P<s>\d+)")
        .replace(r"\{h\}", r"(?P<h>\d+)")
        .replace(r"\{half\}", r"(?P<half>[01])")
        .replace(r"\{e\}", r"(?P<e>\d+)")
    )
    return re.compile(escaped + r"$")


def halved(groups: dict) -> dict:
    """A match in a family whose stored layer k holds decoder layers 2k and 2k + 1
    (FamilySpec.halved_layers), with {i} made the decoder's layer: the {half} the name states, or
    the first half for what the stored layer holds once (LongCat-Flash's shortcut experts)."""
    if groups.get("i") is None:
        return groups
    return {**groups, "i": str(2 * int(groups["i"]) + int(groups.get("half") or 0))}


def target_name(template: str, groups: dict) -> str:
    """A rule's target template with the matched layer ({i}) and slot ({s}) filled in."""
    for key in ("i", "s"):
        if groups.get(key) is not None:
            template = template.replace("{%s}" % key, groups[key])
    return template


@dataclass(frozen=True)
class FamilySpec:
    """One family: its name map, its conventions (sub-specs defaulting to Llama's) and its config
    normalisation.

    A family that is Llama's block under other names states `name`, `rules` and `parity_reference`;
    every other difference is one sub-spec argument or a line of its `normalize`.
    """

    name: str
    rules: tuple[Rule, ...]
    attention: AttentionSpec = AttentionSpec()
    feed_forward: FeedForwardSpec = FeedForwardSpec()
    norms: NormSpec = NormSpec()
    positions: PositionSpec = PositionSpec()
    embedding: EmbeddingSpec = EmbeddingSpec()
    moe: MoESpec | None = None  # a mixture-of-experts family: its routing conventions
    # The family's config normalisation: its text config (after the gate) -> a new dict with the
    # generic keys the
    # shared reader knows (families/normalize.py lists them) filled from the family's own names, its
    # Transformers class's defaults and its fixed choices. Runs before anything is read; raises
    # normalize.ConfigProblem for a value it cannot read.
    normalize: Callable[[dict], dict] | None = None
    # The kind of each layer's token mixer and feed-forward (model/kinds.py), from the normalised
    # config and
    # the layer count: (mixers, feed_forwards), a name per layer each. None: attention and the dense
    # (or
    # moe_layers') feed-forward everywhere. May raise Refusal for a pattern it cannot read.
    layer_kinds: Callable[[dict, int], tuple[tuple[str, ...], tuple[str, ...]]] | None = None
    refuse_keys: dict = field(default_factory=dict)  # config key -> why it is refused when truthy
    # config key -> (the one supported value, why), when stated
    require_values: dict = field(default_factory=dict)
    # the Transformers CausalLM class the parity tests compare with, or, for a family Transformers
    # lacks (remote
    # code on the Hub), the test file whose hand-written reference it is checked against
    # ("tests/test_x.py")
    parity_reference: str | None = None
    # the name map's own conventions
    # where the family's root prefix may be missing (GPT-2's h.0... beside transformer.h.0...)
    optional_prefix: str = ""
    # regexes of checkpoint tensors that carry no weights (buffers)
    ignore: tuple[str, ...] = ()
    # The checkpoint format whose names `rules` reads: "safetensors" (Transformers') or "mistral"
    # (Mistral's
    # own consolidated files). Adapters always name Transformers' modules, so a map of another
    # format
    # places them through the family's Transformers spec.
    weight_format: str = "safetensors"
    # Projections (decoder names after "layers.{i}.") whose rows within each head are stored as
    # adjacent
    # rotation pairs where Transformers' checkpoints store halves: an adapter's B rows, made on
    # Transformers'
    # order, are put in pair order before they touch these weights.
    pair_rows: tuple[str, ...] = ()
    # each stored layer k runs as decoder layers 2k and 2k + 1 (LongCat-Flash): the name map's {i}
    # is the stored
    # layer and {half} picks one of its two (`halved`)
    halved_layers: bool = False
    # its multi-token-prediction layers, read only under --speculative mtp
    mtp: MTPSpec = MTPSpec()

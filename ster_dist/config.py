"""ModelConfig: one frozen, normalised view of a checkpoint's config.json.

This is the only code that reads config keys. It resolves every alias the
families use (GPT-style n_embd / n_layer / n_head, the five norm-epsilon
spellings, Transformers 5's rope_parameters, layer_types, ...) and turns each
family's conventions (from its FamilySpec) into plain switches, so the decoder
reads switches and sizes and never a family name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ster_dist.config_file import family_of, not_runnable, text_config, wrapper_of
from ster_dist.config_quant import BlockFP8, quantization
from ster_dist.config_ranges import check_sizes, check_stated
from ster_dist.errors import Refusal
from ster_dist.families.registry import spec_for
from ster_dist.families.spec import FamilySpec

SCORINGS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu2", "relu", "gelu_exact", "xielu")
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    """The rotation one layer applies. rotary_dim is the rotated share of each head."""

    theta: float
    rotary_dim: int
    interleaved: bool = False             # adjacent pairs (GPT-J, Cohere) rather than halves
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    beta_fast: float = 32.0               # yarn
    beta_slow: float = 1.0                # yarn
    mscale: float | None = None           # yarn
    mscale_all_dim: float | None = None   # yarn
    truncate: bool = True                 # yarn
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()   # longrope
    short_mscale: float | None = None     # longrope: cos/sin scale of the short table, in place of attention_factor
    long_mscale: float | None = None      # longrope: the long table's (PhiMoE)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: how tokens are routed and how wide the experts are."""

    num_experts: int
    top_k: int
    intermediate_size: int                # one expert's width
    scoring: str = "softmax"              # softmax | sigmoid, computed in f32
    topk_method: str = "greedy"           # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False             # chosen weights divided by their sum
    scaling_factor: float = 1.0           # routed_scaling_factor, already resolved per family
    router_bias: bool = False
    correction_bias: bool = False         # e_score_correction_bias: added to choose, never to weigh
    shared_intermediate_size: int = 0     # shared experts on every token (0: none)
    shared_gate: bool = False             # Qwen2-MoE: the shared expert times sigmoid(shared_expert_gate(x))
    expert_bias: bool = False
    activation: str = "glu"               # glu | clamped_swiglu (GPT-OSS)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    shared_average: bool = False          # routed plus shared experts, halved (Cohere 2 MoE's "average")
    sparsemixer_eps: float | None = None  # SparseMixer's eval-time selection at this router_jitter_noise (PhiMoE)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention sizes (DeepSeek-V2/V3, MiniCPM3)."""

    q_lora_rank: int | None               # None: one q_proj without a query bottleneck
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


# the layer kinds a config may pick (model/kinds.py builds them); attention kinds keep keys per position
ATTENTION_MIXERS = ("attention", "latent_attention")
# "none": a layer of the feed-forward alone (Nemotron-H's "-" and "E" layers)
MIXER_KINDS = ATTENTION_MIXERS + ("mamba", "mamba2", "gated_delta", "kimi_delta", "lightning", "short_conv", "none")
FEED_FORWARD_KINDS = ("dense", "moe", "none")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    # norms
    norm_kind: str = "rms"                # "rms" | "layer"
    norm_bias: bool = False
    norm_eps: float = 1e-6
    norm_offset: float = 0.0              # 1.0 where the stored scale is an offset from one (Gemma)
    norm_affine: bool = True              # False: the block and final norms have no scale or bias (OLMo 1)
    # block layout
    pre_attn_norm: bool = True
    pre_mlp_norm: bool = True
    post_attn_norm: bool = False          # a norm over the attention output (Gemma 2, OLMo 2)
    post_mlp_norm: bool = False
    parallel_block: bool = False          # attention and feed-forward read the same input
    parallel_shared_norm: bool = True     # one norm feeds both halves of a parallel block
    # attention
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"                 # "none" | "head" (per head) | "proj" (whole projection)
    qk_norm_kind: str = "rms"             # "rms" | "layer"
    qk_norm_per_head_weight: bool = False  # a separate scale per head ([heads, head_dim])
    qk_norm_bias: bool = False
    qk_norm_after_rope: bool = False      # per-head query/key norms after the rotation rather than before (HunYuan)
    # q_proj yields each head's query rows and then as many gate rows; the attention output is multiplied by
    # the gate's sigmoid before o_proj (Qwen3-Next, Qwen3.5: a config's attn_output_gate, which their
    # normalisation states)
    attn_output_gate: bool = False
    # Llama 4's query temperature (Ministral 3): queries times 1 + beta * ln(1 + floor(position / length))
    query_temperature_beta: float = 0.0
    query_temperature_length: int | None = None
    attn_scale: float = 1.0
    attn_softcap: float | None = None
    clip_qkv: float | None = None
    layer_rope: tuple[RopeConfig | None, ...] = ()   # None: the layer does not rotate
    layer_window: tuple[int | None, ...] = ()        # sliding window per layer, None = full
    learned_positions: bool = False
    position_offset: int = 0
    # ALiBi: each head adds slope x the key's absolute position to its scores (slopes by global head index)
    alibi: bool = False
    alibi_before_scale: bool = False      # added before the scores are scaled (Falcon)
    alibi_bf16: bool = False              # slopes and bias rounded to bf16 (Falcon)
    embed_norm: bool = False              # a norm after the token embedding (BLOOM)
    # feed-forward
    mlp_gated: bool = True
    hidden_act: str = "silu"
    mlp_up_bias: bool = False
    mlp_down_bias: bool = False
    # embedding and head
    embed_scale: float = 1.0
    residual_multiplier: float = 1.0
    # the residual stream kept in f32 while the layers compute in the model's dtype (Mamba's residual_in_fp32)
    residual_fp32: bool = False
    logit_multiplier: float = 1.0
    logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # mixture of experts, latent attention, sinks
    moe: MoEConfig | None = None
    moe_layers: tuple[bool, ...] = ()     # which layers route over experts (the rest keep the dense MLP)
    mla: MLAConfig | None = None
    attn_sinks: bool = False              # a learned extra logit per head whose share is dropped (GPT-OSS)
    weight_format: str = "safetensors"    # whose tensor names the checkpoint uses: Transformers' or "mistral"
    quant: BlockFP8 | None = None         # FP8 weights with block scales, dequantized while loading
    # multi-token-prediction layers stored after the decoder's (DeepSeek-V3's num_nextn_predict_layers):
    # layer indices num_layers .. num_layers + mtp_layers - 1, never loaded for plain decoding
    mtp_layers: int = 0
    # the kind of each layer's token mixer and feed-forward (model/kinds.py); empty: attention (latent where
    # mla is set) in every layer, and experts where moe_layers says, else the dense feed-forward
    mixers: tuple[str, ...] = ()
    feed_forwards: tuple[str, ...] = ()
    # the wrapper model_type (config_file.TEXT_WRAPPERS) whose text decoder this is: its weights carry the
    # wrapper's prefixes and its towers are never mapped; None for a plain checkpoint
    wrapper: str | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def mixer(self, layer: int) -> str:
        if self.mixers:
            return self.mixers[layer]
        return "latent_attention" if self.mla is not None else "attention"

    def feed_forward(self, layer: int) -> str:
        if self.feed_forwards:
            return self.feed_forwards[layer]
        return "moe" if self.moe is not None and self.moe_layers[layer] else "dense"

    @property
    def spec(self) -> FamilySpec:
        """The name map of this checkpoint's own tensors."""
        return spec_for(self.family, self.weight_format)

    @property
    def transformers_spec(self) -> FamilySpec:
        """The name map of Transformers' checkpoints of this family: the module names adapters use."""
        return spec_for(self.family)

    def with_eos(self, eos: tuple[int, ...]) -> "ModelConfig":
        return replace(self, eos_token_ids=eos)

    def summary(self) -> dict:
        return {
            "family": self.family, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_layers": self.num_layers, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "max_position": self.max_position,
            "hidden_act": self.hidden_act, "norm": self.norm_kind, "norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope": sorted({r.rope_type for r in self.layer_rope if r is not None}),
            "sliding_window_layers": sum(w is not None for w in self.layer_window),
            **({"experts": self.moe.num_experts, "experts_per_token": self.moe.top_k,
                "moe_layers": sum(self.moe_layers)} if self.moe else {}),
            **({"latent_attention": {"kv_lora_rank": self.mla.kv_lora_rank, "q_lora_rank": self.mla.q_lora_rank}}
               if self.mla else {}),
            **({"mtp_layers": self.mtp_layers} if self.mtp_layers else {}),
            **({"quantization": self.quant.summary()} if self.quant else {}),
        }


class _Keys:
    """Config lookups with aliases; unstated (missing or null) keys fall through."""

    def __init__(self, raw: dict, path: str):
        self.raw = raw
        self.path = path

    def get(self, *names: str, default=None):
        for name in names:
            value = self.raw.get(name)
            if value is not None:
                return value
        return default

    def need(self, *names: str):
        value = self.get(*names)
        if value is None:
            raise Refusal(f"invalid model config {self.path}: missing {' / '.join(names)}")
        return value


def _rope_sources(keys: _Keys, spec: FamilySpec) -> tuple[dict, dict]:
    """(rotation of full-attention layers, rotation of sliding layers) as rope_parameters-shaped dicts.

    Transformers 5 writes one rope_parameters object (or one per layer type);
    older configs write rope_theta and rope_scaling at the top level, which win.
    """
    params = keys.get("rope_parameters", default={}) or {}
    nested = "full_attention" in params or "sliding_attention" in params
    if nested:
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or full)
    else:
        full, sliding = dict(params), None
    scaling = keys.get("rope_scaling")
    if isinstance(scaling, dict):
        full = {**{k: v for k, v in full.items() if k in ("rope_theta", "partial_rotary_factor")}, **scaling}
    theta = keys.get("rope_theta", "rotary_emb_base")
    if theta is not None:
        full["rope_theta"] = theta
    # Phi-3 states original_max_position_embeddings beside rope_scaling; Transformers gives it priority
    original = keys.get("original_max_position_embeddings")
    if original is not None and (full.get("rope_type") or full.get("type")) in ("llama3", "yarn", "longrope"):
        full["original_max_position_embeddings"] = original
    if sliding is None:
        sliding = dict(full)
    local_base = keys.get("rope_local_base_freq")
    if local_base is None and not nested:
        local_base = spec.default_local_rope_theta
    if local_base is not None:
        sliding = {"rope_type": "default", "rope_theta": local_base}
    elif spec.local_rope_unscaled and not nested:  # OLMo 3: rope_scaling is for the full-attention layers
        sliding = {k: v for k, v in full.items() if k in ("rope_theta", "partial_rotary_factor")}
    return full, sliding


def _rope(params: dict, head_dim: int, partial: float | None, interleaved: bool, default_theta: float,
          path: str, max_position: int, default_share: float = 1.0) -> RopeConfig:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise Refusal(f"invalid model config {path}: rope scaling type {rope_type!r} is not supported; "
                      f"supported: {', '.join(ROPE_TYPES)}")
    if partial is None:
        partial = params.get("partial_rotary_factor") or default_share
    rotary_dim = int(head_dim * partial)
    rotary_dim -= rotary_dim % 2
    theta = float(params.get("rope_theta") or default_theta)
    kw: dict = {}
    if rope_type == "dynamic":
        alpha = params.get("alpha")
        if alpha:  # HunYuan: a fixed larger base; plain dynamic is the plain rotation within max_position
            theta = theta * alpha ** (head_dim / (head_dim - 2))
        rope_type = "default"
    if rope_type != "default":
        kw["factor"] = float(params.get("factor") or 1.0)
        kw["original_max_position"] = params.get("original_max_position_embeddings")
        kw["attention_factor"] = params.get("attention_factor")
    if rope_type == "llama3":
        # a stated null is the default, as for the other rope fields read with `or`
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        kw.update(low_freq_factor=float(1.0 if low is None else low), high_freq_factor=float(4.0 if high is None else high))
    elif rope_type == "yarn":
        kw.update(beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                  truncate=bool(params.get("truncate", True)))
        if params.get("factor") is None and kw["original_max_position"]:
            kw["factor"] = max_position / kw["original_max_position"]
    elif rope_type == "longrope":
        kw.update(short_factor=tuple(params["short_factor"]), long_factor=tuple(params["long_factor"]))
        if params.get("short_mscale") is not None or params.get("long_mscale") is not None:
            short, long = params.get("short_mscale"), params.get("long_mscale")
            kw.update(short_mscale=float(1.0 if short is None else short), long_mscale=float(1.0 if long is None else long))
        if params.get("factor") is None and kw["original_max_position"]:
            kw["factor"] = max_position / kw["original_max_position"]
    if rope_type != "default" and rope_type != "linear" and not kw.get("original_max_position"):
        kw["original_max_position"] = max_position
    return RopeConfig(theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, rope_type=rope_type, **kw)


def _layer_types(keys: _Keys, spec: FamilySpec, num_layers: int) -> list[str]:
    """Which layers attend through a sliding window: layer_types when stated, else the family's rule."""
    stated = keys.get("layer_types")
    if stated:
        if len(stated) != num_layers:
            raise Refusal(f"invalid model config {keys.path}: layer_types lists {len(stated)} layers "
                          f"for {num_layers} hidden layers")
        return list(stated)
    window = keys.get("sliding_window")
    rule = spec.sliding
    kinds = ["full_attention"] * num_layers
    if rule == "all" and window:
        kinds = ["sliding_attention"] * num_layers
    elif rule == "max_window_layers" and window and keys.get("use_sliding_window", default=False):
        start = keys.get("max_window_layers", default=num_layers)
        kinds = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    elif rule == "even" and window:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    elif rule == "pattern" and window:
        pattern = keys.get("sliding_window_pattern", "_sliding_window_pattern", default=6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    elif rule == "pattern_first" and window:  # Granite SWA: the first layer of each pattern attends fully
        pattern = keys.get("sliding_window_pattern", default=4)
        kinds = ["full_attention" if i % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    return kinds


def _layer_bases(keys: _Keys, bases: list, kinds: list[str], window, full: dict, sliding: dict,
                 spec: FamilySpec) -> dict:
    """Check layer_rope_theta against the two rotations a config holds (full-attention layers at rope_theta,
    sliding-window layers at one base) and return the sliding layers' rotation at their stated base."""
    if len(bases) != len(kinds):
        raise Refusal(f"invalid model config {keys.path}: layer_rope_theta lists {len(bases)} bases "
                      f"for {len(kinds)} hidden layers")
    full_theta = float(full.get("rope_theta") or spec.default_rope_theta)
    slides = [kind == "sliding_attention" and window is not None for kind in kinds]
    full_bases = {float(b) for b, slide in zip(bases, slides) if b and not slide}
    sliding_bases = {float(b) for b, slide in zip(bases, slides) if b and slide}
    if full_bases - {full_theta} or len(sliding_bases) > 1:
        raise Refusal(f"invalid model config {keys.path}: layer_rope_theta {bases} is not supported; "
                      f"full-attention layers must rotate at rope_theta ({full_theta:g}) or not at all, and "
                      "sliding-window layers at one base or not at all")
    return {**sliding, "rope_theta": sliding_bases.pop()} if sliding_bases else sliding


def _nested(raw: dict, spec: FamilySpec, path: str) -> dict:
    """DBRX keeps attention and feed-forward settings in attn_config / ffn_config: read them beside the
    top-level keys (a top-level key wins)."""
    out = dict(raw)
    for name in spec.nested_configs:
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise Refusal(f"invalid model config {path}: {name} is not a JSON object; correct it in config.json")
        for key, value in (raw.get(name) or {}).items():
            # ffn_config repeats the width as hidden_size; d_model, at the top, is the one to read
            if out.get(key) is None and key != "hidden_size":
                out[key] = value
    return out


def _moe(keys: _Keys, spec: FamilySpec, intermediate: int, num_layers: int) -> tuple[MoEConfig, tuple[bool, ...]]:
    """The routing and expert sizes of a mixture-of-experts family, and which layers are sparse."""
    path, ms = keys.path, spec.moe
    num_experts = _per_layer(keys, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    top_k = _per_layer(keys, "num_experts_per_tok", "moe_top_k", "moe_k", "moe_topk")
    if not 0 < top_k <= num_experts:
        raise Refusal(f"invalid model config {path}: {top_k} experts per token out of {num_experts} experts")
    scoring = keys.get(*ms.scoring_keys, default=ms.scoring)
    if scoring not in SCORINGS:
        raise Refusal(f"invalid model config {path}: scoring_func {scoring!r} is not supported; "
                      f"supported: {', '.join(SCORINGS)}")
    method = keys.get("topk_method", default=ms.topk_method)
    if method not in TOPK_METHODS:
        raise Refusal(f"invalid model config {path}: topk_method {method!r} is not supported; "
                      f"supported: {', '.join(TOPK_METHODS)}")
    n_group, topk_group = int(keys.get("n_group", default=1)), int(keys.get("topk_group", default=1))
    if method != "greedy":
        if n_group < 1 or num_experts % n_group or not 0 < topk_group <= n_group:
            raise Refusal(f"invalid model config {path}: {num_experts} experts do not form n_group {n_group} "
                          f"groups of which topk_group {topk_group} are kept; set n_group to a divisor of the "
                          "experts and topk_group to at most n_group")
        if method == "noaux_tc" and num_experts // n_group < 2:
            raise Refusal(f"invalid model config {path}: noaux_tc ranks each group by its best two experts but "
                          f"n_group {n_group} leaves {num_experts // n_group} per group; lower n_group")
        if topk_group * (num_experts // n_group) < top_k:
            raise Refusal(f"invalid model config {path}: topk_group {topk_group} groups hold fewer than the "
                          f"{top_k} experts each token chooses; raise topk_group")
    renormalize = ms.renormalize if ms.renormalize is not None else bool(keys.get("norm_topk_prob", default=False))
    if ms.softmax_renormalized and scoring == "softmax":  # a softmax over the chosen experts' logits
        renormalize = True
    if "moe_normalize_expert_weights" in keys.raw:  # DBRX: the chosen weights over their p-norm
        power = keys.raw["moe_normalize_expert_weights"]
        if power not in (None, 1):
            raise Refusal(f"invalid model config {path}: moe_normalize_expert_weights {power} is not supported; "
                          "only 1 (renormalise the chosen weights) is")
        renormalize = power == 1
    factor = float(keys.get("routed_scaling_factor", default=1.0))
    if ms.scaling == "never" or (ms.scaling == "without_renormalize" and renormalize):
        factor = 1.0
    width = _per_layer(keys, "moe_intermediate_size", default=intermediate)
    shared = 0
    if ms.shared == "deepseek":
        shared = width * int(keys.get("n_shared_experts", "moe_num_shared_experts", "num_shared_experts", default=0))
    elif ms.shared == "stated":
        shared = int(keys.get("shared_intermediate_size", default=0))
    elif ms.shared == "dense_width" and keys.get("use_mixed_mlp_moe", default=True):
        shared = intermediate * _per_layer(keys, "num_shared_expert", default=1)
    elif ms.shared == "qwen":
        shared = int(keys.get("shared_expert_intermediate_size", default=0))
    average = False
    if ms.shared_combination_key is not None:
        strategy = keys.get(ms.shared_combination_key, default="sum")
        if strategy not in ("sum", "average"):
            raise Refusal(f"invalid model config {path}: {ms.shared_combination_key} {strategy!r} is not supported; "
                          "supported: sum, average")
        average = strategy == "average"
    sparsemixer_eps = None
    if ms.sparsemixer:
        if top_k != 2:
            raise Refusal(f"invalid model config {path}: SparseMixer routes each token to two experts, not {top_k}; "
                          "set num_experts_per_tok to 2")
        if keys.get("router_jitter_noise") is None:
            raise Refusal(f"invalid model config {path}: router_jitter_noise is not stated; SparseMixer's "
                          "selection needs it")
        sparsemixer_eps = float(keys.get("router_jitter_noise"))
    moe = MoEConfig(
        num_experts=num_experts, top_k=top_k, intermediate_size=width, scoring=scoring, topk_method=method,
        n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling_factor=factor,
        router_bias=ms.router_bias, correction_bias=ms.correction_bias or method == "noaux_tc",
        shared_intermediate_size=shared, shared_gate=ms.shared == "qwen" and shared > 0,
        expert_bias=ms.expert_bias, activation=ms.activation, shared_average=shared > 0 and average,
        swiglu_limit=float(keys.get("swiglu_limit", default=7.0)), swiglu_alpha=float(keys.get("swiglu_alpha",
                                                                                                default=1.702)),
        sparsemixer_eps=sparsemixer_eps)
    # Qwen: mlp_only_layers and decoder_sparse_step; DeepSeek: first_k_dense_replace and moe_layer_freq
    only = set(keys.get("mlp_only_layers", default=[]) or [])
    # ERNIE 4.5: moe_layer_start_index / end (the last when negative) / interval; HunYuan: moe_layer_num_skipped
    step = int(keys.get("decoder_sparse_step", "moe_layer_interval", default=1) or 1)
    first = int(keys.get("first_k_dense_replace", "moe_layer_start_index", "moe_layer_num_skipped", default=0) or 0)
    freq = int(keys.get("moe_layer_freq", default=1) or 1)
    end = int(keys.get("moe_layer_end_index", default=-1))
    end = num_layers - 1 if end < 0 else end
    layers = tuple(i not in only and (i + 1) % step == 0 and first <= i <= end and i % freq == 0
                   for i in range(num_layers))
    kinds = keys.get("mlp_layer_types")  # GLM-4.7-Flash: stated per layer, "dense" or "sparse"
    if kinds:
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise Refusal(f"invalid model config {path}: mlp_layer_types must list \"dense\" or \"sparse\" for "
                          f"each of the {num_layers} layers")
        layers = tuple(kind == "sparse" for kind in kinds)
    return moe, layers


def _per_layer(keys: _Keys, *names: str, default=None) -> int:
    """A mixture-of-experts size stated once or once per layer (HunYuan's lists); differing values are refused."""
    value = keys.get(*names, default=default)
    if value is None:
        keys.need(*names)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise Refusal(f"invalid model config {keys.path}: {' / '.join(names)} differs between layers "
                          f"({value}); only one value for every layer is supported")
        value = value[0]
    return int(value)


def _mla(keys: _Keys) -> MLAConfig:
    q_rank = keys.get("q_lora_rank")
    return MLAConfig(q_lora_rank=int(q_rank) if q_rank else None, kv_lora_rank=int(keys.need("kv_lora_rank")),
                     qk_nope_head_dim=int(keys.need("qk_nope_head_dim")),
                     qk_rope_head_dim=int(keys.need("qk_rope_head_dim")), v_head_dim=int(keys.need("v_head_dim")))


def _yarn_mscale(rope: RopeConfig | None) -> float:
    """DeepSeek sharpens latent attention's scores by the square of the YaRN temperature of mscale_all_dim."""
    if rope is None or rope.rope_type == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
    return m * m


def _eos(keys: _Keys) -> tuple[int, ...]:
    eos = keys.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def from_hf(raw: dict, path: str = "config.json", weight_format: str = "safetensors") -> ModelConfig:
    """Normalise a Transformers config.json dict (after the architecture gate) into a ModelConfig.

    weight_format chooses the family's name map, and with it the conventions of that format's tensors
    (Mistral's own format stores query and key rows for rotation by adjacent pairs)."""
    family = family_of(raw)
    wrapper = wrapper_of(raw)
    spec = spec_for(family, weight_format)
    if spec is None:
        raise not_runnable(raw, family)
    raw = text_config(raw)
    if spec.normalize is not None:
        raw = spec.normalize(raw)
    own = _nested(raw, spec, path)
    keys = _Keys({**spec.config_defaults, **own}, path)
    # types and ranges first: nothing below may divide by, index with or loop over a bad value
    check_stated(keys.raw, path, spec.width_keys + spec.dense_intermediate_keys)
    for key, why in spec.refuse_keys.items():
        if keys.get(key):
            raise Refusal(f"invalid model config {path}: {key} is set; {why}")
    for key, (value, why) in spec.require_values.items():
        if keys.get(key) is not None and keys.get(key) != value:
            raise Refusal(f"invalid model config {path}: {key} is {keys.get(key)!r}; {why}")
    # MiniMax's layer kinds: 1 is softmax attention, 0 lightning (linear) attention, which no spec runs
    kinds = keys.get("attn_type_list")
    if isinstance(kinds, list) and 0 in kinds:
        lightning = [i for i, kind in enumerate(kinds) if kind == 0]
        raise Refusal(f"invalid model config {path}: attn_type_list marks layers {lightning} as lightning "
                      "(linear) attention, which ster_dist does not run; only softmax-attention layers (1) "
                      "are supported")

    hidden = int(keys.need("hidden_size", "n_embd", "n_embed", "d_model"))
    num_layers = int(keys.need("num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    mixers, feed_forwards = _layer_kinds(keys, spec, num_layers, path)
    attends = not mixers or any(kind in ATTENTION_MIXERS for kind in mixers)
    if not attends:  # no attention layer (Mamba): no head sizes to read
        keys.raw.setdefault("num_attention_heads", 0)
    num_heads = int(keys.need("num_attention_heads", "n_head", "n_heads"))
    num_kv = int(keys.get("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv", default=num_heads))
    grouped = spec.grouped_kv_key is not None and bool(keys.get(spec.grouped_kv_key))
    if keys.get("multi_query") and not grouped:
        num_kv = 1
    elif spec.grouped_kv_key is not None and not grouped:  # Falcon: a stated count applies to the new layout only
        num_kv = num_heads
    head_dim = int(keys.get("head_dim", default=hidden // num_heads if num_heads else 0))
    inner = keys.get("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
    if inner is None and keys.get("expansion_ratio") is not None:  # MPT
        inner = int(keys.get("expansion_ratio") * hidden)
    intermediate = int(inner if inner is not None else 4 * hidden)
    for key in spec.width_keys:
        if keys.get(key) is not None and int(keys.get(key)) != hidden:
            raise Refusal(f"invalid model config {path}: {key} {keys.get(key)} differs from the model width "
                          f"{hidden}; projecting the embedding in and out is not supported")
    max_position = int(keys.get("max_position_embeddings", "n_positions", "seq_length", "max_seq_len", default=4096))
    vocab = int(keys.need("vocab_size"))
    eps = float(keys.get("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps", "layer_norm_epsilon",
                         default=1e-6))
    if spec.norm_eps is not None:
        eps = spec.norm_eps
    if attends:
        check_sizes(path, hidden=hidden, heads=num_heads, kv_heads=num_kv, head_dim=head_dim,
                    head_dim_stated=keys.get("head_dim") is not None or spec.latent_attention, layers=num_layers,
                    # latent attention gives every head its own key: its stated key/value count means nothing
                    kv_stated=not spec.latent_attention and any(
                        own.get(k) is not None for k in ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_head_kv",
                                                         "multi_query")),
                    no_rope_layers=keys.get("no_rope_layers"))
    act = keys.get("hidden_act", "hidden_activation", "activation_function",
                   default=(keys.get("ffn_act_fn") or {}).get("name", "silu"))
    act = spec.activation or act
    if act not in ACTIVATIONS:
        raise Refusal(f"invalid model config {path}: hidden_act {act!r} is not supported; "
                      f"supported: {', '.join(ACTIVATIONS)}")

    mla = _mla(keys) if spec.latent_attention else None
    if mla is not None:  # latent attention: every head has its own key; only qk_rope_head_dim rotates
        num_kv, head_dim = num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    # a family of experts whose layer pattern routes no layer (Granite 4.0 without experts) is a dense model
    routes = spec.moe is not None and (not feed_forwards or "moe" in feed_forwards)
    moe, moe_layers = _moe(keys, spec, intermediate, num_layers) if routes else (None, ())
    if moe is not None and feed_forwards:  # the family's layer pattern says which layers route (Jamba)
        moe_layers = tuple(kind == "moe" for kind in feed_forwards)
    if spec.dense_intermediate_keys:  # intermediate_size is the experts' width; the dense layers state their own
        intermediate = int(keys.get(*spec.dense_intermediate_keys, default=intermediate))
    norm_kind = spec.norm_kind
    if spec.rms_norm_key is not None and keys.get(spec.rms_norm_key) is not None:
        norm_kind = "rms"

    # rotation, per layer
    kinds = _layer_types(keys, spec, num_layers)
    window = keys.get("sliding_window")
    full_rope, sliding_rope = _rope_sources(keys, spec)
    layer_bases = keys.get("layer_rope_theta")  # Granite SWA: a base per layer, zero for no rotation
    if layer_bases is not None:
        sliding_rope = _layer_bases(keys, layer_bases, kinds, window, full_rope, sliding_rope, spec)
    partial = keys.get("partial_rotary_factor", "rotary_pct")
    if keys.get("rotary_dim") is not None:
        partial = keys.get("rotary_dim") / head_dim
    rope_dim, interleaved = head_dim, spec.rope_interleaved
    if mla is not None:
        rope_dim, partial = mla.qk_rope_head_dim, 1.0
        interleaved = bool(keys.get("rope_interleave", default=spec.rope_interleaved))
    layer_rope: list[RopeConfig | None] = []
    layer_window: list[int | None] = []
    no_rope = keys.get("no_rope_layers")
    alibi = spec.positions == "alibi" or (spec.alibi_key is not None and bool(keys.get(spec.alibi_key)))
    for i, kind in enumerate(kinds):
        if mixers and mixers[i] not in ATTENTION_MIXERS:  # a recurrent layer: no rotation, no window
            layer_rope.append(None)
            layer_window.append(None)
            continue
        if kind not in ("full_attention", "sliding_attention"):
            raise Refusal(f"invalid model config {path}: layer type {kind!r} (layer {i}) is not supported "
                          f"for {family}")
        sliding = kind == "sliding_attention" and window is not None
        # Cohere 2 MoE: the dense layers rotate as sliding ones do under its dense_rope_key
        dense_rotates = (spec.dense_rope_key is not None and keys.get(spec.dense_rope_key) == 1
                         and moe is not None and not moe_layers[i])
        if spec.positions != "rope" or alibi or (no_rope is not None and not no_rope[i]) or (
                layer_bases is not None and not layer_bases[i]) or (
                spec.rope_layers == "sliding" and window is not None and not sliding and not dense_rotates):
            layer_rope.append(None)
        else:
            layer_rope.append(_rope(sliding_rope if sliding else full_rope, rope_dim, partial,
                                    interleaved, spec.default_rope_theta, path, max_position, spec.rotary_share))
        layer_window.append(int(window) if sliding else None)

    # attention scale and multipliers
    attn_scale = head_dim ** -0.5 if head_dim else 1.0  # no attention layer (Mamba): no head width
    if keys.get("query_pre_attn_scalar") is not None:
        attn_scale = float(keys.get("query_pre_attn_scalar")) ** -0.5
    if keys.get("attention_multiplier") is not None:
        attn_scale = float(keys.get("attention_multiplier"))
    if spec.positions == "learned" and keys.get("scale_attn_weights") is False:
        attn_scale = 1.0
    if mla is not None:
        attn_scale = head_dim ** -0.5 * _yarn_mscale(next((r for r in layer_rope if r is not None), None))
    embed_scale = math.sqrt(hidden) if spec.embed_scale_sqrt else float(
        keys.get("embedding_multiplier", "scale_emb", default=1.0))
    logit_multiplier = float(keys.get("logit_scale", default=1.0))
    if keys.get("logits_scaling") is not None:
        logit_multiplier = 1.0 / float(keys.get("logits_scaling"))
        if spec.logits_scaling_multiplies:  # HyperCLOVA X multiplies where Granite divides
            logit_multiplier = float(keys.get("logits_scaling"))
    if keys.get("dim_model_base") is not None:  # MiniCPM's muP: the hidden state shrunk before the head
        logit_multiplier = float(keys.get("dim_model_base")) / hidden
    residual_multiplier = float(keys.get("residual_multiplier", default=1.0))
    if keys.get("scale_depth") is not None:
        residual_multiplier = float(keys.get("scale_depth")) / math.sqrt(num_layers)

    qkv_bias = bool(keys.get(*spec.qkv_bias_keys, default=spec.qkv_bias_default))
    o_bias = bool(keys.get(*spec.o_bias_keys, default=spec.o_bias_default))
    mlp_bias = bool(keys.get(*spec.mlp_bias_keys, default=spec.mlp_bias_default))
    qk_norm = spec.qk_norm
    if spec.qk_norm_key is not None and not keys.get(spec.qk_norm_key):
        qk_norm = "none"
    post_norm = spec.post_norm
    if spec.post_norm_key is not None:
        post_norm = bool(keys.get(spec.post_norm_key, default=False))
    parallel = spec.parallel_block
    if spec.parallel_key is not None:
        parallel = bool(keys.get(spec.parallel_key, default=False))
    shared_norm = spec.parallel_shared_norm
    if spec.parallel_norms_key is not None:  # Falcon: two norms in the new architecture unless it states one
        shared_norm = not keys.get(spec.parallel_norms_key) or keys.get("num_ln_in_parallel_attn") == 1
    pad = keys.get("pad_token_id")
    temperature_beta, temperature_length = 0.0, None
    if spec.query_temperature and full_rope.get("llama_4_scaling_beta") is not None:
        temperature_beta = float(full_rope["llama_4_scaling_beta"])
        temperature_length = full_rope.get("original_max_position_embeddings")
        if not temperature_length:
            raise Refusal(f"invalid model config {path}: llama_4_scaling_beta is stated without the "
                          "original_max_position_embeddings its query temperature counts positions in")

    return ModelConfig(
        family=family, vocab_size=vocab, hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv, head_dim=head_dim, intermediate_size=intermediate, max_position=max_position,
        norm_kind=norm_kind, norm_bias=spec.norm_bias, norm_eps=eps, norm_offset=spec.norm_offset,
        norm_affine=spec.norm_affine,
        pre_attn_norm=spec.pre_norm, pre_mlp_norm=spec.pre_norm and not (parallel and shared_norm),
        post_attn_norm=post_norm, post_mlp_norm=post_norm,
        parallel_block=parallel, parallel_shared_norm=shared_norm,
        qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm, qk_norm_kind=spec.qk_norm_kind,
        qk_norm_per_head_weight=spec.qk_norm_per_head_weight, qk_norm_bias=spec.qk_norm_bias, attn_scale=attn_scale,
        qk_norm_after_rope=spec.qk_norm_after_rope, query_temperature_beta=temperature_beta,
        query_temperature_length=int(temperature_length) if temperature_length else None,
        attn_output_gate=bool(keys.get("attn_output_gate", default=False)),
        attn_softcap=keys.get("attn_logit_softcapping"), clip_qkv=keys.get("clip_qkv"),
        layer_rope=tuple(layer_rope), layer_window=tuple(layer_window),
        learned_positions=spec.positions == "learned" and not alibi, position_offset=spec.position_offset,
        alibi=alibi, alibi_before_scale=spec.alibi_before_scale, alibi_bf16=spec.alibi_bf16,
        embed_norm=spec.embed_norm,
        mlp_gated=spec.mlp_gated, hidden_act=act, mlp_up_bias=mlp_bias, mlp_down_bias=mlp_bias,
        embed_scale=embed_scale, residual_multiplier=residual_multiplier,
        residual_fp32=bool(keys.get("residual_in_fp32", default=False)),
        logit_multiplier=logit_multiplier, logit_softcap=keys.get("final_logit_softcapping"),
        tie_word_embeddings=bool(keys.get("tie_word_embeddings", default=spec.tied_default)),
        lm_head_bias=spec.lm_head_bias or bool(keys.get(*spec.lm_head_bias_keys, default=False)),
        bos_token_id=keys.get("bos_token_id"), eos_token_ids=_eos(keys),
        pad_token_id=pad if isinstance(pad, int) else None,
        torch_dtype=keys.get("torch_dtype", "dtype"), moe=moe, moe_layers=moe_layers, mla=mla,
        attn_sinks=spec.attn_sinks, weight_format=weight_format, wrapper=wrapper, raw=raw,
        quant=quantization(raw.get("quantization_config"), path), mtp_layers=_mtp_layers(keys, path),
        mixers=mixers, feed_forwards=feed_forwards,
    )


def _layer_kinds(keys: _Keys, spec: FamilySpec, num_layers: int, path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Each layer's mixer and feed-forward kind as the family states them; empty where it states none."""
    if spec.layer_kinds is None:
        return (), ()
    mixers, feed_forwards = spec.layer_kinds(keys.raw, num_layers)
    for kinds, known, what in ((mixers, MIXER_KINDS, "token mixer"), (feed_forwards, FEED_FORWARD_KINDS,
                                                                        "feed-forward")):
        if len(kinds) != num_layers:
            raise Refusal(f"invalid model config {path}: the layer pattern gives {len(kinds)} {what} kinds for "
                          f"{num_layers} layers")
        unknown = sorted(set(kinds) - set(known))
        if unknown:
            raise Refusal(f"invalid model config {path}: {what} kind {unknown[0]!r} is not supported for {spec.name}")
    return tuple(mixers), tuple(feed_forwards)


def _mtp_layers(keys: _Keys, path: str) -> int:
    n = keys.get("num_nextn_predict_layers", default=0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise Refusal(f"invalid model config {path}: num_nextn_predict_layers is {n!r}, not a count of layers")
    return n

"""A mixture-of-experts family's routing and expert sizes read from its config (config.py's experts
part)."""

from __future__ import annotations

from dataclasses import dataclass

from ster_dist.config.keys import Keys
from ster_dist.errors import Refusal
from ster_dist.families.spec import FamilySpec

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward: how tokens are routed and how wide the experts are."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's width
    scoring: str = "softmax"  # softmax | sigmoid, computed in f32
    topk_method: str = "greedy"  # greedy | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False  # chosen weights divided by their sum
    scaling_factor: float = 1.0  # routed_scaling_factor, already resolved per family
    router_bias: bool = False
    correction_bias: bool = False  # e_score_correction_bias: added to choose, never to weigh
    shared_intermediate_size: int = 0  # shared experts on every token (0: none)
    # Qwen2-MoE: the shared expert times sigmoid(shared_expert_gate(x))
    shared_gate: bool = False
    expert_bias: bool = False
    # glu | clamped_swiglu (GPT-OSS) | ungated (Nemotron-H: act(up))
    activation: str = "glu"
    # | limited_swiglu (HY V4: act(min(gate, limit)) * clamp(up, +-limit))
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # routed plus shared experts, halved (Cohere 2 MoE's "average")
    shared_average: bool = False
    # SparseMixer's eval-time selection at this router_jitter_noise (PhiMoE)
    sparsemixer_eps: float | None = None
    # moe_latent_size: the routed experts' width (Nemotron-H; 0: hidden)
    latent_size: int = 0
    # the weight scales each expert's input, not its output (Llama 4)
    weight_input: bool = False
    # shared experts the router scores beside the routed ones (its last rows), each weighed like a
    # chosen expert
    # (Inkling: sigmoids over the sum of the chosen and shared ones); 0: none
    shared_routed: int = 0
    # the routing weights times a stored scale (Inkling's gate.global_scale)
    router_scale: bool = False
    # Gemma 4's router: normed, scaled input; a scale per expert (MoESpec)
    router_input_norm: bool = False
    # experts that return their input (LongCat-Flash's zero_expert_num), scored after the routed
    # ones; 0: none
    identity_experts: int = 0
    # hash routing (DeepSeek-V4's hash_moe layers): the experts are the token's row of a stored
    # table (tid2eid) of
    # this many rows, the router's scores weighing them; 0: the router chooses
    hash_vocab: int = 0


def moe_config(
    keys: Keys, spec: FamilySpec, intermediate: int, num_layers: int
) -> tuple[MoEConfig, tuple[bool, ...]]:
    """The routing and expert sizes of a mixture-of-experts family, and which layers are sparse."""
    path, ms = keys.path, spec.moe
    num_experts = _per_layer(
        keys, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"
    )
    top_k = _per_layer(keys, "num_experts_per_tok", "moe_top_k", "moe_k", "moe_topk")
    if not 0 < top_k <= num_experts:
        raise Refusal(
            f"invalid model config {path}: {top_k} experts per token out of {num_experts} experts"
        )
    scoring = keys.get("scoring_func", default=ms.scoring)
    if scoring not in SCORINGS:
        raise Refusal(
            f"invalid model config {path}: scoring_func {scoring!r} is not supported; "
            f"supported: {', '.join(SCORINGS)}"
        )
    method = keys.get("topk_method", default=ms.topk_method)
    if method not in TOPK_METHODS:
        raise Refusal(
            f"invalid model config {path}: topk_method {method!r} is not supported; "
            f"supported: {', '.join(TOPK_METHODS)}"
        )
    n_group, topk_group = (
        int(keys.get("n_group", default=1)),
        int(keys.get("topk_group", default=1)),
    )
    if method != "greedy":
        if n_group < 1 or num_experts % n_group or not 0 < topk_group <= n_group:
            raise Refusal(
                f"invalid model config {path}: {num_experts} experts do not form n_group {n_group} "
                f"groups of which topk_group {topk_group} are kept; set n_group to a divisor of the "
                "experts and topk_group to at most n_group"
            )
        if method == "noaux_tc" and num_experts // n_group < 2:
            raise Refusal(
                f"invalid model config {path}: noaux_tc ranks each group by its best two experts but "
                f"n_group {n_group} leaves {num_experts // n_group} per group; lower n_group"
            )
        if topk_group * (num_experts // n_group) < top_k:
            raise Refusal(
                f"invalid model config {path}: topk_group {topk_group} groups hold fewer than the "
                f"{top_k} experts each token chooses; raise topk_group"
            )
    renormalize = (
        ms.renormalize
        if ms.renormalize is not None
        else bool(keys.get("norm_topk_prob", default=False))
    )
    # a softmax over the chosen experts' logits
    if ms.softmax_renormalized and scoring == "softmax":
        renormalize = True
    if "moe_normalize_expert_weights" in keys.raw:  # DBRX: the chosen weights over their p-norm
        power = keys.raw["moe_normalize_expert_weights"]
        if power not in (None, 1):
            raise Refusal(
                f"invalid model config {path}: moe_normalize_expert_weights {power} is not supported; "
                "only 1 (renormalise the chosen weights) is"
            )
        renormalize = power == 1
    factor = float(keys.get("routed_scaling_factor", default=1.0))
    if ms.scaling == "never" or (ms.scaling == "without_renormalize" and renormalize):
        factor = 1.0
    width = _per_layer(keys, "moe_intermediate_size", default=intermediate)
    shared = 0
    if ms.shared == "deepseek":
        shared = width * int(
            keys.get("n_shared_experts", "moe_num_shared_experts", "num_shared_experts", default=0)
        )
    elif ms.shared == "stated":
        shared = int(keys.get("shared_intermediate_size", default=0))
    elif ms.shared == "dense_width" and keys.get("use_mixed_mlp_moe", default=True):
        shared = intermediate * _per_layer(keys, "num_shared_expert", default=1)
    elif ms.shared == "qwen":
        shared = int(keys.get("shared_expert_intermediate_size", default=0))
    shared_routed = int(keys.get("n_shared_experts", default=0)) if ms.shared == "routed" else 0
    strategy = keys.get("shared_expert_combination_strategy", default="sum")
    if strategy not in ("sum", "average"):
        raise Refusal(
            f"invalid model config {path}: shared_expert_combination_strategy {strategy!r} is not "
            "supported; supported: sum, average"
        )
    average = strategy == "average"
    sparsemixer_eps = None
    if ms.sparsemixer:
        if top_k != 2:
            raise Refusal(
                f"invalid model config {path}: SparseMixer routes each token to two experts, not {top_k}; "
                "set num_experts_per_tok to 2"
            )
        if keys.get("router_jitter_noise") is None:
            raise Refusal(
                f"invalid model config {path}: router_jitter_noise is not stated; SparseMixer's "
                "selection needs it"
            )
        sparsemixer_eps = float(keys.get("router_jitter_noise"))
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=width,
        scoring=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        renormalize=renormalize,
        scaling_factor=factor,
        router_bias=ms.router_bias,
        correction_bias=(ms.correction_bias or method == "noaux_tc")
        and not keys.get("hash_routing_vocab"),
        hash_vocab=int(keys.get("hash_routing_vocab", default=0) or 0),
        shared_intermediate_size=shared,
        shared_gate=ms.shared == "qwen" and shared > 0,
        expert_bias=ms.expert_bias,
        activation=ms.activation,
        shared_average=shared > 0 and average,
        swiglu_limit=float(keys.get("swiglu_limit", default=7.0)),
        swiglu_alpha=float(keys.get("swiglu_alpha", default=1.702)),
        sparsemixer_eps=sparsemixer_eps,
        latent_size=_latent_size(keys),
        shared_routed=shared_routed,
        router_scale=ms.router_scale,
        router_input_norm=ms.router_input_norm,
        identity_experts=int(keys.get("zero_expert_num", default=0) or 0),
        weight_input=bool(keys.get("moe_apply_router_weight_on_input", default=ms.weight_input)),
    )
    if moe.identity_experts and (
        method != "greedy" or shared or shared_routed or moe.latent_size or moe.weight_input
    ):
        raise Refusal(
            f"invalid model config {path}: zero_expert_num {moe.identity_experts} identity experts are "
            "supported only with greedy routing, no shared experts, no latent width and weighed outputs; "
            "set zero_expert_num to 0"
        )
    # Qwen: mlp_only_layers and decoder_sparse_step; DeepSeek: first_k_dense_replace and
    # moe_layer_freq
    only = set(keys.get("mlp_only_layers", default=[]) or [])
    # ERNIE 4.5: moe_layer_start_index / end (the last when negative) / interval; HunYuan:
    # moe_layer_num_skipped
    step = int(keys.get("decoder_sparse_step", "moe_layer_interval", default=1) or 1)
    first = int(
        keys.get(
            "first_k_dense_replace", "moe_layer_start_index", "moe_layer_num_skipped", default=0
        )
        or 0
    )
    freq = keys.get("moe_layer_freq", default=1) or 1
    if isinstance(freq, list):
        raise Refusal(
            f"invalid model config {path}: moe_layer_freq lists layers, which {spec.name} does not "
            "read; state the interval between sparse layers, or mlp_layer_types"
        )
    freq = int(freq)
    end = int(keys.get("moe_layer_end_index", default=-1))
    end = num_layers - 1 if end < 0 else end
    layers = tuple(
        i not in only and (i + 1) % step == 0 and first <= i <= end and i % freq == 0
        for i in range(num_layers)
    )
    kinds = keys.get("mlp_layer_types")  # GLM-4.7-Flash: stated per layer, "dense" or "sparse"
    if kinds:
        if len(kinds) != num_layers or not set(kinds) <= {"dense", "sparse"}:
            raise Refusal(
                f'invalid model config {path}: mlp_layer_types must list "dense" or "sparse" for '
                f"each of the {num_layers} layers"
            )
        layers = tuple(kind == "sparse" for kind in kinds)
    return moe, layers


def _per_layer(keys: Keys, *names: str, default=None) -> int:
    """A mixture-of-experts size stated once or once per layer (HunYuan's lists); differing values
    are refused."""
    value = keys.get(*names, default=default)
    if value is None:
        keys.need(*names)
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise Refusal(
                f"invalid model config {keys.path}: {' / '.join(names)} differs between layers "
                f"({value}); only one value for every layer is supported"
            )
        value = value[0]
    return int(value)


def _latent_size(keys: Keys) -> int:
    """moe_latent_size: the routed experts read fc1_latent_proj(x) this wide and return through
    fc2_latent_proj."""
    value = keys.get("moe_latent_size", default=None)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Refusal(
            f"invalid model config {keys.path}: moe_latent_size {value!r} is not a positive integer; "
            "set it to the experts' latent width or null"
        )
    return value

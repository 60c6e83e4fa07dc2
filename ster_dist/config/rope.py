"""Rotations read from a config: each layer's RopeConfig, sliding window and attention chunk
(config.py's rotation part).

Transformers 5's rope_parameters (one object, or one per layer type), the older top-level rope_theta
and rope_scaling, layer_types or the family's sliding rule (AttentionSpec.sliding), and the family's
conventions where a config is silent (PositionSpec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ster_dist.config.keys import Keys
from ster_dist.errors import Refusal
from ster_dist.families.spec import AttentionSpec, FamilySpec, PositionSpec

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic", "proportional")


@dataclass(frozen=True)
class RopeConfig:
    """The rotation one layer applies. rotary_dim is the rotated share of each head."""

    theta: float
    rotary_dim: int
    interleaved: bool = False  # adjacent pairs (GPT-J, Cohere) rather than halves
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    # longrope: cos/sin scale of the short table, in place of attention_factor
    short_mscale: float | None = None
    long_mscale: float | None = None  # longrope: the long table's (PhiMoE)
    # proportional (Gemma 4's full layers): rotary_dim is the whole head, of whose frequency pairs
    # only the first
    # `proportion` share turn (the rest at frequency zero pass through), each at its rate over the
    # whole head
    proportion: float = 1.0


def _rope_sources(keys: Keys, positions: PositionSpec) -> tuple[dict, dict]:
    """(rotation of full-attention layers, rotation of sliding layers) as rope_parameters-shaped
    dicts.

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
        full = {
            **{k: v for k, v in full.items() if k in ("rope_theta", "partial_rotary_factor")},
            **scaling,
        }
    theta = keys.get("rope_theta", "rotary_emb_base")
    if theta is not None:
        full["rope_theta"] = theta
    # Phi-3 states original_max_position_embeddings beside rope_scaling; Transformers gives it
    # priority
    original = keys.get("original_max_position_embeddings")
    if original is not None and (full.get("rope_type") or full.get("type")) in (
        "llama3",
        "yarn",
        "longrope",
    ):
        full["original_max_position_embeddings"] = original
    if sliding is None:
        sliding = dict(full)
    local_base = keys.get("rope_local_base_freq")
    if local_base is None and not nested:
        local_base = positions.local_theta
    if local_base is not None:
        sliding = {"rope_type": "default", "rope_theta": local_base}
    # OLMo 3: rope_scaling is for the full-attention layers
    elif positions.local_unscaled and not nested:
        sliding = {k: v for k, v in full.items() if k in ("rope_theta", "partial_rotary_factor")}
    return full, sliding


def _alpha_base(theta: float, alpha, head_dim: int, path: str) -> float:
    """HunYuan's dynamic base, theta * alpha ** (d / (d - 2)), or a refusal where it is no finite
    number (alpha itself is a finite number above 0 by now: config_ranges.check_rope)."""
    try:
        base = theta * alpha ** (head_dim / (head_dim - 2))
    except (OverflowError, ZeroDivisionError):
        base = math.inf
    if not math.isfinite(base):
        raise Refusal(
            f"invalid model config {path}: rope scaling alpha {alpha!r} with rope_theta {theta!r} and "
            f"head_dim {head_dim} gives no finite rotation base; correct it in config.json (or "
            "re-download the checkpoint)"
        )
    return base


def _rope(
    params: dict,
    head_dim: int,
    partial: float | None,
    interleaved: bool,
    default_theta: float,
    path: str,
    max_position: int,
    default_share: float = 1.0,
) -> RopeConfig:
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise Refusal(
            f"invalid model config {path}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if partial is None:
        partial = params.get("partial_rotary_factor") or default_share
    kw: dict = {}
    # the whole head is rotated, its unturned pairs at frequency zero
    if rope_type == "proportional":
        kw["proportion"], partial = float(partial), 1.0
    rotary_dim = int(head_dim * partial)
    rotary_dim -= rotary_dim % 2
    theta = params.get("rope_theta") or default_theta
    if (
        isinstance(theta, bool)
        or not isinstance(theta, (int, float))
        or not math.isfinite(theta)
        or theta <= 0
    ):
        raise Refusal(
            f"invalid model config {path}: rope_theta is {theta!r}; it must be a finite number above 0; "
            "correct it in config.json (or re-download the checkpoint)"
        )
    theta = float(theta)
    if rope_type == "dynamic":
        alpha = params.get("alpha")
        # HunYuan: a fixed larger base; plain dynamic is the plain rotation within max_position
        if alpha:
            theta = _alpha_base(theta, alpha, head_dim, path)
        rope_type = "default"
    if rope_type != "default":
        kw["factor"] = float(params.get("factor") or 1.0)
        kw["original_max_position"] = params.get("original_max_position_embeddings")
        kw["attention_factor"] = params.get("attention_factor")
    if rope_type == "llama3":
        # a stated null is the default, as for the other rope fields read with `or`
        low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
        kw.update(
            low_freq_factor=float(1.0 if low is None else low),
            high_freq_factor=float(4.0 if high is None else high),
        )
    elif rope_type == "yarn":
        kw.update(
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )
        if params.get("factor") is None and kw["original_max_position"]:
            kw["factor"] = max_position / kw["original_max_position"]
    elif rope_type == "longrope":
        kw.update(
            short_factor=tuple(params["short_factor"]), long_factor=tuple(params["long_factor"])
        )
        # one factor per rotated pair, as Transformers checks
        for key in ("short_factor", "long_factor"):
            if len(kw[key]) != rotary_dim // 2:
                raise Refusal(
                    f"invalid model config {path}: rope_parameters' {key} lists {len(kw[key])} factors "
                    f"but the heads rotate {rotary_dim // 2} pairs; it must list one per pair"
                )
        if params.get("short_mscale") is not None or params.get("long_mscale") is not None:
            short, long = params.get("short_mscale"), params.get("long_mscale")
            kw.update(
                short_mscale=float(1.0 if short is None else short),
                long_mscale=float(1.0 if long is None else long),
            )
        if params.get("factor") is None and kw["original_max_position"]:
            kw["factor"] = max_position / kw["original_max_position"]
    if rope_type != "default" and rope_type != "linear" and not kw.get("original_max_position"):
        kw["original_max_position"] = max_position
    return RopeConfig(
        theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, rope_type=rope_type, **kw
    )


def _layer_types(keys: Keys, attention: AttentionSpec, num_layers: int) -> list[str]:
    """Which layers attend through a sliding window: layer_types when stated, else the family's
    rule."""
    stated = keys.get("layer_types")
    if stated:
        if len(stated) != num_layers:
            raise Refusal(
                f"invalid model config {keys.path}: layer_types lists {len(stated)} layers "
                f"for {num_layers} hidden layers"
            )
        return list(stated)
    window = keys.get("sliding_window")
    rule = attention.sliding
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
        kinds = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    # Granite SWA: the first layer of each pattern attends fully
    elif rule == "pattern_first" and window:
        pattern = keys.get("sliding_window_pattern", default=4)
        kinds = [
            "full_attention" if i % pattern == 0 else "sliding_attention" for i in range(num_layers)
        ]
    return kinds


def _layer_bases(
    keys: Keys,
    bases: list,
    kinds: list[str],
    window,
    full: dict,
    sliding: dict,
    default_theta: float,
) -> dict:
    """Check layer_rope_theta against the two rotations a config holds (full-attention layers at
    rope_theta, sliding-window layers at one base) and return the sliding layers' rotation at their
    stated base."""
    if len(bases) != len(kinds):
        raise Refusal(
            f"invalid model config {keys.path}: layer_rope_theta lists {len(bases)} bases "
            f"for {len(kinds)} hidden layers"
        )
    full_theta = float(full.get("rope_theta") or default_theta)
    slides = [kind == "sliding_attention" and window is not None for kind in kinds]
    full_bases = {float(b) for b, slide in zip(bases, slides) if b and not slide}
    sliding_bases = {float(b) for b, slide in zip(bases, slides) if b and slide}
    if full_bases - {full_theta} or len(sliding_bases) > 1:
        raise Refusal(
            f"invalid model config {keys.path}: layer_rope_theta {bases} is not supported; "
            f"full-attention layers must rotate at rope_theta ({full_theta:g}) or not at all, and "
            "sliding-window layers at one base or not at all"
        )
    return {**sliding, "rope_theta": sliding_bases.pop()} if sliding_bases else sliding


def rotations(
    keys: Keys,
    spec: FamilySpec,
    num_layers: int,
    attends: tuple[bool, ...],
    moe_layers: tuple[bool, ...],
    head_dim: int,
    latent_rope_dim: int | None,
    max_position: int,
    alibi: bool,
    layer_head_dim: tuple[int, ...] = (),
) -> tuple[list[RopeConfig | None], list[int | None], list[int | None], dict]:
    """Each layer's rotation (None: it does not rotate), sliding window and attention chunk (None:
    full attention), and the full-attention layers' rotation parameters as stated. `attends`:
    whether each layer attends (empty: all do); `latent_rope_dim`: latent attention's rotated width,
    which rotates whole; `layer_head_dim`: each layer's head width where layers differ (Gemma 4)."""
    path, positions = keys.path, spec.positions
    kinds = _layer_types(keys, spec.attention, num_layers)
    window = keys.get("sliding_window")
    full_rope, sliding_rope = _rope_sources(keys, positions)
    # Granite SWA: a base per layer, zero for no rotation
    layer_bases = keys.get("layer_rope_theta")
    if layer_bases is not None:
        sliding_rope = _layer_bases(
            keys, layer_bases, kinds, window, full_rope, sliding_rope, positions.theta
        )
    partial = keys.get("partial_rotary_factor", "rotary_pct")
    if keys.get("rotary_dim") is not None:
        partial = keys.get("rotary_dim") / head_dim
    rope_dim, interleaved = (
        head_dim,
        bool(keys.get("rotate_adjacent_pairs", default=positions.interleaved)),
    )
    if latent_rope_dim is not None:
        rope_dim, partial = latent_rope_dim, 1.0
        interleaved = bool(keys.get("rope_interleave", default=positions.interleaved))
    layer_rope: list[RopeConfig | None] = []
    layer_window: list[int | None] = []
    layer_chunk: list[int | None] = []
    chunk = keys.get("attention_chunk_size")
    if "chunked_attention" in kinds and (
        isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
    ):
        raise Refusal(
            f"invalid model config {path}: layer_types lists chunked_attention layers but "
            f"attention_chunk_size is {chunk!r}; state a positive number of positions per chunk"
        )
    no_rope = keys.get("no_rope_layers")
    for i, kind in enumerate(kinds):
        if attends and not attends[i]:  # a recurrent layer: no rotation, no window
            layer_rope.append(None)
            layer_window.append(None)
            layer_chunk.append(None)
            continue
        if kind not in ("full_attention", "sliding_attention", "chunked_attention"):
            raise Refusal(
                f"invalid model config {path}: layer type {kind!r} (layer {i}) is not supported "
                f"for {spec.name}"
            )
        sliding = kind == "sliding_attention" and window is not None
        # Cohere 2 MoE: the dense layers of an MoE model rotate as sliding ones do
        dense_rotates = (
            bool(keys.get("dense_layers_rotate")) and bool(moe_layers) and not moe_layers[i]
        )
        if (
            positions.kind != "rope"
            or alibi
            or (no_rope is not None and not no_rope[i])
            or (layer_bases is not None and not layer_bases[i])
            or (
                positions.layers == "sliding"
                and window is not None
                and not sliding
                and not dense_rotates
            )
        ):
            layer_rope.append(None)
        else:
            layer_rope.append(
                _rope(
                    sliding_rope if sliding else full_rope,
                    layer_head_dim[i] if layer_head_dim else rope_dim,
                    partial,
                    interleaved,
                    positions.theta,
                    path,
                    max_position,
                    positions.rotary_share,
                )
            )
        layer_window.append(int(window) if sliding else None)
        layer_chunk.append(chunk if kind == "chunked_attention" else None)
    return layer_rope, layer_window, layer_chunk, full_rope


def yarn_mscale(rope: RopeConfig | None) -> float:
    """DeepSeek sharpens latent attention's scores by the square of the YaRN temperature of
    mscale_all_dim."""
    if rope is None or rope.rope_type == "default" or not rope.mscale_all_dim or rope.factor <= 1:
        return 1.0
    m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
    return m * m

"""FamilySpec: what one family adds to the shared decoder, as data.

A spec holds the family's conventions (norm kind, block layout, which config
keys switch biases or query/key norms on, how rotation is laid out) and its
checkpoint name map. The map is two-way: the loader reads checkpoint tensors
into decoder parameters through it, and the merge writer walks it backwards.

Name templates use {i} for the layer and {h} for an index stacked along the
parameter's first dimension (per-head norms, experts).
"""

from __future__ import annotations

import re
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
class Rule:
    """One checkpoint tensor template and where its data goes."""

    checkpoint: str
    target: str | Fused
    transposed: bool = False  # stored inputs-first (GPT-2's Conv1D)

    @property
    def pattern(self) -> re.Pattern:
        return _compile(self.checkpoint)


def _compile(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{h\}", r"(?P<h>\d+)")
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
    pre_norm: bool = True
    post_norm: bool = False
    parallel_block: bool = False
    parallel_key: str | None = None       # config key that turns the parallel block on
    parallel_shared_norm: bool = True
    positions: str = "rope"               # "rope" | "learned" | "none"
    position_offset: int = 0
    rope_interleaved: bool = False
    default_rope_theta: float = 10000.0
    default_local_rope_theta: float | None = None  # sliding layers' base when rope_local_base_freq is unstated
    sliding: str = "none"                 # "none" | "all" | "max_window_layers" | "even" | "pattern"
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
    tied_default: bool = False
    lm_head_bias: bool = False
    config_defaults: dict = field(default_factory=dict)
    refuse_keys: dict = field(default_factory=dict)  # config key -> why it is refused when truthy
    parity_reference: str | None = None   # the Transformers CausalLM class the parity tests compare with

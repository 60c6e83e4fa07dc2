"""The shard plan: for each checkpoint tensor, which rows and columns this rank reads and
where they land. A pure function of (FamilySpec, ModelConfig, the decoder's Shards, the
checkpoint's names and shapes) — no I/O, so it is tested without a process group. Which rule
owns a name is shard/names.py's NameMatcher.

The merge writer walks the same rules backwards; both read FamilySpec.rules only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.families.spec import FamilySpec, Fused, Rule, Stacked, target_name
from ster_dist.parallel.ctx import Shard
from ster_dist.shard.names import NameMatcher


@dataclass(frozen=True)
class Piece:
    """Copy source[rows, cols] (transposed when the source is inputs-first) into param[dst].

    A piece with a `window` reads that block of an N-d tensor instead (stacked experts), keeps
    every step-th entry from start along one axis when `take` = (axis, start, step) says so
    (interleaved parts), and swaps its last two dimensions when `transpose`."""

    rows: slice | None
    cols: slice | None
    dst: tuple[slice | int, ...]
    transpose: bool = False
    window: tuple[slice, ...] | None = None
    take: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Read:
    source: str
    param: str
    pieces: tuple[Piece, ...]
    stacked: bool = False  # fills one row of a stacked parameter ({h} and {e} templates)


@dataclass
class Plan:
    reads: list[Read]
    # checkpoint tensors that hold no weights of this rank (ignored, tied, other rows)
    skipped: list[str]
    expected: dict[str, int]  # param -> how many reads fill it

    def params(self) -> set[str]:
        return {r.param for r in self.reads}


def size_of(name: str, cfg: ModelConfig, layer: int | None = None) -> int:
    if name.startswith("linear_"):
        return _linear_size(name, cfg)
    if name.startswith("layer_"):
        return _layer_size(name, cfg, layer)
    return {
        "one": 1,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "heads_per_kv": cfg.num_heads // cfg.num_kv_heads if cfg.num_kv_heads else 0,
        "intermediate": cfg.intermediate_size,
        "head_dim": cfg.head_dim,
        # the shared experts' width, for a fused shared gate/up (GraniteMoE shared's
        # shared_mlp.input_linear)
        "shared_intermediate": cfg.moe.shared_intermediate_size if cfg.moe is not None else 0,
        # a Mamba layer's inner width, for its in_proj's x and z halves (the family's normalisation
        # states it)
        "mamba_intermediate": int(cfg.raw.get("mamba_intermediate_size") or 0),
    }[name]


def _linear_size(name: str, cfg: ModelConfig) -> int:
    """Sizes of gated delta-rule layers (Qwen3-Next's in_proj_qkvz and in_proj_ba group rows by key
    head)."""
    raw = cfg.raw
    key_heads, value_heads = raw["linear_num_key_heads"], raw["linear_num_value_heads"]
    return {
        "linear_key_heads": key_heads,
        "linear_key_head_dim": raw["linear_key_head_dim"],
        "linear_values_per_key": value_heads // key_heads,  # the value heads one key head serves
        "linear_value_group": value_heads // key_heads * raw["linear_value_head_dim"],  # their rows
        "linear_key_dim": key_heads * raw["linear_key_head_dim"],
        "linear_value_dim": value_heads * raw["linear_value_head_dim"],
    }[name]


def _layer_size(name: str, cfg: ModelConfig, layer: int | None) -> int:
    """Rows one key-value group of `layer` holds in a fused qkv_proj whose groups are the config's
    num_key_value_heads while the layer's own key-value heads differ (MiMo-V2's sliding layers hold
    two per group), so query, key and value rows are counted per layer, values at their own
    width."""
    if layer is None:
        raise ValueError(f"size {name} is per layer, and no layer was given")
    groups = cfg.num_kv_heads
    return {
        "layer_query_rows_per_group": cfg.heads(layer) // groups * cfg.head_dim,
        "layer_key_rows_per_group": cfg.kv_heads(layer) // groups * cfg.head_dim,
        "layer_value_rows_per_group": cfg.kv_heads(layer)
        // groups
        * (cfg.value_head_dim or cfg.head_dim),
    }[name]


def _runs(units: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive source units as (source start, source stop, destination offset) runs."""
    runs: list[list[int]] = []
    for offset, unit in enumerate(units):
        if runs and runs[-1][1] == unit:
            runs[-1][1] += 1
        else:
            runs.append([unit, unit + 1, offset])
    return [tuple(r) for r in runs]


def fused_source_rows(
    layout: Fused, part: int, dest_rows: tuple[int, int], cfg: ModelConfig, layer: int | None = None
) -> list[tuple[int, int, int]]:
    """Source row runs (start, stop, destination row offset) for global rows of one fused part."""
    unit = size_of(layout.unit, cfg)
    counts = [size_of(c, cfg, layer) for _, c in layout.parts]
    group_size = sum(counts)
    offset, count = sum(counts[:part]), counts[part]
    a, b = dest_rows
    if a % unit or b % unit:
        raise ValueError(f"rows {dest_rows} are not whole units of {unit}")
    units = [(u // count) * group_size + offset + u % count for u in range(a // unit, b // unit)]
    return [(s * unit, e * unit, d * unit) for s, e, d in _runs(units)]


def fused_rows_total(layout: Fused, cfg: ModelConfig, layer: int | None = None) -> int:
    groups = size_of(layout.groups, cfg)
    return groups * sum(size_of(c, cfg, layer) for _, c in layout.parts) * size_of(layout.unit, cfg)


def mtp_layer_pattern(cfg: ModelConfig) -> re.Pattern | None:
    """The tensors of the multi-token-prediction layers, where the family stores them
    (FamilySpec.mtp: DeepSeek-V3's layer 61 after the decoder's, eh_proj, enorm, hnorm, shared_head
    and a whole decoder layer; MiMo's model.mtp_layers.{k}), below a wrapper's prefix too:
    recognised, and never loaded for decoding."""
    if not cfg.mtp_layers:
        return None
    prefix = cfg.spec.mtp.prefix
    own = "{k}" in prefix  # numbered from 0 rather than after the decoder's layers
    indices = "|".join(str(k if own else cfg.num_layers + k) for k in range(cfg.mtp_layers))
    stored = (
        re.escape(prefix.removeprefix("model."))
        .replace(r"\{i\}", f"({indices})")
        .replace(r"\{k\}", f"({indices})")
    )
    return re.compile(rf"(.*\.)?{stored}")


def _plain(
    rule: Rule, param: str, shard: Shard, shape: tuple[int, ...], stack: int | None
) -> list[Piece] | None:
    """Pieces for a one-to-one tensor; None when this rank holds none of it."""
    t = rule.transposed
    if stack is not None:  # the source is row `stack` of the parameter
        if shard.dim is None:
            return [Piece(None, None, (stack,))]
        for a, b in shard.ranges:
            if a <= stack < b:
                return [Piece(None, None, (stack - a + _offset(shard, a),))]
        return None
    if shard.dim is None:
        return [Piece(None, None, (), transpose=t)]
    pieces, dst = [], 0
    for a, b in shard.ranges:
        window = slice(a, b)
        local = slice(dst, dst + b - a)
        if shard.dim == 0:
            pieces.append(
                Piece(None, window, (local,), True) if t else Piece(window, None, (local,))
            )
        else:
            pieces.append(
                Piece(window, None, (slice(None), local), True)
                if t
                else Piece(None, window, (slice(None), local))
            )
        dst += b - a
    return pieces


def _offset(shard: Shard, start: int) -> int:
    total = 0
    for a, b in shard.ranges:
        if a == start:
            return total
        total += b - a
    return total


def _expert_read(
    name: str, shape: tuple[int, ...], param: str, shard: Shard, expert: int, pieces: dict
) -> Read | None:
    """One expert's tensor into its row of a stacked [local experts, ...] parameter; None: not this
    rank's.
    `pieces`: the pieces made so far, by what they depend on: every layer's expert e reads the same
    window."""
    if shard.experts is None:
        raise Refusal(
            f"checkpoint tensor {name} is one expert's but {param} is not a stacked expert parameter; "
            "the family's name map is inconsistent"
        )
    want = shard.global_shape[1:]
    if tuple(want) != shape or not 0 <= expert < shard.global_shape[0]:
        raise Refusal(
            f"checkpoint tensor {name} has shape {list(shape)} but the config implies "
            f"{shard.global_shape[0]} experts of {list(want)} for {param}; the config and the weights "
            "disagree"
        )
    e0, e1 = shard.experts
    if not e0 <= expert < e1:
        return None
    key = (expert - e0, len(shape), shard.dim, shard.ranges)
    if key not in pieces:
        window = [slice(None)] * len(shape)
        if shard.dim is not None:  # this rank's tensor-parallel share within the expert
            ((a, b),) = shard.ranges
            window[shard.dim - 1] = slice(a, b)
        pieces[key] = (Piece(None, None, (expert - e0,), window=tuple(window)),)
    return Read(name, param, pieces[key], stacked=True)


def _stacked_reads(
    rule: Rule, name: str, shape: tuple[int, ...], layer: str | None, shards: dict[str, Shard]
) -> tuple[list[Read], list[str]]:
    """Reads of this rank's experts (and tensor-parallel share) out of one tensor holding every
    expert."""
    layout: Stacked = rule.target
    n = len(layout.parts)
    reads, absent = [], []
    for j, template in enumerate(layout.parts):
        param = template.replace("{i}", layer) if layer is not None else template
        shard = shards.get(param)
        if shard is None or shard.experts is None:
            absent.append(f"{name} (-> {param})")
            continue
        num, per = shard.global_shape[0], shard.global_shape[1:]
        p_total = per[0] * n
        if len(per) == 1:
            stored = (num, p_total)
        else:
            inner = (per[1], p_total) if layout.transposed else (p_total, per[1])
            stored = (num * inner[0], inner[1]) if layout.flat else (num, *inner)
        if shape != stored:
            raise Refusal(
                f"checkpoint tensor {name} has shape {list(shape)} but the config implies "
                f"{list(stored)} for {num} experts' {', '.join(layout.parts)}; the config and the "
                "weights disagree"
            )
        # this rank's output rows of each expert
        a, b = shard.ranges[0] if shard.dim == 1 else (0, per[0])
        if layout.interleaved:
            p_window, take = slice(a * n, b * n), j
        else:
            p_window, take = slice(j * per[0] + a, j * per[0] + b), None
        e0, e1 = shard.experts
        if len(per) == 1:
            pieces = [
                Piece(
                    None,
                    None,
                    (slice(None),),
                    window=(slice(e0, e1), p_window),
                    take=None if take is None else (-1, take, n),
                )
            ]
        else:
            q = slice(*shard.ranges[0]) if shard.dim == 2 else slice(0, per[1])
            within = (q, p_window) if layout.transposed else (p_window, q)
            p_axis = -1 if layout.transposed else -2
            take_ = None if take is None else (p_axis, take, n)
            if layout.flat:  # [experts * rows, cols]: one window per expert
                rows = inner[0]
                pieces = [
                    Piece(
                        None,
                        None,
                        (e - e0,),
                        layout.transposed,
                        window=(
                            slice(e * rows + within[0].start, e * rows + within[0].stop),
                            within[1],
                        ),
                        take=take_,
                    )
                    for e in range(e0, e1)
                ]
            else:
                pieces = [
                    Piece(
                        None,
                        None,
                        (slice(None),),
                        layout.transposed,
                        window=(slice(e0, e1), *within),
                        take=take_,
                    )
                ]
        reads.append(Read(name, param, tuple(pieces)))
    return reads, absent


def build_plan(
    spec: FamilySpec,
    cfg: ModelConfig,
    shards: dict[str, Shard],
    shapes: dict[str, tuple[int, ...]],
    tied_copies: frozenset[str] | set[str] = frozenset(),
    elsewhere: Callable[[str], bool] | None = None,
    matchers: dict | None = None,
) -> Plan:
    """`tied_copies`: parameters that are tied copies of another (parallel/linear.py
    tie_parameters); a checkpoint that stores their tensor too has it skipped, so the shared tensor
    is read once.
    `elsewhere(param)`: whether
    a parameter belongs to another pipeline stage (Decoder.elsewhere); its tensors are skipped,
    never read.
    `matchers`: NameMatchers by parameter names, kept by a caller planning several ranks, so ranks
    with the same parameter names (every tensor-parallel rank) match each checkpoint name once
    between them, and work out its rule's parameter names once (NameMatcher.owner): what is left per
    rank is its shards' arithmetic."""
    params = frozenset(shards)
    matchers = {} if matchers is None else matchers
    matcher = matchers.get(params) or matchers.setdefault(
        params, NameMatcher(spec, cfg.wrapper, set(params), set_aside=mtp_layer_pattern(cfg))
    )
    reads: list[Read] = []
    skipped: list[str] = []
    unmapped: list[str] = []
    absent: list[str] = []
    tied = cfg.tie_word_embeddings
    expert_pieces: dict = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if matcher.ignored(name):  # the spec ignores it, or a multi-token-prediction layer holds it
            skipped.append(name)
            continue
        owner = matcher.owner(name)
        if owner is None:
            unmapped.append(name)
            continue
        rule, groups, layer = owner.rule, owner.groups, owner.layer
        if elsewhere is not None and elsewhere(owner.first):
            skipped.append(name)  # another pipeline stage's tensor
            continue
        if isinstance(rule.target, Stacked):
            found_reads, found_absent = _stacked_reads(rule, name, tuple(shape), layer, shards)
            absent += found_absent
            if found_reads:
                reads += found_reads
            elif not found_absent:
                skipped.append(name)
            continue
        if owner.expert is not None:
            param = owner.param
            if param not in shards:
                absent.append(f"{name} (-> {param})")
                continue
            read = _expert_read(
                name, tuple(shape), param, shards[param], owner.expert, expert_pieces
            )
            if read is None:
                skipped.append(name)  # another expert-parallel rank's expert: never read here
            else:
                reads.append(read)
            continue
        if isinstance(rule.target, str):
            param = owner.param
            if param in tied_copies:
                skipped.append(name)  # a tied copy: the tensor of the layer it is tied to fills it
                continue
            if param not in shards:
                if param.startswith("lm_head.weight") and tied:
                    skipped.append(name)  # a tied head: the embedding is the weight
                elif rule.optional:
                    skipped.append(name)  # stored in a layer that never applies it
                else:
                    absent.append(f"{name} (-> {param})")
                continue
            shard = shards[param]
            stack = owner.row
            want = shard.global_shape[1:] if stack is not None else shard.global_shape
            got = tuple(reversed(shape)) if rule.transposed and len(shape) == 2 else tuple(shape)
            # a leading dimension of one (ERNIE's [1, experts] bias)
            if stack is None and got == (1, *want):
                got = got[1:]
            if tuple(want) != got:
                raise Refusal(
                    f"checkpoint tensor {name} has shape {list(shape)} but the config implies "
                    f"{list(want)} for {param}; the config and the weights disagree"
                )
            pieces = _plain(rule, param, shard, shape, stack)
            if pieces is None:
                skipped.append(name)
            else:
                reads.append(Read(name, param, tuple(pieces), stacked=stack is not None))
            continue
        layout: Fused = rule.target
        layer_index = int(layer) if layer is not None else None
        total = fused_rows_total(layout, cfg, layer_index)
        rows_dim = 1 if rule.transposed else 0
        if shape[rows_dim] != total or (len(shape) == 2 and shape[1 - rows_dim] != cfg.hidden_size):
            raise Refusal(
                f"checkpoint tensor {name} has shape {list(shape)} but the config implies "
                f"{total} fused rows of width {cfg.hidden_size}; the config and the weights disagree"
            )
        if all(target_name(template, groups) in tied_copies for template, _ in layout.parts):
            skipped.append(name)  # a tied copy, as above
            continue
        for index, (template, _) in enumerate(layout.parts):
            param = target_name(template, groups)
            if param not in shards:
                absent.append(f"{name} (-> {param})")
                continue
            shard = shards[param]
            ranges = shard.ranges if shard.dim == 0 else ((0, shard.global_shape[0]),)
            pieces, dst = [], 0
            for a, b in ranges:
                for s, e, d in fused_source_rows(layout, index, (a, b), cfg, layer_index):
                    local = slice(dst + d, dst + d + e - s)
                    pieces.append(
                        Piece(None, slice(s, e), (local,), True)
                        if rule.transposed
                        else Piece(slice(s, e), None, (local,))
                    )
                dst += b - a
            reads.append(Read(name, param, tuple(pieces)))
    if unmapped:
        raise Refusal(
            f"checkpoint tensor {unmapped[0]} is not mapped by the {spec.name} name map "
            f"({len(unmapped)} unmapped in all: {', '.join(unmapped[:5])}); "
            "this checkpoint's layout is not the family's"
        )
    if absent:
        raise Refusal(
            f"checkpoint tensor {absent[0]} has no parameter in this model "
            f"({len(absent)} in all); the config turns that part off (a bias or norm?) but the "
            "weights carry it"
        )
    expected: dict[str, int] = {}
    for read in reads:
        expected[read.param] = expected.get(read.param, 0) + 1
    return Plan(reads, skipped, expected)

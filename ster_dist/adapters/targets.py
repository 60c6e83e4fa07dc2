"""Adapter targets mapped onto the decoder's projections through the family's name map.

The FamilySpec rules that load a checkpoint also place an adapter. A PEFT module names a
checkpoint tensor (q_proj, qkv_proj, c_attn, query_key_value, ...): the rules map it onto
decoder parameters, and the B rows of a fused tensor are split into its parts by the same
`fused_source_rows` the loader splits its weight rows by. A Ster target (query, key, value,
output, gate, up, down) names the decoder parameter directly. Either way the result is a list of
Sites in the decoder's own names and global shapes: attach.py splits them over ranks, and the
merge walks them back into the checkpoint's tensors through shard/writer.placements.

Adapters are made on Transformers' checkpoints: PEFT modules are matched by the family's
Transformers name map whatever the base's format, and their B rows are in Transformers' row order. A
base whose query and key rows are stored in rotation-pair order (Mistral's own format,
FamilySpec.pair_rows) gets those B rows put in that order once, here, so the merge and the runtime
attach both see them right.

Which targets a family takes is decided here, from the header and config alone, before any
factor is read (seeds/000): a gate on a plain feed-forward, feed-forward targets on a
mixture-of-experts layer, any adapter on a state-space family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from ster_dist.adapters.format import TARGETS, Adapter, Factor, same_model
from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.families.adapter_rules import REFUSED_FAMILIES, TARGETS_REFUSED
from ster_dist.families.spec import Fused
from ster_dist.parallel.ctx import SINGLE, Shard
from ster_dist.shard.names import NameMatcher
from ster_dist.shard.plan import fused_rows_total, fused_source_rows
from ster_dist.shard.writer import one_thread, part_rows

PARAMS = {
    "query": "attn.q",
    "key": "attn.k",
    "value": "attn.v",
    "output": "attn.o",
    "gate": "mlp.gate",
    "up": "mlp.up",
    "down": "mlp.down",
}
_TARGET_OF = {param: target for target, param in PARAMS.items()}
_PARAM = re.compile(r"layers\.(\d+)\.(attn\.[qkvo]|mlp\.(?:gate|up|down))\.weight")
_FEED_FORWARD = ("gate", "up", "down")

# Families whose layers have no projection an adapter could correct (seeds/000). This belongs
# in FamilySpec as data once those families have specs; until then it is named here.


@dataclass(frozen=True)
class SitePlan:
    """One decoder projection an adapter factor lands on, before the factor is read."""

    layer: int
    target: str
    param: str  # "layers.{i}.attn.q.weight"
    factor: Factor
    rows: tuple[tuple[int, int, int], ...] | None  # B rows of a fused PEFT module this part takes
    module_rows: int | None = None  # all rows of that fused module's B
    # head_dim: B's rows go from halves to pair order per head
    pairs: int | None = None


@dataclass
class Site:
    """A low-rank update (b @ a) * scale of one decoder projection, global shapes."""

    layer: int
    target: str
    param: str
    a: torch.Tensor  # [rank, inputs]
    b: torch.Tensor  # [outputs, rank]
    scale: float
    source: str  # the adapter's own name for it


def refuse_family(family: str) -> None:
    if family in REFUSED_FAMILIES:
        raise Refusal(f"adapters on {family} are refused: {REFUSED_FAMILIES[family]}")


def check_model(adapter: Adapter, model: str) -> None:
    """An adapter made for another model is refused by the names both state."""
    if not same_model(adapter.model, model):
        raise Refusal(
            f'adapter was trained for model "{adapter.model}", current model is "{model}"'
        )


def decoder_shards(cfg: ModelConfig) -> dict[str, Shard]:
    """Every decoder parameter's global shape, from a decoder built on the meta device (no
    memory)."""
    from ster_dist.model.decoder import Decoder

    with torch.device("meta"):
        return Decoder(cfg, SINGLE).shards()


def plan_sites(
    adapter: Adapter, cfg: ModelConfig, shards: dict[str, Shard] | None = None
) -> list[SitePlan]:
    """Map every factor onto decoder projections and check families, layers and shapes."""
    refuse_family(cfg.family)
    shards = shards if shards is not None else decoder_shards(cfg)
    if adapter.hidden_size is not None and adapter.hidden_size != cfg.hidden_size:
        raise Refusal(
            f"adapter width {adapter.hidden_size} does not match model width {cfg.hidden_size}"
        )
    plans = _ster_sites(adapter) if adapter.format == "ster" else _peft_sites(adapter, cfg)
    _check_targets(plans, cfg, shards)
    for plan in plans:
        _check_shape(plan, cfg, shards)
    pairs = cfg.spec.pair_rows
    return [replace(p, pairs=cfg.head_dim) if PARAMS[p.target] in pairs else p for p in plans]


def load_sites(adapter: Adapter, plans: list[SitePlan]) -> list[Site]:
    """Read the factors (f32) and give each projection its own B rows."""
    factors = adapter.read_factors()
    sites = []
    with one_thread():  # many small copies: barrier stalls on busy cores cost more than the work
        for plan in plans:
            a, b = (t.float() for t in factors[plan.factor.key])
            if plan.rows is not None:
                b = torch.cat([b[s:e] for s, e, _ in plan.rows])
            if plan.pairs:
                b = halves_to_pairs(b, plan.pairs)
            sites.append(
                Site(plan.layer, plan.target, plan.param, a, b, plan.factor.scale, plan.factor.key)
            )
    return sites


def halves_to_pairs(b: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's rows from Transformers' order (the first of every rotation pair, then the second)
    to adjacent pairs (Mistral's native order): the inverse of Transformers' convert_mistral_weights
    permute."""
    rows, rank = b.shape
    return (
        b.reshape(rows // head_dim, 2, head_dim // 2, rank)
        .transpose(1, 2)
        .reshape(rows, rank)
        .contiguous()
    )


def sites_for(adapter: Adapter, cfg: ModelConfig, model: str) -> list[Site]:
    check_model(adapter, model)
    return load_sites(adapter, plan_sites(adapter, cfg))


def summary(plans: list[SitePlan] | list[Site]) -> dict:
    return {
        "targets": [t for t in TARGETS if any(p.target == t for p in plans)],
        "layers": sorted({p.layer for p in plans}),
    }


# ---- the two formats ---------------------------------------------------------------------------


def _ster_sites(adapter: Adapter) -> list[SitePlan]:
    plans = []
    for factor in adapter.factors:
        _, layer, target = factor.key.split(".")
        plans.append(
            SitePlan(int(layer), target, f"layers.{layer}.{PARAMS[target]}.weight", factor, None)
        )
    return plans


def _peft_sites(adapter: Adapter, cfg: ModelConfig) -> list[SitePlan]:
    matcher = NameMatcher(cfg.transformers_spec, cfg.wrapper)
    plans = []
    for factor in adapter.factors:
        tensor = f"{factor.key}.weight"
        found = None if matcher.ignored(tensor) else matcher.match(tensor)
        if found is None:
            raise Refusal(
                f"adapter module {factor.key} names no tensor of the {cfg.family} name map; the adapter "
                f"was made for another architecture than this {cfg.family} model"
            )
        rule, groups = found
        layer = groups.get("i")
        total = None
        if isinstance(rule.target, str):
            parts = [(rule.target.replace("{i}", layer or ""), None)]
        else:
            layout: Fused = rule.target
            at = int(layer) if layer is not None else None
            total = fused_rows_total(layout, cfg, at)
            parts = [
                (
                    template.replace("{i}", layer or ""),
                    tuple(
                        fused_source_rows(
                            layout, index, (0, part_rows(layout, count, cfg, at)), cfg, at
                        )
                    ),
                )
                for index, (template, count) in enumerate(layout.parts)
            ]
        for param, rows in parts:
            if param.endswith(".attn.q_down.weight"):  # q_proj of a query bottleneck (Step3)
                _refuse_query_on_a_bottleneck(cfg)
            m = _PARAM.fullmatch(param) if groups.get("h") is None else None
            if m is None:
                raise Refusal(
                    f"adapter module {factor.key} adapts {param}, which is not an attention or "
                    "feed-forward projection; ster_dist adapts query, key, value, output, gate, up "
                    "and down only"
                )
            plans.append(
                SitePlan(int(m.group(1)), _TARGET_OF[m.group(2)], param, factor, rows, total)
            )
    return plans


# ---- checks ------------------------------------------------------------------------------------


def _refuse_query_on_a_bottleneck(cfg: ModelConfig) -> None:
    if cfg.query_bottleneck:
        raise Refusal(
            f"an adapter on query is refused for {cfg.family}: q reads the query bottleneck rather than "
            "the hidden state; train the adapter on key, value, output, gate, up and down"
        )


def _check_targets(plans: list[SitePlan], cfg: ModelConfig, shards: dict[str, Shard]) -> None:
    refused, why = TARGETS_REFUSED.get(cfg.family, ((), ""))
    named = [t for t in PARAMS if t in refused and any(p.target == t for p in plans)]
    if named:
        raise Refusal(
            f"the {', '.join(named)} target{'s are' if len(named) > 1 else ' is'} refused on "
            f"{cfg.family}: {why}"
        )
    if any(p.target == "query" for p in plans):
        _refuse_query_on_a_bottleneck(cfg)
    if not cfg.mlp_gated and any(p.target == "gate" for p in plans):
        raise Refusal(
            f"the {cfg.family} feed-forward is plain (no gate), so an adapter naming gate is refused; "
            "drop gate from the adapter's targets"
        )
    for plan in plans:
        if plan.param in shards:
            continue
        if plan.layer >= cfg.num_layers:
            raise Refusal(
                f"layer {plan.layer} is outside the model's 0..{cfg.num_layers - 1} range; the adapter "
                "was trained for a deeper model"
            )
        if plan.target in _FEED_FORWARD and cfg.moe_layers and cfg.moe_layers[plan.layer]:
            raise Refusal(
                f"adapters on {cfg.family} sit on attention only: layer {plan.layer}'s feed-forward "
                f"is a mixture of experts, so the {plan.target} target is refused; train the adapter "
                "on query, key, value and output"
            )
        raise Refusal(
            f"this {cfg.family} model has no {plan.target} projection at layer {plan.layer} to adapt"
        )


def _check_shape(plan: SitePlan, cfg: ModelConfig, shards: dict[str, Shard]) -> None:
    outputs, inputs = shards[plan.param].global_shape
    factor = plan.factor
    want_b = plan.module_rows or outputs
    got_in, got_out = factor.a_shape[1], factor.b_shape[0]
    if got_in != inputs:
        if inputs == cfg.hidden_size:
            raise Refusal(f"adapter width {got_in} does not match model width {cfg.hidden_size}")
        raise Refusal(
            f"adapter tensor {factor.a} has shape {list(factor.a_shape)}, expected "
            f"[{factor.rank}, {inputs}] for the model's {plan.target} projection of layer {plan.layer}"
        )
    if got_out != want_b:
        if want_b == cfg.hidden_size:
            raise Refusal(f"adapter width {got_out} does not match model width {cfg.hidden_size}")
        raise Refusal(
            f"adapter tensor {factor.b} has shape {list(factor.b_shape)}, expected "
            f"[{want_b}, {factor.rank}] for the model's {plan.target} projection of layer {plan.layer}"
        )

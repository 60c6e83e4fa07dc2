"""Trainable LoRA factors on the decoder's projections, through the runtime-adapter mechanism.

A runtime adapter (adapters/attach.py, engine/modifiers.py) is a LowRank on a ColumnLinear /
RowLinear:
this rank's share of A and B, cut from the projection's Shard by parallel.linear.low_rank_share.
Training attaches plain LowRank objects; what changes is where their factors come from. The
trainable parameters are the global factors, every rank holding them whole, and before each forward
`refresh` cuts each rank's share from them again, through TrainCtx.sum_grad, so the cut is
differentiable and each factor's gradient is summed over the tensor-parallel ranks (tune/parallel.py
says why that sum is the gradient).

Sites are planned from the checkpoint's own tensor names (shard/writer.placements, the merge's
inverse of the loader), because the adapter is written under them: the parts of a fused tensor
(Phi-3's qkv_proj, GPT-2's c_attn, GPT-NeoX's query_key_value) share one A, as PEFT's one lora_A
of that module does, and each part's B is its rows of the module's lora_B.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ster_dist.adapters.targets import PARAMS, decoder_shards
from ster_dist.checkpoint import Checkpoint
from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.parallel.linear import LowRank, low_rank_share as share
from ster_dist.shard.writer import placements


@dataclass(frozen=True)
class TrainSite:
    """One adapted decoder projection and where its rows sit in the checkpoint module it is written
    under."""

    layer: int
    target: str
    param: str  # "layers.{i}.attn.q.weight"
    module: str  # "model.layers.{i}.self_attn.q_proj"
    # (module row start, stop, site row offset); None: all rows
    runs: tuple[tuple[int, int, int], ...] | None
    module_rows: int
    inputs: int
    outputs: int
    # the module stores inputs first (GPT-2's Conv1D)
    transposed: bool


def plan_sites(
    cfg: ModelConfig, checkpoint: Checkpoint, targets: tuple[str, ...], layers: tuple[int, ...]
) -> list[TrainSite]:
    """Every (layer, target) mapped onto a decoder projection and a checkpoint module; headers
    only."""
    from ster_dist.adapters.merge import index_weights
    from ster_dist.tune.spec import check_targets

    shards = decoder_shards(cfg)
    check_targets(cfg, targets, layers, set(shards))
    wanted = [
        (layer, target, f"layers.{layer}.{PARAMS[target]}.weight")
        for layer in layers
        for target in targets
    ]
    entries = index_weights(list(checkpoint.weight_files))
    where = placements(cfg.spec, cfg, list(entries), {param for _, _, param in wanted})
    sites = []
    for layer, target, param in wanted:
        if param not in where:
            raise Refusal(
                f"checkpoint has no tensor holding the {target} projection of layer {layer} ({param}) "
                "to write the adapter under"
            )
        placed = where[param]
        shape = entries[placed.tensor]["shape"]
        outputs, inputs = shards[param].global_shape
        sites.append(
            TrainSite(
                layer,
                target,
                param,
                placed.tensor.removesuffix(".weight"),
                placed.runs,
                shape[1] if placed.transposed else shape[0],
                inputs,
                outputs,
                placed.transposed,
            )
        )
    return sites


def modules_of(sites: list[TrainSite]) -> list[str]:
    """The checkpoint modules the sites live in, in site order, each once."""
    return list(dict.fromkeys(site.module for site in sites))


class LoraFactors(nn.Module):
    """The global factors: A [rank, inputs] per checkpoint module, B [outputs, rank] per site.

    A starts as PEFT's (Kaiming-uniform, bound 1 / sqrt(inputs)), B at zero, so the adapter starts
    as no change; both from one generator seeded by the run's seed, the same on every rank."""

    def __init__(self, sites: list[TrainSite], rank: int, seed: int, b_init_std: float = 0.0):
        super().__init__()
        self.modules_ = modules_of(sites)
        generator = torch.Generator().manual_seed(seed)
        inputs = {site.module: site.inputs for site in sites}
        self.a = nn.ParameterList()
        for module in self.modules_:
            bound = 1.0 / math.sqrt(inputs[module])
            self.a.append(
                nn.Parameter(
                    torch.rand(rank, inputs[module], generator=generator) * 2 * bound - bound
                )
            )
        self.b = nn.ParameterList()
        for site in sites:
            b = (
                torch.randn(site.outputs, rank, generator=generator) * b_init_std
                if b_init_std
                else torch.zeros(site.outputs, rank)
            )
            self.b.append(nn.Parameter(b))
        self.a_of = [self.modules_.index(site.module) for site in sites]


class Attached:
    """The factors attached to one decoder (this rank's) as LowRanks; refresh before every
    forward."""

    def __init__(self, decoder, factors: LoraFactors, sites: list[TrainSite], scale: float, ctx):
        self.factors, self.ctx = factors, ctx
        modules = dict(decoder.named_modules())
        self.entries = []
        for site in sites:
            module = modules.get(site.param.rsplit(".", 1)[0])
            if module is None or not hasattr(module, "adapters"):
                raise Refusal(f"this model has no projection {site.param} to train an adapter on")
            low = LowRank(None, None, scale)
            module.adapters.append(low)
            self.entries.append((module, low))

    def refresh(self) -> None:
        """Cut this rank's shares from the global factors, differentiably."""
        a_used = [self.ctx.sum_grad(a) for a in self.factors.a]
        for index, (module, low) in enumerate(self.entries):
            dtype = module.weight.dtype
            b_used = self.ctx.sum_grad(self.factors.b[index])
            low.a, low.b = share(
                a_used[self.factors.a_of[index]].to(dtype),
                b_used.to(dtype),
                module.shards["weight"],
            )

    @contextlib.contextmanager
    def skipped(self):
        """The decoder without these factors, for the duration: the frozen base, which DPO's
        reference is."""
        kept = [(module, list(module.adapters)) for module, _ in self.entries]
        for module, low in self.entries:
            module.adapters[:] = [x for x in module.adapters if x is not low]
        try:
            yield
        finally:
            for module, adapters in kept:
                module.adapters[:] = adapters

    def detach(self) -> None:
        for module, low in self.entries:
            module.adapters[:] = [x for x in module.adapters if x is not low]
        self.entries = []


def global_factors(
    factors: dict[str, torch.Tensor], sites: list[TrainSite]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) per site from a {"a.{i}": ..., "b.{j}": ...} state (f32), A shared within a module."""
    modules = modules_of(sites)
    return [
        (factors[f"a.{modules.index(site.module)}"], factors[f"b.{j}"])
        for j, site in enumerate(sites)
    ]

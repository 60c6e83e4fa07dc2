"""Steering vectors and LoRA adapters on one rank: the one modifier mechanism, per row.

Each request of an engine step may carry its own steering vector and strength and its own adapter.
Vectors and adapters are registered once under a key; each step names, per key, the packed token
rows it applies to. Steering adds strength x vector to those rows of the residual after the
vector's layer; an adapter adds (x A^T) B^T x scale to those rows of each projection it targets,
gathered per adapter as S-LoRA and Punica batch them, so requests without it pay nothing but an
index. The engine's rows are set before a step's forward and cleared after, so a forward outside
the engine (capture, parity) sees neither.

A whole-batch modifier is the same thing with ALL_ROWS: `steer_every_row` and `adapt_every_row`
apply to every row of every forward until detached (capture, steer's runs, a test's reference), and
`StandingModifiers` does so on every rank of a group under a token (steer/attach.py and
adapters/attach.py call it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ster_dist.errors import Refusal
from ster_dist.parallel.linear import LowRank, low_rank_share
from ster_dist.workers.extension import RankExtension

ALL_ROWS = slice(None)  # a whole-batch modifier's rows: every row of any forward, of any shape


class RowSteering:
    """Registered vectors and, for the step running now, which rows each (vector, strength)
    steers."""

    def __init__(self, model):
        self.model = model
        self.vectors: dict[str, list[tuple[int, torch.Tensor]]] = {}
        # layer -> (rows, shift)
        self._shifts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooked: dict[int, object] = {}  # layer -> remover

    def register(self, key: str, vectors: list[tuple[int, torch.Tensor]]) -> None:
        self.vectors[key] = vectors
        for layer, _ in vectors:
            if layer not in self._hooked:
                self._hooked[layer] = self.model.add_hook(layer, self._hook(layer))

    def set_rows(self, groups: dict[tuple[str, float], torch.Tensor]) -> None:
        """groups: (vector key, strength) -> packed token rows it steers this step."""
        self._shifts = {}
        model = self.model
        for (key, strength), rows in groups.items():
            for layer, vector in self.vectors[key]:
                # the same rounding as steering a whole batch (steer/attach.py), so a request steers
                # alike alone
                shift = (vector.double() * float(strength)).to(model.dtype).to(model.device)
                self._shifts.setdefault(layer, []).append((rows, shift))

    def clear(self) -> None:
        self._shifts = {}

    def _hook(self, layer: int):
        def hook(h: torch.Tensor):
            for rows, shift in self._shifts.get(layer, ()):
                # out of place: a forward under autograd (training) keeps its graph
                if rows is ALL_ROWS:
                    h = h + shift
                else:
                    h[0, rows] += shift
            return h

        return hook

    def close(self) -> None:
        for remove in self._hooked.values():
            remove()
        self._hooked, self.vectors, self._shifts = {}, {}, {}


class RoutedLowRank(LowRank):
    """An adapter that applies only to the packed rows its routing names for the current step."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float, routing: dict, name: str):
        super().__init__(a, b, scale)
        self.routing, self.name = routing, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor | float:
        rows = self.routing.get(self.name)
        if rows is None:
            return 0.0
        if rows is ALL_ROWS:
            return super().__call__(x)
        picked = x[0, rows]
        out = x.new_zeros(*x.shape[:-1], self.b.shape[0])
        out[0, rows] = F.linear(F.linear(picked, self.a), self.b) * self.scale
        return out


class RowAdapters:
    """Registered adapters (name -> the routed factors attached to each projection) and this step's
    routing."""

    def __init__(self, model):
        self.model = model
        self.routing: dict[str, torch.Tensor] = {}
        self.attached: dict[str, list[tuple[object, LowRank]]] = {}

    def register(self, name: str, sites: list[dict], every_row: bool = False) -> None:
        """Attach `sites` under `name`, routed per step (set_rows), or to every row of every
        forward: a plain LowRank, which a compiled graph traces as it traces the projection (no
        routing to guard on)."""
        if name in self.attached:
            return
        modules = dict(self.model.named_modules())
        attached = []
        for site in sites:
            if self.model.elsewhere(site["param"]):  # another pipeline stage's projection
                continue
            module = modules.get(site["param"].rsplit(".", 1)[0])
            if module is None or not hasattr(module, "adapters"):
                raise Refusal(
                    f"this model has no projection {site['param']} to attach adapter {name} to"
                )
            # a kept FP8 weight's compute dtype
            device, dtype = module.weight.device, module.dtype_of()
            a, b = low_rank_share(site["a"], site["b"], module.shards["weight"])
            a, b = a.to(device, dtype), b.to(device, dtype)
            low = (
                LowRank(a, b, float(site["scale"]))
                if every_row
                else RoutedLowRank(a, b, float(site["scale"]), self.routing, name)
            )
            module.adapters.append(low)
            attached.append((module, low))
        self.attached[name] = attached

    def replace(self, name: str, sites: list[dict]) -> None:
        """New values for a registered adapter's factors, copied into the tensors already attached
        (the same projections, ranks and shapes; the base is not touched): a trainer pushing its
        factors after each step."""
        attached = self.attached.get(name)
        if attached is None:
            raise Refusal(
                f"adapter {name} is not registered on this rank; register it before replacing its factors"
            )
        by_param = {
            site["param"]: site for site in sites if not self.model.elsewhere(site["param"])
        }
        if len(by_param) != len(attached):
            raise Refusal(
                f"adapter {name} is attached to {len(attached)} projections here, the new factors name "
                f"{len(by_param)}; register a new adapter for another set of projections"
            )
        modules = {id(module): path for path, module in self.model.named_modules()}
        for module, low in attached:
            site = by_param.get(modules[id(module)] + ".weight")
            if site is None:
                raise Refusal(
                    f"the new factors of adapter {name} miss projection {modules[id(module)]}"
                )
            a, b = low_rank_share(site["a"], site["b"], module.shards["weight"])
            if a.shape != low.a.shape or b.shape != low.b.shape:
                raise Refusal(
                    f"the new factors of adapter {name} at {modules[id(module)]} have other shapes; "
                    "register a new adapter"
                )
            low.a.copy_(a)
            low.b.copy_(b)
            low.scale = float(site["scale"])

    def set_rows(self, groups: dict[str, torch.Tensor]) -> None:
        self.routing.clear()
        self.routing.update(groups)

    def clear(self) -> None:
        self.routing.clear()

    def close(self) -> None:
        for attached in self.attached.values():
            for module, low in attached:
                module.adapters[:] = [x for x in module.adapters if x is not low]
        self.attached = {}


def steer_every_row(
    model, vectors: list[tuple[int, torch.Tensor]], strength: float
) -> Callable[[], None]:
    """Add strength x vector to the residual after each vector's layer on every forward of `model`;
    returns the remover."""
    steering = RowSteering(model)
    steering.register("every row", vectors)
    steering.set_rows({("every row", strength): ALL_ROWS})
    return steering.close


def adapt_every_row(model, sites: list[dict], name: str = "every row") -> Callable[[], None]:
    """Attach an adapter's global factors (per projection: param, a, b, scale) to `model`, this
    rank's share of each (another pipeline stage's projections are that stage's), for every forward;
    returns detach."""
    adapters = RowAdapters(model)
    adapters.register(name, sites, every_row=True)
    return adapters.close


class StandingModifiers(RankExtension):
    """Steering and adapters applied to every row on this rank for a whole operation (capture,
    steer's own runs), each under the driver's token: token -> its remover."""

    def __init__(self, rank):
        super().__init__(rank)
        self.attached: dict[str, Callable[[], None]] = {}

    def steer(self, token: str, vectors: list[tuple[int, torch.Tensor]], strength: float) -> int:
        self.attached[token] = steer_every_row(self.model, vectors, strength)
        return len(vectors)

    def adapt(self, token: str, sites: list[dict]) -> dict:
        self.attached[token] = adapt_every_row(self.model, sites, token)
        return {"rank": self.rank.rank, "sites": len(sites)}

    def detach(self, token: str) -> bool:
        remove = self.attached.pop(token, None)
        if remove is not None:
            remove()
        return remove is not None

    def close(self) -> None:
        for token in list(self.attached):
            self.detach(token)

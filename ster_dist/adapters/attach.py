"""Runtime adapters: a LoRA adapter applied unmerged, x @ A^T @ B^T * scale beside each projection.

The driver opens and checks the adapter once against the session's model (another model or
width, targets the family cannot take, a steering vector passed as an adapter), maps it onto
decoder projections (targets.py) and sends the global factors to every rank. Each rank cuts its
own share from the projection's Shard, the same record the loader read its weight slice by: a
column-parallel projection (query, key, value, gate, up) keeps A whole and its own rows of B;
a row-parallel one (output, down) keeps its own columns of A and B whole, and its partial sum is
all-reduced together with the base's (parallel/linear.py).

attach_for_cli is what `--adapter` on generate, capture and steer calls (commands/common.py
modifiers); attach is the same on one Decoder for library use.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

from ster_dist.adapters.format import open_adapter
from ster_dist.adapters.targets import (
    Site,
    check_model,
    load_sites,
    plan_sites,
    refuse_family,
    summary,
)
from ster_dist.errors import Refusal
from ster_dist.parallel.linear import LowRank, low_rank_share as share
from ster_dist.workers.extension import RankExtension


def attach(model, sites: list[Site] | list[dict]) -> Callable[[], None]:
    """Attach every site to its projection of `model` (a Decoder, possibly one TP rank's, or one pipeline
    stage's: another stage's sites are that stage's to attach); returns detach."""
    modules = dict(model.named_modules())
    attached: list[tuple[object, LowRank]] = []
    for site in sites:
        site = site if isinstance(site, dict) else vars(site)
        if model.elsewhere(site["param"]):
            continue
        module = modules.get(site["param"].rsplit(".", 1)[0])
        if module is None or not hasattr(module, "adapters"):
            raise Refusal(f"this model has no projection {site['param']} to attach the adapter to")
        device, dtype = module.weight.device, module.dtype_of()  # a kept FP8 weight's compute dtype
        a, b = share(site["a"], site["b"], module.shards["weight"])
        low = LowRank(a.to(device, dtype), b.to(device, dtype), float(site["scale"]))
        module.adapters.append(low)
        attached.append((module, low))

    def detach() -> None:
        for module, low in attached:
            module.adapters[:] = [x for x in module.adapters if x is not low]
        attached.clear()

    return detach


class AdaptersOnRank(RankExtension):
    """The adapters attached on one rank: token -> that attachment's detach."""

    def __init__(self, rank):
        super().__init__(rank)
        self.attached: dict[str, Callable[[], None]] = {}

    def attach(self, payload: dict) -> dict:
        """Rank side of attach_for_cli: payload is {"token", "sites": global factors per projection}."""
        self.attached[payload["token"]] = attach(self.model, payload["sites"])
        return {"rank": self.rank.rank, "sites": len(payload["sites"])}

    def detach(self, token: str) -> bool:
        undo = self.attached.pop(token, None)
        if undo is not None:
            undo()
        return undo is not None

    def close(self) -> None:
        for token in list(self.attached):
            self.detach(token)


def prepare(session, request) -> tuple[list[dict], dict]:
    """`--adapter` opened and checked against the session's model: its global factors per projection
    (what every rank cuts its share from) and the provenance a result records."""
    from ster_dist.events import progress

    adapter = open_adapter(request.adapter)
    check_model(adapter, session.checkpoint.model)
    refuse_family(session.cfg.family)
    plans = plan_sites(adapter, session.cfg)
    sites = load_sites(adapter, plans)
    info = {"adapter": str(request.adapter), "format": adapter.format, "rank": adapter.rank, "alpha": adapter.alpha,
            "scale": adapter.scale, **summary(plans)}
    progress(f"attaching adapter {request.adapter} ({len(sites)} projections) on every rank")
    return [{"param": s.param, "a": s.a, "b": s.b, "scale": s.scale} for s in sites], info


def attach_for_cli(session, request) -> Callable[[], None]:
    """Attach --adapter on every rank of the session for a whole operation; returns the detach callable.
    Generation routes adapters per request in the token engine instead (ops/generate.py)."""
    sites, info = prepare(session, request)
    token = uuid.uuid4().hex
    session.group.on(AdaptersOnRank).attach({"token": token, "sites": sites})
    provenance = getattr(session, "provenance", None)
    if isinstance(provenance, dict):
        provenance["adapter"] = info

    def detach() -> None:
        with contextlib.suppress(Refusal):  # the group is gone, and the adapter with it
            session.group.on(AdaptersOnRank).detach(token)
        if isinstance(provenance, dict):
            provenance.pop("adapter", None)

    return detach

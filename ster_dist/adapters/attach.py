"""Runtime adapters: a LoRA adapter applied unmerged, x @ A^T @ B^T * scale beside each projection.

The driver opens and checks the adapter once against the session's model (another model or
width, targets the family cannot take, a steering vector passed as an adapter), maps it onto
decoder projections (targets.py) and sends the global factors to every rank. Each rank cuts its
own share from the projection's Shard, the same record the loader read its weight slice by: a
column-parallel projection (query, key, value, gate, up) keeps A whole and its own rows of B;
a row-parallel one (output, down) keeps its own columns of A and B whole, and its partial sum is
all-reduced together with the base's (parallel/linear.py).

attach_for_cli is what `--adapter` on capture and steer calls (session.modifiers); attach is the
same on one Decoder for library use. Both are the engine's per-row adapters over every row
(engine/modifiers.py); generation routes adapters per request in the token engine instead.
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
from ster_dist.engine.modifiers import StandingModifiers, adapt_every_row
from ster_dist.errors import Refusal


def attach(model, sites: list[Site] | list[dict]) -> Callable[[], None]:
    """Attach every site to its projection of `model` (a Decoder, possibly one TP rank's, or one
    pipeline stage's: another stage's sites are that stage's to attach) for every forward; returns
    detach."""
    return adapt_every_row(
        model, [site if isinstance(site, dict) else vars(site) for site in sites]
    )


def prepare(session, request) -> tuple[list[dict], dict]:
    """`--adapter` opened and checked against the session's model: its global factors per projection
    (what every rank cuts its share from) and the provenance a result records."""
    from ster_dist.events import progress

    adapter = open_adapter(request.adapter)
    check_model(adapter, session.checkpoint.model)
    refuse_family(session.cfg.family)
    plans = plan_sites(adapter, session.cfg)
    sites = load_sites(adapter, plans)
    info = {
        "adapter": str(request.adapter),
        "format": adapter.format,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "scale": adapter.scale,
        **summary(plans),
    }
    progress(f"attaching adapter {request.adapter} ({len(sites)} projections) on every rank")
    return [{"param": s.param, "a": s.a, "b": s.b, "scale": s.scale} for s in sites], info


def attach_for_cli(session, request) -> Callable[[], None]:
    """Attach --adapter on every rank of the session for a whole operation; returns the detach
    callable. Generation routes adapters per request in the token engine instead
    (ops/generate.py)."""
    sites, info = prepare(session, request)
    token = uuid.uuid4().hex
    session.group.on(StandingModifiers).adapt(token, sites)
    provenance = getattr(session, "provenance", None)
    if isinstance(provenance, dict):
        provenance["adapter"] = info

    def detach() -> None:
        with contextlib.suppress(Refusal):  # the group is gone, and the adapter with it
            session.group.on(StandingModifiers).detach(token)
        if isinstance(provenance, dict):
            provenance.pop("adapter", None)

    return detach

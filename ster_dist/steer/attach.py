"""Adding strength x direction to the residual stream after the direction's layer, on every rank.

The residual is replicated over tensor-parallel ranks, so every rank adds the same vector and the
ranks stay identical. Steering for a whole operation is the engine's per-row steering over every
row (engine/modifiers.py): it runs on every forward, so the prompt pass and every decode step are
steered. Each attachment has a token; detaching removes exactly its hooks, so a pooled session
(the job queue's) is left as it was found. Generation steers per request in the token engine.
"""

from __future__ import annotations

import contextlib
import uuid

import torch

from ster_dist.engine.modifiers import StandingModifiers, steer_every_row
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.shard.fingerprint import weights_fingerprint
from ster_dist.steer.artifact import (
    SteeringArtifact,
    check_for_run,
    load_artifact,
    provenance_warnings,
)


def payload(artifact: SteeringArtifact) -> list[tuple[int, torch.Tensor]]:
    return [(v.layer, v.values.float()) for v in artifact.vectors]


def add_steering(model, vectors: list[tuple[int, torch.Tensor]], strength: float) -> list:
    """Steer every forward of `model` (one rank's decoder) by strength x vector after each vector's
    layer; returns the removers."""
    return [steer_every_row(model, vectors, strength)]


def attach(group, artifact: SteeringArtifact, strength: float):
    """Steer every rank of `group`; returns the detach callable."""
    token = uuid.uuid4().hex
    group.on(StandingModifiers).steer(token, payload(artifact), float(strength))
    return lambda: group.on(StandingModifiers).detach(token)


def check_strength(vector, strength) -> None:
    if vector is not None and strength is None:
        raise Refusal(
            "--vector needs --strength S: Ster assumes no strength (try --strength 1, or a negative "
            "one written --strength=-1 to push away from the trait)"
        )
    if vector is None and strength is not None:
        raise Refusal(
            "--strength scales a steering vector and exists only with one: add --vector V.json or "
            "drop --strength"
        )
    if strength is not None and not torch.isfinite(torch.tensor(float(strength))):
        raise Refusal(f"--strength must be a finite number, got {strength}")


def prepare(session, request) -> tuple[list[tuple[int, torch.Tensor]], dict]:
    """`--vector V.json --strength S` checked against the loaded model (a precision or chat-template
    mismatch is warned about): the per-layer vectors to add, and the provenance a result records.
    Several vectors (lists in vector and strength) are each checked as one is, then summed per
    layer, each times its strength: the mix, to be added at strength 1."""
    if isinstance(request.vector, list):
        return _mix(session, request)
    check_strength(request.vector, request.strength)
    artifact = _checked(session, request, request.vector)
    info = {
        "vector": str(request.vector),
        "strength": float(request.strength),
        "trait_name": artifact.trait_name,
        "method": artifact.method,
        "layers": artifact.layers,
    }
    progress(
        f"steering layers {artifact.layers} by {request.strength} x the {artifact.method} direction "
        f"for {artifact.trait_name or '(unnamed)'}"
    )
    return payload(artifact), info


def _checked(session, request, path: str) -> SteeringArtifact:
    from ster_dist.steer.text import chat_status

    artifact = load_artifact(path)
    check_for_run(
        artifact,
        request.model,
        session.cfg.hidden_size,
        session.cfg.num_layers,
        fingerprint=weights_fingerprint(session.checkpoint),
    )
    chat = chat_status(session.tokenizer, getattr(request, "chat_template", "auto"))
    for warning in provenance_warnings(artifact, request.precision, chat, "it steers"):
        progress(warning)
    return artifact


def _mix(session, request) -> tuple[list[tuple[int, torch.Tensor]], dict]:
    summed: dict[int, torch.Tensor] = {}
    parts = []
    for path, strength in zip(request.vector, request.strength):
        artifact = _checked(session, request, path)
        for vector in artifact.vectors:
            scaled = vector.values.float() * float(strength)
            summed[vector.layer] = (
                summed[vector.layer] + scaled if vector.layer in summed else scaled
            )
        parts.append(
            {
                "vector": str(path),
                "strength": float(strength),
                "trait_name": artifact.trait_name,
                "method": artifact.method,
                "layers": artifact.layers,
            }
        )
    progress(f"steering with {len(parts)} vectors summed at layers {sorted(summed)}")
    return sorted(summed.items()), {"vectors": parts, "layers": sorted(summed)}


def attach_for_cli(session, request):
    """Steer every rank for the whole of an operation (capture, steer's own runs); returns undo.
    Generation steers per request in the token engine instead (ops/generate.py)."""
    vectors, info = prepare(session, request)
    token = uuid.uuid4().hex
    strength = 1.0 if isinstance(request.strength, list) else float(request.strength)
    session.group.on(StandingModifiers).steer(token, vectors, strength)
    provenance = getattr(session, "provenance", None)
    if isinstance(provenance, dict):
        provenance["steering"] = info

    def undo():
        try:
            with contextlib.suppress(Refusal):  # the group is gone, and the hooks with it
                session.group.on(StandingModifiers).detach(token)
        finally:
            if isinstance(provenance, dict):
                provenance.pop("steering", None)

    return undo

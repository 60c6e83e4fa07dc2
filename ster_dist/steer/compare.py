"""`ster vector compare`: steering artifacts fitted for different traits on one model, compared from
their directions alone (Ster's guide/steering.md, "Comparison"); no model is loaded.

At every layer all the artifacts carry (or every layer named) each pair's cosine similarity, and
their mean over those layers as `similarity`; per artifact, `uniqueness`: the length of the part of
its directions the others' directions at the same layers do not span, over their whole length;
`distance`: the mean over layers of the distance between unit directions, the nearer of a pair's two
signs (a direction and its negation pick out one axis); average linkage on it cut into the caller's
number of groups (`clusters`, numbered in order of first appearance), and `silhouette`, that cut's
mean silhouette over the artifacts that share a group (null when none does).
"""

from __future__ import annotations

import itertools

import torch

from ster_dist.errors import Refusal
from ster_dist.steer.artifact import SteeringArtifact, same_model


def compare(
    artifacts: list[tuple[str, SteeringArtifact]], clusters: int, layers: list[int] | None
) -> dict:
    if len(artifacts) < 2:
        raise Refusal(f"vector compare needs at least two artifacts and got {len(artifacts)}")
    first = artifacts[0][1]
    for path, artifact in artifacts[1:]:
        if not same_model(first.model, artifact.model) or artifact.hidden_size != first.hidden_size:
            raise Refusal(
                f"{path} was fitted on model {artifact.model!r} (width {artifact.hidden_size}), "
                f"{artifacts[0][0]} on {first.model!r} (width {first.hidden_size}): "
                "compare artifacts "
                "of one model"
            )
    if not 1 <= clusters <= len(artifacts):
        raise Refusal(
            f"--clusters {clusters} must be between 1 and the {len(artifacts)} artifacts compared"
        )
    by_layer = [{v.layer: v.values.double() for v in a.vectors} for _, a in artifacts]
    if layers is None:
        layers = sorted(set.intersection(*(set(d) for d in by_layer)))
        if not layers:
            raise Refusal("the artifacts carry no layer in common: fit them at a shared layer")
    for (path, _), directions in zip(artifacts, by_layer):
        for layer in layers:
            if layer not in directions:
                raise Refusal(
                    f"{path} carries no vector at layer {layer}; name layers every artifact carries"
                )
            if not float(directions[layer].norm()) > 0:
                raise Refusal(f"{path} has a direction with no usable length at layer {layer}")
    n = len(artifacts)
    unit = [[d[layer] / d[layer].norm() for layer in layers] for d in by_layer]
    distance = torch.zeros(n, n, dtype=torch.float64)
    rows = []
    for i, j in itertools.combinations(range(n), 2):
        cosines = [float(unit[i][k] @ unit[j][k]) for k in range(len(layers))]
        apart = [
            min(float((unit[i][k] - unit[j][k]).norm()), float((unit[i][k] + unit[j][k]).norm()))
            for k in range(len(layers))
        ]
        distance[i, j] = distance[j, i] = sum(apart) / len(apart)
        rows.append(
            {
                "a": artifacts[i][0],
                "b": artifacts[j][0],
                "similarity": sum(cosines) / len(cosines),
                "distance": float(distance[i, j]),
                "layers": [{"layer": layer, "cosine": c} for layer, c in zip(layers, cosines)],
            }
        )
    groups = _average_linkage(distance, clusters)
    return {
        "model": first.model,
        "layers": layers,
        "pairs": rows,
        "most_similar": max(rows, key=lambda r: r["similarity"]),
        "most_different": min(rows, key=lambda r: r["similarity"]),
        "uniqueness": [
            {
                "artifact": path,
                "trait_name": a.trait_name,
                "uniqueness": _uniqueness(by_layer, i, layers),
            }
            for i, (path, a) in enumerate(artifacts)
        ],
        "distance": distance.tolist(),
        "clusters": groups,
        "silhouette": _silhouette(distance, groups),
    }


def _uniqueness(by_layer: list[dict[int, torch.Tensor]], index: int, layers: list[int]) -> float:
    left, whole = 0.0, 0.0
    for layer in layers:
        v = by_layer[index][layer]
        others = torch.stack([d[layer] for k, d in enumerate(by_layer) if k != index], dim=1)
        basis, _ = torch.linalg.qr(others)  # the others' span at this layer
        rank = int((torch.linalg.svdvals(others) > 1e-10 * float(others.abs().max())).sum())
        residual = v - basis[:, :rank] @ (basis[:, :rank].T @ v)
        left += float(residual @ residual)
        whole += float(v @ v)
    return (left / whole) ** 0.5


def _average_linkage(distance: torch.Tensor, clusters: int) -> list[int]:
    members = [[i] for i in range(distance.shape[0])]
    while len(members) > clusters:
        best = None
        for a, b in itertools.combinations(range(len(members)), 2):
            mean = float(distance[members[a]][:, members[b]].mean())
            if best is None or mean < best[0]:
                best = (mean, a, b)
        _, a, b = best
        members[a] = sorted(members[a] + members.pop(b))
    ordered = sorted(members, key=min)  # numbered in order of first appearance
    return [
        next(g for g, group in enumerate(ordered) if i in group) for i in range(distance.shape[0])
    ]


def _silhouette(distance: torch.Tensor, groups: list[int]) -> float | None:
    scores = []
    for i, group in enumerate(groups):
        same = [k for k, g in enumerate(groups) if g == group and k != i]
        if not same:
            continue
        a = float(distance[i, same].mean())
        others = [
            float(distance[i, [k for k, g in enumerate(groups) if g == other]].mean())
            for other in set(groups)
            if other != group
        ]
        if not others:
            continue
        b = min(others)
        scores.append(0.0 if max(a, b) == 0 else (b - a) / max(a, b))
    return sum(scores) / len(scores) if scores else None

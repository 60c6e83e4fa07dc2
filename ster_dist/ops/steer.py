"""steer train | optimize | evaluate | inspect as plain functions: inputs read and checked first,
then the pairs read through the session's ranks, then the fit; artifacts written whole."""

from __future__ import annotations

from pathlib import Path

from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, writable_file
from ster_dist.schema.steer import (
    PairRun,
    SteerEvaluateRequest,
    SteerInspectRequest,
    SteerOptimizeRequest,
    SteerTrainRequest,
    VectorCompareRequest,
    VectorCurveRequest,
)
from ster_dist.session import Session, modifiers
from ster_dist.shard.fingerprint import weights_fingerprint


def _output(request) -> Path:
    writable_file(request.output, request.label("output"), "V.json file")
    output_not_an_input(request)
    return Path(request.output)


def _pairs_path(request: PairRun) -> str:
    """--pairs, or the workspace's active set (Ster: "omit it to use the active imported set")."""
    if request.pairs is not None:
        return request.pairs
    from ster_dist.steer.workspace import active_pairs

    return active_pairs()


def _read_pairs(session: Session, request: PairRun, pairs, layers: list[int]):
    from ster_dist.steer.bar import bar
    from ster_dist.steer.train import read_pairs

    batch = request.batch_size if request.batch_size is not None else 8
    progress(
        f"reading {len(pairs.pairs)} pairs ({2 * len(pairs.pairs)} prompts) at layers {layers}"
    )
    return read_pairs(
        session.group,
        session.tokenizer,
        pairs,
        layers,
        request.chat_template,
        session.pad_id,
        batch,
        bar("reading pairs"),
    )


def train(session: Session, request: SteerTrainRequest) -> dict:
    from ster_dist.steer.fit import canonical_method
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.text import chat_status
    from ster_dist.steer.train import build_artifact, fit_layers

    method = canonical_method(request.method)
    output = _output(request)
    pairs = load_pairs(_pairs_path(request))
    if request.adapter is not None:
        from ster_dist.adapters.format import open_adapter

        open_adapter(request.adapter)
    cfg = session.cfg
    layers = parse_layers(request.layers, cfg.num_layers)
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, request.chat_template)
        positive, negative = _read_pairs(session, request, pairs, layers)
        revision = session.checkpoint.model_revision
    vectors = fit_layers(positive, negative, layers, method)
    artifact = build_artifact(
        request.model,
        revision,
        pairs,
        method,
        cfg.hidden_size,
        vectors,
        request.precision,
        chat,
        weights_fingerprint(session.checkpoint),
    )
    artifact.save(output)
    return {**artifact.summary(), "output": str(output)}


def inspect(request: SteerInspectRequest) -> dict:
    from ster_dist.steer.artifact import load_artifact

    progress(f"reading the steering artifact {request.artifact}")
    return load_artifact(request.artifact).summary()


def optimize(session: Session, request: SteerOptimizeRequest) -> dict:
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.optimize import rank_candidates, refit, split
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.text import chat_status
    from ster_dist.steer.train import build_artifact

    output = _output(request)
    pairs = load_pairs(_pairs_path(request))
    fit, held = split(len(pairs.pairs), request.holdout)
    cfg = session.cfg
    layers = parse_layers(request.layers, cfg.num_layers)
    progress(f"fitting each candidate on {fit} pairs and ranking on a {held}-pair holdout")
    if held == 1:
        progress(
            "a one-pair holdout scores every candidate 0 or 1, so this ranking separates almost nothing; "
            "add pairs to make the choice mean something"
        )
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, request.chat_template)
        positive, negative = _read_pairs(session, request, pairs, layers)
        revision = session.checkpoint.model_revision
    candidates, best = rank_candidates(positive, negative, layers, fit)
    winner = candidates[best]
    vector = refit(positive, negative, winner["layer"], winner["method"])
    artifact = build_artifact(
        request.model,
        revision,
        pairs,
        winner["method"],
        cfg.hidden_size,
        [vector],
        request.precision,
        chat,
        weights_fingerprint(session.checkpoint),
    )
    artifact.metadata["selection"] = (
        f"chosen over {len(candidates)} candidates on a {held}-pair holdout, then "
        f"refitted on all {len(pairs.pairs)} pairs"
    )
    artifact.save(output)
    return {
        **artifact.summary(),
        "output": str(output),
        "selection": {
            "holdout": {"fraction": request.holdout, "fit_pairs": fit, "holdout_pairs": held},
            "candidates": candidates,
        },
    }


def evaluate(session: Session, request: SteerEvaluateRequest) -> dict:
    from ster_dist.steer.artifact import check_for_run, load_artifact, provenance_warnings
    from ster_dist.steer.evaluate import check_strength_options, score_layers, strength_report
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.text import chat_status

    strengths = request.strengths
    if strengths is not None:
        strengths = check_strength_options(strengths, request.batch_size, request.max_sequence)
    mode = request.chat_template
    artifact = load_artifact(request.vector)
    pairs = load_pairs(_pairs_path(request))
    cfg = session.cfg
    check_for_run(
        artifact,
        request.model,
        cfg.hidden_size,
        cfg.num_layers,
        verb="evaluate",
        fingerprint=weights_fingerprint(session.checkpoint),
    )
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, mode)
        for warning in provenance_warnings(
            artifact, request.precision, chat, "the number below describes"
        ):
            progress(warning)
        positive, negative = _read_pairs(session, request, pairs, artifact.layers)
        report = {
            "model": request.model,
            "trait_name": artifact.trait_name,
            "method": artifact.method,
            "pair_count": len(pairs.pairs),
            "precision": request.precision,
            "chat_template": chat,
            "layers": score_layers(artifact, positive, negative),
        }
        if strengths is not None:
            report["strength"] = strength_report(
                session.group,
                session.tokenizer,
                pairs,
                artifact,
                strengths,
                request.batch_size,
                request.max_sequence,
                mode,
                session.pad_id,
                progress,
            )
    return report


def compare(request: VectorCompareRequest) -> dict:
    from ster_dist.errors import Refusal
    from ster_dist.steer.artifact import load_artifact
    from ster_dist.steer.compare import compare as run

    layers = None
    if request.layers is not None:
        try:
            layers = [int(part) for part in request.layers.split(",") if part.strip()]
        except ValueError:
            raise Refusal(
                f"{request.label('layers')} takes a comma list of layers, got {request.layers!r}"
            ) from None
    return run(
        [(path, load_artifact(path)) for path in request.artifacts], request.clusters, layers
    )


def curve(session: Session, request: VectorCurveRequest) -> dict:
    from ster_dist.steer.curve import check_sizes
    from ster_dist.steer.curve import curve as run
    from ster_dist.steer.fit import canonical_method
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.optimize import split
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.text import chat_status

    method = canonical_method(request.method)
    pairs = load_pairs(_pairs_path(request))
    fit, held = split(len(pairs.pairs), request.holdout)
    sizes = request.size_list()
    check_sizes(sizes, fit, held)
    cfg = session.cfg
    layers = parse_layers(request.layers, cfg.num_layers)
    progress(f"fitting {method} on {sizes} of {fit} pairs and scoring on a {held}-pair holdout")
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, request.chat_template)
        positive, negative = _read_pairs(session, request, pairs, layers)
    points, enough = run(positive, negative, layers, method, sizes, fit)
    return {
        "model": request.model,
        "trait_name": pairs.trait_name,
        "method": method,
        "layers": layers,
        "precision": request.precision,
        "chat_template": chat,
        "holdout": {"fraction": request.holdout, "fit_pairs": fit, "holdout_pairs": held},
        "points": points,
        "enough": enough,
    }

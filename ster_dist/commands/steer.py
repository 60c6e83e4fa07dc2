"""`ster steer train | inspect | optimize | evaluate`: steering vectors from contrastive pairs.

Each command function takes the argparse namespace (the scheduler builds the same one from a job
spec) and returns a JSON-able dict; the artifact is written beside its path and renamed.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from ster_dist.commands.common import model_args, modifiers, progress, runtime_args, session
from ster_dist.errors import Refusal


def adapter_arg(p) -> None:
    p.add_argument("--adapter", default=None, help="a LoRA adapter applied unmerged while reading")


@contextlib.contextmanager
def adapted(run, args):
    """The session with --adapter attached (if given) for the run. --vector here names an input
    (the artifact evaluate scores), never steering, so it is kept out of the modifiers."""
    with modifiers(run, argparse.Namespace(**{**vars(args), "vector": None, "strength": None})):
        yield


def _output(path) -> Path:
    if path is None:
        raise Refusal("--output is required: name the steering artifact (V.json) to write")
    out = Path(path)
    if out.is_dir():
        raise Refusal(f"--output {out} is a directory; name the V.json file to write")
    return out


def _read_pairs(run, pairs, layers, args):
    from ster_dist.steer.bar import bar
    from ster_dist.steer.preflight import positive
    from ster_dist.steer.train import read_pairs

    batch = getattr(args, "batch_size", None)
    batch = positive(8 if batch is None else batch, "--batch-size")
    progress(f"reading {len(pairs.pairs)} pairs ({2 * len(pairs.pairs)} prompts) at layers {layers}")
    return read_pairs(run.group, run.tokenizer, pairs, layers, getattr(args, "chat_template", "auto"),
                      run.tokenizer.pad_token_id or 0, batch, bar("reading pairs"))


def cmd_steer_train(args) -> dict:
    from ster_dist.steer.fit import canonical_method
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.preflight import model_config_of
    from ster_dist.steer.text import chat_status
    from ster_dist.steer.train import build_artifact, fit_layers

    method = canonical_method(getattr(args, "method", "caa"))
    output = _output(args.output)
    pairs = load_pairs(args.pairs)
    cfg = model_config_of(args)
    layers = parse_layers(getattr(args, "layers", "all"), cfg.num_layers)
    with session(args) as run, adapted(run, args):
        chat = chat_status(run.tokenizer, getattr(args, "chat_template", "auto"))
        positive, negative = _read_pairs(run, pairs, layers, args)
        revision = run.checkpoint.model_revision
    vectors = fit_layers(positive, negative, layers, method)
    artifact = build_artifact(args.model, revision, pairs, method, cfg.hidden_size, vectors, args.precision, chat)
    artifact.save(output)
    return {**artifact.summary(), "output": str(output)}


def cmd_steer_inspect(args) -> dict:
    from ster_dist.steer.artifact import load_artifact

    return load_artifact(args.artifact).summary()


def cmd_steer_optimize(args) -> dict:
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.optimize import rank_candidates, refit, split
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.preflight import model_config_of
    from ster_dist.steer.text import chat_status
    from ster_dist.steer.train import build_artifact

    holdout = getattr(args, "holdout", None)
    if holdout is None:
        raise Refusal("optimize needs --holdout FRACTION (the share of pairs to rank on); Ster assumes none")
    output = _output(args.output)
    pairs = load_pairs(args.pairs)
    fit, held = split(len(pairs.pairs), holdout)
    cfg = model_config_of(args)
    layers = parse_layers(getattr(args, "layers", "all"), cfg.num_layers)
    progress(f"fitting each candidate on {fit} pairs and ranking on a {held}-pair holdout")
    if held == 1:
        progress("a one-pair holdout scores every candidate 0 or 1, so this ranking separates almost nothing; "
                 "add pairs to make the choice mean something")
    with session(args) as run, adapted(run, args):
        chat = chat_status(run.tokenizer, getattr(args, "chat_template", "auto"))
        positive, negative = _read_pairs(run, pairs, layers, args)
        revision = run.checkpoint.model_revision
    candidates, best = rank_candidates(positive, negative, layers, fit)
    winner = candidates[best]
    vector = refit(positive, negative, winner["layer"], winner["method"])
    artifact = build_artifact(args.model, revision, pairs, winner["method"], cfg.hidden_size, [vector],
                              args.precision, chat)
    artifact.metadata["selection"] = (f"chosen over {len(candidates)} candidates on a {held}-pair holdout, then "
                                      f"refitted on all {len(pairs.pairs)} pairs")
    artifact.save(output)
    return {**artifact.summary(), "output": str(output),
            "selection": {"holdout": {"fraction": holdout, "fit_pairs": fit, "holdout_pairs": held},
                          "candidates": candidates}}


def cmd_steer_evaluate(args) -> dict:
    from ster_dist.steer.artifact import check_for_run, load_artifact, provenance_warnings
    from ster_dist.steer.evaluate import check_strength_options, score_layers, strength_report
    from ster_dist.steer.pairs import load_pairs
    from ster_dist.steer.preflight import model_config_of
    from ster_dist.steer.text import chat_status

    strengths = _strengths(getattr(args, "strengths", None))
    batch_size, max_sequence = getattr(args, "batch_size", None), getattr(args, "max_sequence", None)
    if strengths is None and (batch_size is not None or max_sequence is not None):
        raise Refusal("--batch-size and --max-sequence measure strengths and exist only with --strengths")
    if strengths is not None:
        strengths = check_strength_options(strengths, batch_size, max_sequence)
    mode = getattr(args, "chat_template", "auto")
    artifact = load_artifact(args.vector)
    pairs = load_pairs(args.pairs)
    cfg = model_config_of(args)
    check_for_run(artifact, args.model, cfg.hidden_size, cfg.num_layers, verb="evaluate")
    with session(args) as run, adapted(run, args):
        chat = chat_status(run.tokenizer, mode)
        for warning in provenance_warnings(artifact, args.precision, chat, "the number below describes"):
            progress(warning)
        positive, negative = _read_pairs(run, pairs, artifact.layers, args)
        report = {"model": args.model, "trait_name": artifact.trait_name, "method": artifact.method,
                  "pair_count": len(pairs.pairs), "precision": args.precision, "chat_template": chat,
                  "layers": score_layers(artifact, positive, negative)}
        if strengths is not None:
            report["strength"] = strength_report(run.group, run.tokenizer, pairs, artifact, strengths, batch_size,
                                                 max_sequence, mode, run.tokenizer.pad_token_id or 0, progress)
    return report


def _strengths(value) -> list[float] | None:
    """--strengths "-1,0.5,1" from the CLI, or a list of numbers from a job spec."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    try:
        return [float(part) for part in parts if not isinstance(part, str) or part.strip()]
    except (TypeError, ValueError):
        raise Refusal(f"--strengths takes comma-separated numbers, got {value!r}") from None


def _pair_run_args(p, layers: bool = True) -> None:
    model_args(p)
    runtime_args(p)
    p.add_argument("--pairs", required=True, help='a {"trait_name": ..., "pairs": [{"positive", "negative"}]} file')
    if layers:
        p.add_argument("--layers", default="all", help="all, a comma list, or a half-open range such as 8..16")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    adapter_arg(p)


def register(sub) -> None:
    steer = sub.add_parser("steer", help="steering vectors: train, inspect, optimize, evaluate")
    verbs = steer.add_subparsers(dest="steer_command", required=True)

    p = verbs.add_parser("train", help="fit a direction per layer from contrastive pairs")
    _pair_run_args(p)
    p.add_argument("--output", required=True, help="the steering artifact (V.json) to write")
    p.add_argument("--method", default="caa", help="caa (mean difference), pca, or logistic (a probe)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    p.set_defaults(run=cmd_steer_train)

    p = verbs.add_parser("inspect", help="validate an artifact and summarise it without the floats")
    p.add_argument("artifact")
    p.set_defaults(run=cmd_steer_inspect)

    p = verbs.add_parser("optimize", help="rank every layer x method on a holdout and write the winner")
    _pair_run_args(p)
    p.add_argument("--output", required=True)
    p.add_argument("--holdout", type=float, default=None, help="the fraction of pairs held out to rank on")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    p.set_defaults(run=cmd_steer_optimize)

    p = verbs.add_parser("evaluate", help="score an artifact on pairs, and strengths with --strengths")
    _pair_run_args(p, layers=False)
    p.add_argument("--vector", required=True, help="the steering artifact (V.json)")
    p.add_argument("--strengths", default=None, help="comma-separated, e.g. --strengths=-1,0.5,1")
    p.add_argument("--batch-size", type=int, default=None,
                   help="pairs per forward pass while measuring strengths (required with --strengths)")
    p.add_argument("--max-sequence", type=int, default=None,
                   help="the longest pair side measured, in tokens (required with --strengths)")
    p.set_defaults(run=cmd_steer_evaluate)

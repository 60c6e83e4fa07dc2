"""Fitting a decision temperature through the token engine: every labelled item is read exactly as
`decide` reads it (run.read_questions, one item after another so each item's state is served from
the prefix cache), each labelled question becomes a temperature.Decision, T is fitted on the fit
split and the metrics are reported on both splits. The result is the artifact's body, less the
model identity the operation adds."""

from __future__ import annotations

from ster_dist.decide import answer as arithmetic
from ster_dist.decide import temperature as scaling
from ster_dist.decide.labelled import Labelled
from ster_dist.decide.run import read_questions


def decisions(
    engine,
    tokenizer,
    cfg,
    items: list[Labelled],
    permutations: int,
    chat_template: str,
    progress,
    usage: dict,
) -> list[scaling.Decision]:
    """Every labelled question of `items` as a Decision; `usage` accumulates what the reads cost."""
    out = []
    for number, item in enumerate(items, 1):
        per_question, used = read_questions(
            engine, tokenizer, cfg, item.request, permutations, chat_template, lambda message: None
        )
        for key, value in used.items():
            usage[key] = usage.get(key, 0) + value
        for (rows, _), label in zip(per_question, item.labels):
            out.append(scaling.Decision(arithmetic.mean_log_probs(rows), label))
        if number % 10 == 0 or number == len(items):
            progress(f"read {number} of {len(items)} labelled items")
    return out


def calibrate(
    engine,
    tokenizer,
    cfg,
    fit_items: list[Labelled],
    control_items: list[Labelled],
    permutations: int,
    chat_template: str,
    progress,
) -> dict:
    usage: dict = {}
    fit_set = decisions(
        engine, tokenizer, cfg, fit_items, permutations, chat_template, progress, usage
    )
    control_set = decisions(
        engine, tokenizer, cfg, control_items, permutations, chat_template, progress, usage
    )
    fitted = scaling.fit(fit_set)
    progress(f"fitted temperature {fitted.temperature:.4f} in {fitted.steps} golden-section steps")
    if fitted.at_bound:
        progress(
            f"warning: the fitted temperature lies at the end of e^-3..e^3 ({fitted.temperature:.4f}): these "
            "decisions want a temperature beyond the range, so the fit is clipped there"
        )
    return {
        "temperature": fitted.temperature,
        "log_temperature": fitted.log_temperature,
        "search": {
            "method": "golden-section on log temperature",
            "bounds": list(scaling.LOG_T_BOUNDS),
            "tolerance": scaling.TOLERANCE,
            "steps": fitted.steps,
            "at_bound": fitted.at_bound,
        },
        "ece_bins": scaling.ECE_BINS,
        "items": {"fit": len(fit_items), "control": len(control_items)},
        "before": scaling.metrics(fit_set, 1.0),
        "after": scaling.metrics(fit_set, fitted.temperature),
        "control": {
            "before": scaling.metrics(control_set, 1.0),
            "after": scaling.metrics(control_set, fitted.temperature),
        },
        "usage": usage,
    }

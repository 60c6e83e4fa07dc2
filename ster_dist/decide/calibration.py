"""The `ster-calibration/1` artifact: a decision temperature bound to the model it was fitted on.

Wire shape (JSON, written whole through atomic.replacing): format "ster-calibration/1"; model
(the --model string, as a steering artifact records it), model_revision, precision,
chat_template (applied / absent / off) and permutations (how its decisions were read); temperature
and log_temperature; search (method, bounds, tolerance, steps, at_bound); ece_bins; items and
decisions per split; control_from; before and after (the fit split at T = 1 and at T) and control
(the held-out split, before and after).

Reading one for `decide --calibration` refuses, in one line each: a file that is not JSON, another
format, another version of this one, a temperature that is not a number in e^-3..e^3, and (for a
run) another model. Another precision, chat template or permutation count is a warning only: the
numbers moved, but a user may mean it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ster_dist.atomic import replacing
from ster_dist.decide.temperature import T_MAX, T_MIN
from ster_dist.errors import Refusal
from ster_dist.inputs import read_text

FORMAT_NAME = "ster-calibration"
VERSION = 1
FORMAT = f"{FORMAT_NAME}/{VERSION}"


def check(data, where: str) -> dict:
    """`data` as a ster-calibration/1 artifact, or the one-line refusal of what is wrong with it."""
    if not isinstance(data, dict) or not isinstance(data.get("format"), str):
        raise Refusal(
            f"{where} is not a Ster calibration artifact (no format field): pass the file ster calibrate "
            "wrote"
        )
    name, _, version = data["format"].partition("/")
    if name != FORMAT_NAME:
        raise Refusal(
            f"{where} has format {json.dumps(data['format'])}, not {FORMAT}: pass the file ster calibrate "
            "wrote"
        )
    if version != str(VERSION):
        raise Refusal(
            f"{where} is {data['format']}; this build reads {FORMAT} only: refit it with this build's "
            "ster calibrate"
        )
    if not isinstance(data.get("model"), str) or not data["model"]:
        raise Refusal(f"{where} names no model: refit it with ster calibrate")
    temperature = data.get("temperature")
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
    ):
        raise Refusal(
            f"{where} has temperature {json.dumps(temperature)}, not a finite number: refit it with "
            "ster calibrate"
        )
    if not T_MIN <= temperature <= T_MAX:
        raise Refusal(
            f"{where} has temperature {temperature}, outside the e^-3..e^3 ({T_MIN:.4f}..{T_MAX:.2f}) "
            "calibration fits in: refit it with ster calibrate"
        )
    return data


def load(path: str, field: str) -> dict:
    where = f"{field} {path}"
    text = read_text(path, field)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Refusal(
            f"{where} is not JSON: {exc.msg} at line {exc.lineno}; pass the file ster calibrate "
            "wrote"
        ) from None
    return check(data, where)


def check_for_run(artifact: dict, model: str, where: str) -> None:
    # one rule for "the same model" across artifacts
    from ster_dist.steer.artifact import same_model

    if not same_model(artifact["model"], model):
        raise Refusal(
            f'{where} was fitted for model "{artifact["model"]}", current model is "{model}": load the '
            "model it was fitted for, or refit it for this one with ster calibrate"
        )


def warnings(artifact: dict, precision: str, chat_template: str, permutations: int) -> list[str]:
    out = []
    for name, now in (
        ("precision", precision),
        ("chat_template", chat_template),
        ("permutations", permutations),
    ):
        then = artifact.get(name)
        if then is not None and then != now:
            out.append(
                f"warning: this temperature was fitted with {name} {then} and this run reads decisions with "
                f"{now}, so its probabilities are scaled by a fit made on other numbers"
            )
    return out


def save(artifact: dict, path: str) -> None:
    check(artifact, "the calibration to write")
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with replacing(target) as handle:
            json.dump(artifact, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
    except OSError as exc:
        raise Refusal(
            f"failed to write calibration artifact {path}: {exc.strerror or exc}"
        ) from None

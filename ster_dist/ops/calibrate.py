"""calibrate: a decision temperature fitted on labelled decide requests, written as a
ster-calibration/1 artifact. Both files of labelled decisions are read and checked whole, and the
output checked writable, before any weight is read."""

from __future__ import annotations

from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, writable_file
from ster_dist.schema.calibrate import CalibrateRequest
from ster_dist.session import Session


def calibrate(session: Session, request: CalibrateRequest) -> dict:
    from ster_dist.decide import calibration
    from ster_dist.decide.calibrate import calibrate as fit
    from ster_dist.decide.labelled import load_labelled, split
    from ster_dist.steer.text import chat_status

    writable_file(request.output, request.label("output"), "JSON file")
    output_not_an_input(request)
    items = load_labelled(request.decisions, request.label("decisions"))
    control = (
        load_labelled(request.control, request.label("control"))
        if request.control is not None
        else None
    )
    fit_items, control_items, source = split(
        items, control, request.control_every, request.decisions, request.label("control")
    )
    engine = session.engine()
    chat = chat_status(session.tokenizer, request.chat_template)
    result = fit(
        engine,
        session.tokenizer,
        session.cfg,
        fit_items,
        control_items,
        request.permutations,
        request.chat_template,
        progress,
    )
    usage = result.pop("usage")
    artifact = {
        "format": calibration.FORMAT,
        "product": "ster",
        "model": request.model,
        "model_revision": session.checkpoint.model_revision,
        "precision": request.precision,
        "chat_template": chat,
        "permutations": request.permutations,
        **result,
        "control_from": source,
    }
    calibration.save(artifact, request.output)
    return {"output": request.output, **artifact, "usage": usage}

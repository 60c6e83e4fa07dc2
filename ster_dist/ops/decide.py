"""decide: typed questions answered from the next-token distribution over option letters (Ster's
decisions page). The request file is checked whole before any weight is read."""

from __future__ import annotations

from pathlib import Path

from ster_dist.atomic import write_json
from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, writable_file
from ster_dist.schema.decide import DecideRequest
from ster_dist.session import Session, modifiers


def decide(session: Session, request: DecideRequest) -> dict:
    from ster_dist.decide.request import load_request
    from ster_dist.decide.run import decide as run_decide
    from ster_dist.steer.text import chat_status

    writable_file(request.output, request.label("output"), "JSON file")
    output_not_an_input(request)
    questions = load_request(request.request)
    mode = request.chat_template
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, mode)
        result = run_decide(session.group, session.tokenizer, session.cfg, questions, request.permutations, mode,
                            request.explain, session.pad_id, progress)
        revision = session.checkpoint.model_revision
    response = {"model": request.model, "revision": revision, "chat_template": chat, "precision": request.precision,
                "temperature": 1.0, "calibration": None, "permutations": request.permutations, **result}
    if request.output is not None:
        write_json(Path(request.output), response)
    return response

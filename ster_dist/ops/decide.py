"""decide: typed questions answered from the next-token distribution over option letters (Ster's
decisions page). The request file is checked whole before any weight is read."""

from __future__ import annotations

from pathlib import Path

from ster_dist.atomic import write_json
from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, writable_file
from ster_dist.schema.decide import DecideRequest
from ster_dist.session import Session


def decide(session: Session, request: DecideRequest) -> dict:
    """Every rendering is a request of the session's token engine, so the state is read once and
    served from the prefix cache after; --adapter is registered with the engine and routed to these
    requests alone (nothing attached on the ranks for the whole operation); --calibration divides
    the option logits by the temperature its artifact holds."""
    from ster_dist.decide import calibration
    from ster_dist.decide.request import load_request
    from ster_dist.decide.run import decide as run_decide
    from ster_dist.ops.generate import register_adapter
    from ster_dist.steer.text import chat_status

    writable_file(request.output, request.label("output"), "JSON file")
    output_not_an_input(request)
    questions = load_request(request.request)
    if request.adapter is not None:  # a bad adapter file is refused before any weight is read
        from ster_dist.adapters.format import open_adapter

        open_adapter(request.adapter)
    fitted = None
    # another model's temperature is refused before any weight is read
    if request.calibration is not None:
        where = f"{request.label('calibration')} {request.calibration}"
        fitted = calibration.load(request.calibration, request.label("calibration"))
        calibration.check_for_run(fitted, request.model, where)
    temperature = fitted["temperature"] if fitted is not None else 1.0
    mode = request.chat_template
    engine = session.engine()
    adapter = register_adapter(session, engine, request)[0] if request.adapter is not None else None
    chat = chat_status(session.tokenizer, mode)
    if fitted is not None:
        for warning in calibration.warnings(fitted, request.precision, chat, request.permutations):
            progress(warning)
    result = run_decide(
        engine,
        session.tokenizer,
        session.cfg,
        questions,
        request.permutations,
        mode,
        request.explain,
        progress,
        adapter=adapter,
        temperature=temperature,
    )
    response = {
        "model": request.model,
        "revision": session.checkpoint.model_revision,
        "chat_template": chat,
        "precision": request.precision,
        "temperature": temperature,
        "calibration": request.calibration,
        "permutations": request.permutations,
        **result,
    }
    if request.output is not None:
        write_json(Path(request.output), response)
    return response

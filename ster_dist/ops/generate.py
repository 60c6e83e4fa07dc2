"""generate and parity as plain functions over a session.

Every prompt is a request of the session's token engine (engine/loop.py): it joins the running batch
at the next step, samples by its own settings and seed, and carries its own steering vector and
adapter, so requests of different settings share forwards: jobs on one worker group share its one
engine (their request ids carry their job ids, ster_dist/running.py), and each gets exactly what it
would have got alone. A prompts file is fed to the engine a window at a time and its answers are
written as they finish, so memory does not grow with the number of prompts.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ster_dist import running
from ster_dist.atomic import replacing
from ster_dist.errors import Refusal
from ster_dist.events import progress, text_delta
from ster_dist.inputs import (
    existing_file,
    output_not_an_input,
    read_prompts,
    read_text,
    writable_file,
)
from ster_dist.schema.generate import Completion, GenerateRequest, GenerateResult, ParityRequest
from ster_dist.session import Session


def prompts_of(request: GenerateRequest) -> list[str]:
    """The request's prompts, read and checked (before any weight is read)."""
    if request.prompt is not None:
        return [request.prompt]
    return read_prompts(request.prompts, request.label("prompts"))


def check_inputs(request: GenerateRequest) -> tuple[list[str], str | None]:
    """Every input of a generate request, refused before the model is touched."""
    writable_file(request.output, request.label("output"), "JSON file")
    output_not_an_input(request)
    prompts = prompts_of(request)
    system = read_text(request.system, request.label("system")) if request.system else None
    for vector in request.vector if isinstance(request.vector, list) else [request.vector]:
        existing_file(vector, request.label("vector"))
    if request.adapter is not None:
        from ster_dist.adapters.format import open_adapter

        open_adapter(request.adapter)
    return prompts, system


def generate_inputs(request: GenerateRequest) -> None:
    """What a generate request refuses before its model is touched: its inputs and its sampling
    settings (the job queue checks them before it loads the group the job will run on)."""
    check_inputs(request)
    sampling_params(request)


def sampling_params(request: GenerateRequest):
    """The engine's settings for the request's first prompt (prompt i draws from seed + i)."""
    from ster_dist.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=tuple(request.stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logprobs=request.logprobs,
    ).check(request.label)


@dataclass
class _Prepared:
    """One request ready for the engine: its prompts, modifiers registered, and its result
    header."""

    request: GenerateRequest
    params: object  # its SamplingParams, checked once; prompt i draws from seed + i
    prompts: list[str]
    system: str | None
    steering: tuple[str, float] | None
    adapter: str | None
    header: dict


def generate(session: Session, request: GenerateRequest) -> GenerateResult:
    """The request's answers. Its engine requests are named after the job running it (running.py),
    so jobs sharing the session's engine never reuse an id; a cancelled job stops at the engine's
    next step, its requests' blocks freed, and writes no output."""
    prompts, system = check_inputs(request)
    params = sampling_params(request)  # refused before the model loads
    job = running.current()
    job.check()
    engine = session.engine(*request.engine_options())
    item = _prepare(session, engine, request, params, prompts, system)
    progress(f"generating for {len(prompts)} prompt(s), up to {request.max_new_tokens} tokens each")
    live: dict[int, object] = {}  # index -> stream, while in the engine
    forget = job.on_cancel(lambda: [stream.cancel() for stream in list(live.values())])
    try:
        if request.prompts is not None:
            result = GenerateResult(**item.header)
            result.answered = _write_answers(
                Path(request.output),
                result,
                _file_answers(session, engine, item, live),
                len(prompts),
            )
            return result
        stream = live[0] = _submit(session, engine, item, 0)
        completion = _completion(session.tokenizer, prompts[0], stream, stream_text=request.stream)
        job.check()  # an answer cut short by a cancel is no answer
        return GenerateResult(**item.header, results=[completion])
    finally:
        forget()
        for stream in live.values():  # a failure or an interrupt frees what is still in flight
            stream.cancel()


def _submit(session: Session, engine, item: _Prepared, index: int):
    prompt = item.prompts[index]
    ids = session.tokenizer.prompt_ids(prompt, item.system, item.request.chat_template)
    params = (
        dataclasses.replace(item.params, seed=item.params.seed + index) if index else item.params
    )
    return engine.submit(
        ids,
        params,
        steering=item.steering,
        adapter=item.adapter,
        request_id=running.current().request_id(index),
    )


def _completion(tokenizer, prompt: str, stream, stream_text: bool = False) -> Completion:
    """A finished stream as its prompt's answer (its text sent on as events while it comes, for
    --stream);
    each logprob's token, and each of its alternatives, with its text beside its id (one token
    decoded alone, special tokens shown, as the server's logprobs show them)."""
    done = stream.result(
        on_delta=(lambda delta: delta.text and text_delta(delta.text)) if stream_text else None
    )
    logprobs = None
    if done.logprobs and any(lp is not None for lp in done.logprobs):

        def text(token: int) -> str:
            return tokenizer.decode([token], skip_special_tokens=False)

        logprobs = [
            {
                "token": lp[0],
                "text": text(lp[0]),
                "logprob": lp[1],
                "top": [[alt[0], alt[1], text(alt[0])] for alt in lp[2]],
            }
            if lp
            else None
            for lp in done.logprobs
        ]
    return Completion(
        prompt=prompt,
        text=done.text,
        prompt_tokens=done.prompt_tokens,
        completion_tokens=len(done.token_ids),
        finish_reason=done.finish_reason,
        logprobs=logprobs,
    )


def _prepare(
    session: Session, engine, request: GenerateRequest, params, prompts: list[str], system
) -> _Prepared:
    steering = adapter = None
    info = {}
    if request.vector is not None:
        steering, info["steering"] = register_vector(session, engine, request)
    if request.adapter is not None:
        adapter, info["adapter"] = register_adapter(session, engine, request)
    tokenizer = session.tokenizer
    sampling = {
        "max_new_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
    }
    extra = {
        name: value
        for name, value in (
            ("top_k", params.top_k),
            ("min_p", params.min_p),
            ("stop", list(params.stop)),
            ("stop_token_ids", list(params.stop_token_ids)),
            ("ignore_eos", params.ignore_eos),
            ("repetition_penalty", params.repetition_penalty),
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
            ("logprobs", params.logprobs),
        )
        if value != type(value)() and not (name == "repetition_penalty" and value == 1.0)
    }
    header = dict(
        model=request.model,
        model_revision=session.checkpoint.model_revision,
        precision=request.precision,
        tp=request.tp,
        ep=request.ep,
        # kept FP8: say so
        **({"weights": request.weights} if request.weights != "dequantize" else {}),
        chat_template="on" if request.chat_template != "off" and tokenizer.chat_template else "off",
        sampling={**sampling, **extra},
        steering=info.get("steering"),
        adapter=info.get("adapter"),
    )
    return _Prepared(request, params, prompts, system, steering, adapter, header)


def register_vector(session: Session, engine, request) -> tuple[tuple[str, float], dict]:
    """`request.vector` checked against the session's model and registered with the engine under a
    key digesting its content (nothing is attached globally); (key, strength) for
    `engine.submit(steering=...)`
    and the vector's provenance."""
    from ster_dist.steer.attach import prepare

    vectors, info = prepare(session, request)
    key = _digest(vectors)
    engine.add_vector(key, vectors)
    # several vectors are summed, each already times its strength: the mix is added at strength 1
    return (key, 1.0 if isinstance(request.strength, list) else float(request.strength)), info


def register_adapter(session: Session, engine, request) -> tuple[str, dict]:
    """`request.adapter` checked against the session's model and registered with the engine under a
    name digesting its content (nothing is attached globally); the name and the adapter's
    provenance."""
    from ster_dist.adapters.attach import prepare

    sites, info = prepare(session, request)
    name = _digest([(s["param"], s["a"], s["b"], s["scale"]) for s in sites])
    engine.add_adapter(name, sites)
    return name, info


def vector_key(vectors) -> str:
    """The engine's key of a steering vector ([(layer, tensor)]): its content's digest."""
    return _digest(vectors)


def _digest(parts) -> str:
    """A key naming a vector or an adapter by its content, so an edited file is registered anew."""
    import torch

    digest = hashlib.sha256()
    for part in parts:
        for value in part if isinstance(part, tuple) else (part,):
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()[:32]


def _file_answers(session: Session, engine, item: _Prepared, live: dict) -> Iterator[Completion]:
    """A prompts file's answers in order, at most a window of its prompts in the engine at once
    (kept in `live` while there, for a cancel to stop them)."""
    window = max(64, 4 * engine.config.max_running)
    job = running.current()
    pending: collections.deque = collections.deque()

    def answer() -> Completion:
        index, prompt = pending.popleft()
        completion = _completion(session.tokenizer, prompt, live[index])
        del live[index]
        job.check()  # an answer cut short by a cancel is no answer: the output is never written
        return completion

    for index, prompt in enumerate(item.prompts):
        job.check()
        live[index] = _submit(session, engine, item, index)
        pending.append((index, prompt))
        if len(pending) >= window:
            yield answer()
    while pending:
        yield answer()


def _write_answers(
    path: Path, result: GenerateResult, answers: Iterator[Completion], count: int
) -> int:
    """The output file, written as answers finish (whole or not at all): the header, then each
    answer."""
    with replacing(path) as out:
        out.write(
            json.dumps(result.header(), indent=2, ensure_ascii=False)[:-2] + ',\n  "results": ['
        )
        for i in range(count):
            answer = json.dumps(next(answers).model_dump(exclude_none=True), ensure_ascii=False)
            out.write(("\n    " if i == 0 else ",\n    ") + answer)
        out.write("\n  ]\n}\n")
    return count


def parity(session: Session, request: ParityRequest) -> dict:
    progress("running ster_dist and the reference (Transformers) on the same tokens")
    result = session.group.call("parity", request.tokens, request.seed)[session.group.lead]
    if not result["passed"]:
        progress(f"parity FAILED: past the threshold {result['threshold']}")
    return result

"""generate and parity as plain functions over a session.

Every prompt is a request of the session's token engine (engine/loop.py): it joins the running
batch at the next step, samples by its own settings and seed, and carries its own steering vector
and adapter, so requests of different settings share forwards. `generate_many` answers several
requests (the job queue's batch of generate jobs) together; each gets exactly what it would have
got alone. A prompts file is fed to the engine a window at a time and its answers are written as
they finish, so memory does not grow with the number of prompts.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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


def batch_key(request: GenerateRequest) -> tuple:
    """Generate requests on the same worker group with the same engine options share the engine's
    batch, whatever their sampling, steering or adapter; a streaming one runs alone (its text events
    are its own)."""
    return (request.group_key(), request.engine_options(), id(request) if request.stream else None)


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
    existing_file(request.vector, request.label("vector"))
    if request.adapter is not None:
        from ster_dist.adapters.format import open_adapter

        open_adapter(request.adapter)
    return prompts, system


def sampling_params(request: GenerateRequest):
    """The engine's settings for the request's first prompt (prompt i draws from seed + i)."""
    from ster_dist.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=request.max_new_tokens, temperature=request.temperature, top_p=request.top_p,
        top_k=request.top_k, min_p=request.min_p, seed=request.seed, stop=tuple(request.stop or ()),
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        repetition_penalty=request.repetition_penalty, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, logprobs=request.logprobs).check(request.label)


@dataclass
class _Prepared:
    """One request ready for the engine: its prompts, modifiers registered, and its result header."""

    request: GenerateRequest
    params: object  # its SamplingParams, checked once; prompt i draws from seed + i
    prompts: list[str]
    system: str | None
    steering: tuple[str, float] | None
    adapter: str | None
    header: dict


def generate(session: Session, request: GenerateRequest) -> GenerateResult:
    return generate_many(session, [request])[0]


def generate_many(session: Session, requests: list[GenerateRequest], on_result=None) -> list[GenerateResult]:
    """Every request's result, in order. `on_result(index, result)` hears each one as soon as its own
    answers are in (a one-prompt request does not wait for a longer batch-mate)."""
    key = batch_key(requests[0])
    if any(batch_key(r) != key for r in requests):
        raise Refusal("only generate requests on one worker group with equal engine options share the engine")
    inputs = [check_inputs(r) for r in requests]
    params = [sampling_params(r) for r in requests]  # refused before the model loads
    engine = session.engine(*requests[0].engine_options())
    prepared = [_prepare(session, engine, r, p, prompts, system)
                for r, p, (prompts, system) in zip(requests, params, inputs)]
    total = sum(len(p.prompts) for p in prepared)
    progress(f"generating for {total} prompt(s), up to {max(r.max_new_tokens for r in requests)} tokens each")
    results: list[GenerateResult | None] = [None] * len(prepared)
    done: queue.SimpleQueue = queue.SimpleQueue()
    singles = {}  # index -> the stream of a one-prompt request, all in the engine at once
    try:
        for index, item in enumerate(prepared):
            if item.request.prompts is None:
                singles[index] = _submit(session, engine, item, 0, on_finish=lambda _, i=index: done.put(i))
        for index, item in enumerate(prepared):  # prompts files in order, beside the one-prompt requests
            if item.request.prompts is not None:
                result = GenerateResult(**item.header)
                result.answered = _write_answers(Path(item.request.output), result,
                                                 _file_answers(session, engine, item), len(item.prompts))
                results[index] = _heard(on_result, index, result)
        for index in [i for i in singles if prepared[i].request.stream]:  # read live: its text goes out as it comes
            item = prepared[index]
            results[index] = _heard(on_result, index, GenerateResult(
                **item.header, results=[_completion(session.tokenizer, item.prompts[0], singles.pop(index),
                                                    stream_text=True)]))
        while singles:  # the other one-prompt requests as they finish
            index = done.get()
            if index in singles:
                item = prepared[index]
                results[index] = _heard(on_result, index, GenerateResult(
                    **item.header,
                    results=[_completion(session.tokenizer, item.prompts[0], singles.pop(index))]))
    finally:
        for stream in singles.values():  # a failure or an interrupt frees what is still in flight
            stream.cancel()
    return results


def _heard(on_result, index: int, result: GenerateResult) -> GenerateResult:
    if on_result is not None:
        on_result(index, result)
    return result


def _submit(session: Session, engine, item: _Prepared, index: int, on_finish=None):
    prompt = item.prompts[index]
    ids = session.tokenizer.prompt_ids(prompt, item.system, item.request.chat_template)
    params = dataclasses.replace(item.params, seed=item.params.seed + index) if index else item.params
    return engine.submit(ids, params, steering=item.steering, adapter=item.adapter,
                         on_finish=on_finish)


def _completion(tokenizer, prompt: str, stream, stream_text: bool = False) -> Completion:
    """A finished stream as its prompt's answer (its text sent on as events while it comes, for --stream);
    each logprob's token, and each of its alternatives, with its text beside its id (one token decoded
    alone, special tokens shown, as the server's logprobs show them)."""
    done = stream.result(on_delta=(lambda delta: delta.text and text_delta(delta.text)) if stream_text else None)
    logprobs = None
    if done.logprobs and any(lp is not None for lp in done.logprobs):
        def text(token: int) -> str:
            return tokenizer.decode([token], skip_special_tokens=False)

        logprobs = [{"token": lp[0], "text": text(lp[0]), "logprob": lp[1],
                     "top": [[alt[0], alt[1], text(alt[0])] for alt in lp[2]]} if lp else None
                    for lp in done.logprobs]
    return Completion(prompt=prompt, text=done.text, prompt_tokens=done.prompt_tokens,
                      completion_tokens=len(done.token_ids), finish_reason=done.finish_reason, logprobs=logprobs)


def _prepare(session: Session, engine, request: GenerateRequest, params, prompts: list[str], system) -> _Prepared:
    steering = adapter = None
    info = {}
    if request.vector is not None:
        steering, info["steering"] = register_vector(session, engine, request)
    if request.adapter is not None:
        adapter, info["adapter"] = register_adapter(session, engine, request)
    tokenizer = session.tokenizer
    sampling = {"max_new_tokens": request.max_new_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "seed": request.seed}
    extra = {name: value for name, value in (("top_k", params.top_k), ("min_p", params.min_p),
                                             ("stop", list(params.stop)), ("stop_token_ids", list(params.stop_token_ids)),
                                             ("ignore_eos", params.ignore_eos),
                                             ("repetition_penalty", params.repetition_penalty),
                                             ("presence_penalty", params.presence_penalty),
                                             ("frequency_penalty", params.frequency_penalty),
                                             ("logprobs", params.logprobs))
             if value != type(value)() and not (name == "repetition_penalty" and value == 1.0)}
    header = dict(model=request.model, model_revision=session.checkpoint.model_revision, precision=request.precision,
                  tp=request.tp, ep=request.ep,
                  **({"weights": request.weights} if request.weights != "dequantize" else {}),  # kept FP8: say so
                  chat_template="on" if request.chat_template != "off" and tokenizer.chat_template else "off",
                  sampling={**sampling, **extra}, steering=info.get("steering"), adapter=info.get("adapter"))
    return _Prepared(request, params, prompts, system, steering, adapter, header)


def register_vector(session: Session, engine, request) -> tuple[tuple[str, float], dict]:
    """`request.vector` checked against the session's model and registered with the engine under a key
    digesting its content (nothing is attached globally); (key, strength) for `engine.submit(steering=...)`
    and the vector's provenance."""
    from ster_dist.steer.attach import prepare

    vectors, info = prepare(session, request)
    key = _digest(vectors)
    engine.add_vector(key, vectors)
    return (key, float(request.strength)), info


def register_adapter(session: Session, engine, request) -> tuple[str, dict]:
    """`request.adapter` checked against the session's model and registered with the engine under a
    name digesting its content (nothing is attached globally); the name and the adapter's provenance."""
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


def _file_answers(session: Session, engine, item: _Prepared) -> Iterator[Completion]:
    """A prompts file's answers in order, at most a window of its prompts in the engine at once."""
    window = max(64, 4 * engine.config.max_running)
    pending: collections.deque = collections.deque()
    try:
        for index, prompt in enumerate(item.prompts):
            pending.append((prompt, _submit(session, engine, item, index)))
            if len(pending) >= window:
                yield _completion(session.tokenizer, *pending.popleft())
        while pending:
            yield _completion(session.tokenizer, *pending.popleft())
    finally:
        for _, stream in pending:  # a failure or an interrupt frees what is still in flight
            stream.cancel()


def _write_answers(path: Path, result: GenerateResult, answers: Iterator[Completion], count: int) -> int:
    """The output file, written as answers finish (whole or not at all): the header, then each answer."""
    with replacing(path) as out:
        out.write(json.dumps(result.header(), indent=2, ensure_ascii=False)[:-2] + ',\n  "results": [')
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

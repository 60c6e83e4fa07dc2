"""generate and parity as plain functions over a session.

`generate_many` answers several requests that share a worker group and their sampling settings in
one forward over all their prompts (the job queue merges greedy jobs this way, in memory); each
request gets exactly what it would have got alone.
"""

from __future__ import annotations

from pathlib import Path

from ster_dist.atomic import write_json
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.inputs import (
    existing_file,
    output_not_an_input,
    read_prompts,
    read_text,
    writable_file,
)
from ster_dist.schema.generate import Completion, GenerateRequest, GenerateResult, ParityRequest
from ster_dist.session import Session, modifiers

# what must be equal for requests to share one forward (everything but their prompts and outputs)
PER_REQUEST = {"prompt", "prompts", "output"}


def batch_key(request: GenerateRequest) -> tuple | None:
    """The key of requests that can share a forward, or None when this one runs alone: a sampled
    request draws from one seeded generator per batch, so its tokens would depend on its neighbours."""
    if request.temperature > 0:
        return None
    return tuple(sorted((name, repr(value)) for name, value in request if name not in PER_REQUEST))


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


def generate(session: Session, request: GenerateRequest) -> GenerateResult:
    return generate_many(session, [request])[0]


def generate_many(session: Session, requests: list[GenerateRequest]) -> list[GenerateResult]:
    from ster_dist.generate import Sampling

    first = requests[0]
    key = batch_key(first)
    if len(requests) > 1 and any(batch_key(r) != key or key is None for r in requests):
        raise Refusal("only greedy generate requests with equal settings share one forward")
    inputs = [check_inputs(r) for r in requests]
    system = inputs[0][1]
    prompts = [p for prompt_list, _ in inputs for p in prompt_list]
    sampling = Sampling(first.max_new_tokens, first.temperature, first.top_p, first.seed).check(first.label)
    with modifiers(session, first):
        tokenizer = session.tokenizer
        encoded = [tokenizer.prompt_ids(p, system, first.chat_template) for p in prompts]
        _check_context(session, encoded, first)
        eos = session.eos
        progress(f"generating for {len(prompts)} prompt(s), up to {sampling.max_new_tokens} tokens")
        outputs = session.group.call("generate", encoded, sampling, eos, session.pad_id)[0]
        provenance = dict(session.provenance)
    completions = []
    for prompt, ids, new in zip(prompts, encoded, outputs):
        finished = bool(new) and new[-1] in eos
        completions.append(Completion(prompt=prompt, text=tokenizer.decode(new[:-1] if finished else new),
                                      prompt_tokens=len(ids), completion_tokens=len(new),
                                      finish_reason="stop" if finished else "length"))
    header = dict(model=first.model, model_revision=session.checkpoint.model_revision, precision=first.precision,
                  tp=first.tp, ep=first.ep,
                  chat_template="on" if first.chat_template != "off" and tokenizer.chat_template else "off",
                  sampling={"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                            "top_p": sampling.top_p, "seed": sampling.seed},
                  steering=provenance.get("steering"), adapter=provenance.get("adapter"))
    results, start = [], 0
    for request, (prompt_list, _) in zip(requests, inputs):
        result = GenerateResult(**header, results=completions[start:start + len(prompt_list)])
        start += len(prompt_list)
        if request.prompts is not None:
            write_json(Path(request.output), result.written())
        results.append(result)
    return results


def _check_context(session: Session, encoded: list[list[int]], request: GenerateRequest) -> None:
    """A prompt and its budget fit the model's positions, refused before the forward."""
    limit = session.cfg.max_position
    longest = max(len(ids) for ids in encoded)
    if longest > limit:
        raise Refusal(f"a prompt encodes to {longest} tokens, more than the model's {limit} positions; shorten it")
    if longest + request.max_new_tokens > limit:
        raise Refusal(f"{request.label('max_new_tokens')} {request.max_new_tokens} past a {longest}-token prompt "
                      f"runs beyond the model's {limit} positions; give at most {limit - longest}")


def parity(session: Session, request: ParityRequest) -> dict:
    progress("running ster_dist and the reference (Transformers) on the same tokens")
    result = session.group.call("parity", request.tokens, request.seed)[0]
    if not result["passed"]:
        progress(f"parity FAILED: past the threshold {result['threshold']}")
    return result

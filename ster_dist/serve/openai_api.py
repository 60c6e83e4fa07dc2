"""OpenAI's /v1/chat/completions, /v1/completions and /v1/models over the token engine.

A request becomes one engine request per choice (`n`), all submitted at once so they share the
engine's batch with every other client's. Its settings are checked in the engine's own words
(SamplingParams.check, TokenEngine.submit) and refused as OpenAI's 400 naming the field. Answers
stream as server-sent events exactly as OpenAI's do: a first chunk with the role, content deltas, a
chunk with the finish reason, an optional usage chunk, then `data: [DONE]`. A client that goes away
cancels its engine requests, which frees their KV blocks at once.

The two completion endpoints are answered below FastAPI (serve/app.py hands them their body), and a
streamed answer is submitted only once it is set up (serve/event_stream.py says why); /v1/models is
a FastAPI route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import APIRouter
from pydantic import ValidationError

from ster_dist.engine.sampling import SamplingParams
from ster_dist.errors import InvalidField, Refusal
from ster_dist.serve.echo import completion_logprobs, echoed, prompt_logprobs
from ster_dist.serve.echo import finite as _finite, token_text as _token
from ster_dist.serve.errors import (
    ApiError,
    bad_request,
    engine_stopped,
    not_found,
    param_of,
    send_json,
)
from ster_dist.serve.event_stream import send_events, until_disconnect
from ster_dist.serve.openai_types import ChatCompletionRequest, CompletionRequest

# the API's name of a sampling field where it differs from the engine's, so a refusal points at what
# the client sent
_PARAMS = {"logprobs": "top_logprobs"}
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


@dataclasses.dataclass
class _Prepared:
    """One API request ready for the engine: its prompts' ids, settings, modifiers and
    bookkeeping."""

    kind: str  # "chat" | "text"
    model: str
    prompts: list[list[int]]  # one per prompt (completions may send several); n choices each
    params: SamplingParams
    n: int
    steering: tuple[str, float] | None
    adapter: str | None
    id: str
    created: int
    arrived: float
    include_usage: bool
    token_ids: bool = False  # return_token_ids: the choices carry their tokens' ids
    # echo: each prompt's text, put before its choices' (serve/echo.py)
    echo: list[str] | None = None


def router(state) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models")
    async def models():
        created = int(state.started)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "ster",
                    "root": state.request.model,
                    "parent": None if name == state.name else state.name,
                    "max_model_len": state.session.cfg.max_position,
                }
                for name in state.models()
            ],
        }

    return api


async def answer(state, path: str, raw: bytes, receive, send) -> None:
    """POST /v1/chat/completions or /v1/completions as a plain ASGI answer: the event loop's work
    for a request is time its first token waits for, and FastAPI's routing and middleware were most
    of it."""
    model, prepare = (
        (ChatCompletionRequest, _prepare_chat)
        if path == CHAT
        else (CompletionRequest, _prepare_text)
    )
    try:
        body = parse_body(model, raw)
        prep = await _prepared(prepare, state, body, len(raw))
        # submitted once the answer is set up, so the step never shares the cores with that work;
        if body.stream:
            # what submitting would refuse is refused now, while the answer can be a 400
            _check(state, prep)
            return await send_events(_events(state, prep), receive, send)
        watcher = asyncio.ensure_future(until_disconnect(receive))
        try:
            whole = await _whole(state, prep, _submit(state, prep), watcher)
        finally:
            watcher.cancel()
        if prep.echo is not None:
            scored = None
            if prep.params.logprobs is not None:
                scored = await asyncio.to_thread(
                    prompt_logprobs, state.session, prep.prompts, prep.params.logprobs
                )
            whole = echoed(whole, prep.n, state.session.tokenizer, prep.prompts, prep.echo, scored)
        # inside the try: an answer that cannot be written (say, a value JSON has no spelling for)
        # is
        # OpenAI's 500 too, not uvicorn's plain-text one
        return await send_json(send, whole)
    except ApiError as error:
        return await error.send(send)
    except Exception as exc:  # noqa: BLE001 - OpenAI's 500, never a traceback
        return await ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error").send(send)


# -- a request's inputs
# -------------------------------------------------------------------------------
def parse_body(model, raw: bytes):
    """The body as `model`, whatever content type the client declared (curl sends form's); a
    malformed body or field is OpenAI's 400 naming the field."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise bad_request(
                f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'malformed')}",
                code="invalid_json",
            ) from None
        param = param_of(tuple(first["loc"]))
        raise bad_request(
            f"{param}: {first['msg']}" if param else first["msg"], param=param
        ) from None


# a body past this many bytes is tokenized (and its template rendered) on a thread, not the event
# loop:
# a 3.6 MB prompt held every client, /health included, for seconds; a small one is faster where it
# is
_ON_LOOP_BYTES = 16 << 10


async def _prepared(prepare, state, body, size: int) -> _Prepared:
    """prepare(state, body); off the event loop when the body is large, or when a steering vector
    must be read and registered (registering waits for the engine's step to end)."""
    if body.steering is not None or size > _ON_LOOP_BYTES:
        return await asyncio.to_thread(prepare, state, body)
    return prepare(state, body)


def _not_too_long(state, chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a text that cannot fit the context whatever its tokens:
    state.prompt_chars is a bound on the characters max_position tokens can cover (None where the
    tokenizer may drop characters, so no such bound holds)."""
    if state.prompt_chars is not None and chars > state.prompt_chars:
        raise bad_request(
            f"the {param} is {chars} characters, more than the {state.session.cfg.max_position} "
            f"positions of this model can hold (at most {state.prompt_chars} characters); send a "
            "shorter one",
            param=param,
            code="context_length_exceeded",
        )


def _modifiers(state, body) -> tuple[str | None, tuple[str, float] | None]:
    if body.model == state.name:
        adapter = None
    elif body.model in state.adapters:
        adapter = state.adapters[body.model]
    else:
        raise not_found(
            f"The model `{body.model}` does not exist; this server serves: "
            f"{', '.join(state.models())}",
            param="model",
            code="model_not_found",
        )
    steering = None
    if body.steering is not None:
        steering = (_steering_key(state, body.steering), body.steering.strength)
    return adapter, steering


def _steering_key(state, steering) -> str:
    from ster_dist.steer.artifact import SteeringArtifact

    if (steering.vector is None) == (steering.artifact is None):
        raise bad_request(
            "steering takes exactly one of 'vector' (a name from the server's --vectors) or "
            "'artifact' (a Ster steering artifact inline)",
            param="steering",
        )
    try:
        if steering.vector is not None:
            return state.named_vector(steering.vector)
        return state.steering_key(
            SteeringArtifact.from_json(steering.artifact, "steering.artifact")
        )
    except LookupError as exc:
        raise not_found(
            str(exc.args[0]), param="steering.vector", code="vector_not_found"
        ) from None
    except Refusal as exc:
        raise bad_request(str(exc), param="steering") from None


def _sampling(state, body, prompt_len: int, logprobs: int | None) -> SamplingParams:
    limit = body.limit()
    if limit is None:  # OpenAI: up to the context left after the longest prompt
        limit = max(0, state.session.cfg.max_position - prompt_len)
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    try:
        return SamplingParams(
            max_tokens=limit,
            temperature=temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=logprobs,
        ).check(lambda name: f"'{name}'")
    except InvalidField as exc:
        raise bad_request(str(exc), param=_PARAMS.get(exc.field, exc.field)) from None


def _unserved(body) -> None:
    """Refuse the fields that would change the answer and are not served, rather than ignore
    them."""
    unserved = [
        ("logit_bias", bool(body.logit_bias)),
        ("response_format", body.response_format not in (None, {"type": "text"})),
        *(
            (name, getattr(body, name) is not None)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        ),
    ]
    if isinstance(body, ChatCompletionRequest):
        unserved += [
            ("tools", bool(body.tools)),
            ("functions", bool(body.functions)),
            ("tool_choice", body.tool_choice not in (None, "none", "auto")),
            ("function_call", body.function_call not in (None, "none", "auto")),
        ]
    for name, refused in unserved:
        if refused:
            raise bad_request(
                f"'{name}' is not served by ster serve; send the request without it", param=name
            )


# the names apply_chat_template takes itself: chat_template_kwargs may not pass them a second time
_TEMPLATE_OWN = ("messages", "add_generation_prompt")


def _messages(body: ChatCompletionRequest) -> list[dict]:
    for i, message in enumerate(body.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages.{i}.content.{j}: a content part of type {part.type[:40]!r} is not "
                    "served (this server reads text); send text parts ({'type': 'text', 'text': ...})",
                    param=f"messages.{i}.content.{j}.type",
                )
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]


def _prepare_chat(state, body: ChatCompletionRequest) -> _Prepared:
    _unserved(body)
    adapter, steering = _modifiers(state, body)
    tokenizer = state.session.tokenizer
    if not tokenizer.has_chat_template:
        raise bad_request(
            f"{state.request.model} has no chat template, so chat messages cannot be rendered; "
            "send the text to /v1/completions",
            param="messages",
        )
    messages = _messages(body)
    _not_too_long(state, sum(len(m["content"]) for m in messages), "messages")
    kwargs = body.chat_template_kwargs or {}
    for name in _TEMPLATE_OWN:
        if name in kwargs:
            raise bad_request(
                f"chat_template_kwargs may not set '{name}': it is the request's own field; send it "
                f"as '{name}'",
                param=f"chat_template_kwargs.{name}",
            )
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, **kwargs
        )
    except Refusal as exc:
        raise bad_request(str(exc), param="messages") from None
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return _Prepared(
        "chat",
        body.model,
        [ids],
        _sampling(state, body, len(ids), logprobs),
        body.n,
        steering,
        adapter,
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        time.monotonic(),
        bool(body.stream_options and body.stream_options.include_usage),
        body.return_token_ids,
    )


def _prepare_text(state, body: CompletionRequest) -> _Prepared:
    for name, refused in (
        ("echo", body.echo and body.stream),
        ("suffix", body.suffix is not None),
        ("best_of", body.best_of not in (None, body.n)),
    ):
        if refused:
            raise bad_request(
                f"'{name}' is not served by ster serve; send the request without it", param=name
            )
    _unserved(body)
    adapter, steering = _modifiers(state, body)
    tokenizer, vocab = state.session.tokenizer, state.session.cfg.vocab_size
    prompts = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            _not_too_long(state, len(prompt), "prompt")
            prompts.append(tokenizer.encode(prompt))
        elif all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            prompts.append(list(prompt))
        else:
            raise bad_request(
                f"a prompt of token ids must hold ids in [0, {vocab}) for this model",
                param="prompt",
            )
    if not prompts:
        raise bad_request("'prompt' is empty; give a text or a list of token ids", param="prompt")
    if len(prompts) * body.n > state.max_queue:
        raise bad_request(
            f"{len(prompts)} prompts x n {body.n} is more than this server's {state.max_queue} "
            "requests in flight; send fewer at once",
            param="prompt",
        )
    longest = max(len(p) for p in prompts)
    echo = None
    if body.echo:
        if body.logprobs is not None and (steering is not None or adapter is not None):
            raise bad_request(
                "echo with logprobs scores the prompt on the served model alone; send it without "
                "'steering' and to the model itself, not an adapter",
                param="echo",
            )
        echo = [
            p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
            for p in body.prompts()
        ]
    return _Prepared(
        "text",
        body.model,
        prompts,
        _sampling(state, body, longest, body.logprobs),
        body.n,
        steering,
        adapter,
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        time.monotonic(),
        bool(body.stream_options and body.stream_options.include_usage),
        body.return_token_ids,
        echo,
    )


# -- running and answering
# --------------------------------------------------------------------------
def _choices(prep: _Prepared):
    """(prompt ids, settings) of every choice, prompt-major as OpenAI numbers them."""
    for ids in prep.prompts:
        for i in range(prep.n):
            params = prep.params
            if params.seed is not None and i:  # choices of one seeded request differ, reproducibly
                params = dataclasses.replace(params, seed=params.seed + i)
            yield ids, params


def _refused(prep: _Prepared, exc: Refusal) -> ApiError:
    text = str(exc)
    code = "context_length_exceeded" if "positions" in text or "KV blocks" in text else None
    return bad_request(text, param="messages" if prep.kind == "chat" else "prompt", code=code)


def _check(state, prep: _Prepared) -> None:
    """What the engine would refuse at submission, refused now, while the answer can still be a
    400."""
    try:
        for ids, params in _choices(prep):
            state.engine.check(ids, params, steering=prep.steering, adapter=prep.adapter)
    except Refusal as exc:
        raise _refused(prep, exc) from None


def _submit(state, prep: _Prepared) -> list:
    """One engine stream per choice; a refusal cancels the rest."""
    streams = []
    try:
        for ids, params in _choices(prep):
            streams.append(
                state.engine.submit(ids, params, steering=prep.steering, adapter=prep.adapter)
            )
    except Refusal as exc:
        for stream in streams:
            stream.cancel()
        if state.engine.stopped:  # the server's fault, not the request's: 503 as /health says it
            raise engine_stopped(str(exc)) from None
        raise _refused(prep, exc) from None
    return streams


async def _merged(state, prep: _Prepared, streams: list):
    """(choice index, delta) as they come from every stream; metrics noted on the way."""
    first = [True] * len(streams)
    last = [prep.arrived] * len(streams)
    try:
        async for index, item in _interleaved(streams):
            now = time.monotonic()
            if item.token_ids:
                if first[index]:
                    state.metrics.ttft.observe(now - prep.arrived)
                    first[index] = False
                else:
                    state.metrics.itl.observe((now - last[index]) / len(item.token_ids))
                last[index] = now
                state.metrics.generation_tokens.inc(len(item.token_ids))
            yield index, item
    finally:
        for stream in streams:
            if not stream.finished:
                stream.cancel()  # a client that left: its blocks are freed at once
        state.metrics.e2e.observe(time.monotonic() - prep.arrived)


async def _interleaved(streams: list):
    """(index, delta) of several streams in arrival order; one stream is read directly (the common
    case, with no task or queue between the engine and the client)."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:  # noqa: BLE001 - an engine failure reaches the answer
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(prep: _Prepared, streams: list, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in prep.prompts)
    cached = sum(s.cached_tokens for s in streams[:: prep.n])
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


async def _whole(state, prep: _Prepared, streams: list, watcher: asyncio.Future) -> dict:
    texts = [[] for _ in streams]
    ids = [[] for _ in streams]
    logprobs = [[] for _ in streams]
    reasons: list[str | None] = [None] * len(streams)
    counts = [0] * len(streams)
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prep.prompts))
    merged = _merged(state, prep, streams)
    try:
        async for index, delta in merged:
            texts[index].append(delta.text)
            ids[index].extend(delta.token_ids)
            logprobs[index].extend(delta.logprobs)
            counts[index] += len(delta.token_ids)
            reasons[index] = delta.finish_reason or reasons[index]
            if watcher.done():
                raise ConnectionError("client disconnected")
    finally:
        await merged.aclose()
    tokenizer = state.session.tokenizer
    choices = []
    for index in range(len(streams)):
        text = "".join(texts[index])
        choice = {"index": index, "finish_reason": _finish(reasons[index]), "logprobs": None}
        if prep.params.logprobs is not None:
            choice["logprobs"] = (_chat_logprobs if prep.kind == "chat" else _text_logprobs)(
                tokenizer, logprobs[index]
            )
        if prep.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if prep.token_ids:
            choice["token_ids"] = ids[index]
        choices.append(choice)
    return {
        "id": prep.id,
        "object": "chat.completion" if prep.kind == "chat" else "text_completion",
        "created": prep.created,
        "model": prep.model,
        "choices": choices,
        "system_fingerprint": None,
        "usage": _usage(prep, streams, sum(counts)),
    }


async def _events(state, prep: _Prepared):
    """The answer's events; the requests are submitted when the first is asked for (a refusal then
    is an ApiError before any event), and a chat's opening role chunks go out with the first
    token."""
    chunk_object = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"
    tokenizer = state.session.tokenizer
    streams = _submit(state, prep)
    counts = [0] * len(streams)
    state.metrics.prompt_tokens.inc(sum(len(p) for p in prep.prompts))

    def chunk(choices: list, usage=None) -> str:
        body = {
            "id": prep.id,
            "object": chunk_object,
            "created": prep.created,
            "model": prep.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if prep.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    opened = prep.kind != "chat"
    merged = _merged(state, prep, streams)
    try:
        async for index, delta in merged:
            if not opened:  # OpenAI opens each choice with its role
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(len(streams))
                    ]
                )
                opened = True
            counts[index] += len(delta.token_ids)
            if not delta.text and delta.finish_reason is None and not prep.token_ids:
                continue  # a token whose text is not whole yet (a split UTF-8 character)
            choice = {
                "index": index,
                "logprobs": None,
                "finish_reason": _finish(delta.finish_reason),
            }
            if prep.params.logprobs is not None and delta.logprobs:
                choice["logprobs"] = (_chat_logprobs if prep.kind == "chat" else _text_logprobs)(
                    tokenizer, delta.logprobs
                )
            if prep.kind == "chat":
                choice["delta"] = {"content": delta.text} if delta.text else {}
            else:
                choice["text"] = delta.text
            if prep.token_ids:
                choice["token_ids"] = delta.token_ids
            yield chunk([choice])
    except Refusal as exc:
        error = ApiError(500, str(exc), type="server_error")
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        await merged.aclose()
    if prep.include_usage:
        yield chunk([], _usage(prep, streams, sum(counts)))
    yield "data: [DONE]\n\n"


# -- logprobs in OpenAI's two shapes
# ------------------------------------------------------------------
def _chat_logprobs(tokenizer, entries: list) -> dict:
    content = []
    for entry in entries:
        if entry is None:
            continue
        token_id, logprob, top = entry
        text = _token(tokenizer, token_id)
        content.append(
            {
                "token": text,
                "logprob": _finite(logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token(tokenizer, i)),
                        "logprob": _finite(lp),
                        "bytes": list(t.encode()),
                    }
                    for i, lp in top
                ],
            }
        )
    return {"content": content}


def _text_logprobs(tokenizer, entries: list) -> dict:
    tokens, token_logprobs, top_logprobs = [], [], []
    for entry in entries:
        if entry is None:
            continue
        token_id, logprob, top = entry
        tokens.append(_token(tokenizer, token_id))
        token_logprobs.append(_finite(logprob))
        top_logprobs.append({_token(tokenizer, i): _finite(lp) for i, lp in top})
    return completion_logprobs(tokens, token_logprobs, top_logprobs)

"""`ster chat`: a conversation with a model in the terminal, over the session's token engine.

Each line read is a user turn. The whole conversation (system message first, then every turn and
answer so far) is rendered through the model's chat template and submitted to the token engine as
one request, so the prefix cache serves what earlier turns already computed; the answer's text is
written out as it is generated and joins the conversation once whole. `/reset` forgets the turns
(the system message stays), `/exit` or the end of input ends the chat.

An interrupt (Ctrl-C) while an answer comes cancels that answer (its KV blocks are freed at once)
and drops the turn; at the prompt it ends the chat. A turn the engine refuses (the conversation has
grown past the model's positions) is reported in one line on stderr and dropped; the chat goes on.
"""

from __future__ import annotations

import dataclasses
import sys

from ster_dist.errors import Refusal
from ster_dist.events import end_progress_line, progress
from ster_dist.inputs import existing_file
from ster_dist.ops.generate import register_adapter, register_vector
from ster_dist.schema.chat import ChatRequest
from ster_dist.session import Session

EXIT, RESET = "/exit", "/reset"


def chat(request: ChatRequest, lines=None, out=None, err=None) -> dict:
    """Chat over `lines` (default: standard input), answers written to `out` (default: the process's
    real stdout, which the command line keeps for the conversation) and refused turns to `err`
    (default: the real stderr). Returns the chat's totals."""
    lines = sys.stdin if lines is None else lines
    out = sys.__stdout__ if out is None else out
    err = sys.__stderr__ if err is None else err
    params = _sampling(request)  # every input refused before the model loads
    existing_file(request.vector, request.label("vector"))
    if request.adapter is not None:
        from ster_dist.adapters.format import open_adapter

        open_adapter(request.adapter)
    with Session(request) as session:
        if not session.tokenizer.has_chat_template:
            raise Refusal(
                f"ster chat needs a chat template; {request.model} has none (a base model continues "
                "text rather than answering turns): use `ster generate --prompt TEXT` instead"
            )
        engine = session.engine(*request.engine_options())
        # steered or adapted steps run eagerly anyway
        if request.vector is None and request.adapter is None:
            engine.warm_up()  # compiled now rather than as a stall in the middle of an answer
        steering = adapter = None
        if request.vector is not None:
            steering, _ = register_vector(session, engine, request)
        if request.adapter is not None:
            adapter, _ = register_adapter(session, engine, request)
        progress(
            f"chatting with {request.model}: one line a turn; {RESET} forgets the turns, {EXIT} or the end "
            "of input ends the chat"
        )
        opening = (
            [{"role": "system", "content": request.system}] if request.system is not None else []
        )
        history = list(opening)
        totals = {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0}
        prompt = "> " if _is_tty(lines) else ""
        end_progress_line()  # at a terminal, the last progress line stays above the conversation
        try:
            for line in _read(lines, out, prompt):
                text = line.rstrip("\r\n")
                if text.strip() == EXIT:
                    break
                if text.strip() == RESET:
                    history = list(opening)
                    continue
                if not text.strip():
                    continue  # an empty line asks nothing
                messages = [*history, {"role": "user", "content": text}]
                ids = session.tokenizer.apply_chat_template(messages)
                # turn i of the conversation draws from seed + i, so a reset conversation samples as
                # a fresh one
                turn = sum(1 for m in history if m["role"] == "user")
                try:
                    stream = engine.submit(
                        ids,
                        dataclasses.replace(params, seed=params.seed + turn),
                        steering=steering,
                        adapter=adapter,
                    )
                except Refusal as refusal:
                    # a failed step, not this turn: no later turn can be answered
                    if engine.stopped:
                        raise
                    print(
                        f"{refusal}; this turn is dropped ({RESET} starts the conversation afresh)",
                        file=err,
                        flush=True,
                    )
                    continue
                answer = _answer(stream, out)
                if answer is None:
                    # interrupted: neither the turn nor its partial answer joins the conversation
                    continue
                history = [*messages, {"role": "assistant", "content": answer.text}]
                totals["turns"] += 1
                totals["prompt_tokens"] += answer.prompt_tokens
                totals["completion_tokens"] += len(answer.token_ids)
        except KeyboardInterrupt:  # at the prompt: the chat ends as at the end of input
            if prompt:
                _write(out, "\n")
        return totals


def totals_in_words(totals: dict) -> str:
    """The chat's totals as a person reads them at its end (JSON where stderr is not a terminal)."""
    turns = totals["turns"]
    return (
        f"{turns} turn{'' if turns == 1 else 's'}: "
        f"{totals['prompt_tokens']} prompt tokens read, "
        f"{totals['completion_tokens']} tokens answered"
    )


def _sampling(request: ChatRequest):
    from ster_dist.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=request.max_new_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
    ).check(request.label)


def _is_tty(lines) -> bool:
    isatty = getattr(lines, "isatty", None)
    return bool(isatty and isatty())


def _read(lines, out, prompt: str):
    """The input's lines, the prompt shown before each (a terminal's end of input ends its line)."""
    source = iter(lines)
    while True:
        if prompt:
            _write(out, prompt)
        try:
            yield next(source)
        except StopIteration:
            if prompt:
                _write(out, "\n")
            return


def _answer(stream, out):
    """The stream's whole answer, its text written out as it comes; None when interrupted (the
    stream is cancelled and its end awaited, so its blocks are free before the next turn)."""
    try:
        done = stream.result(on_delta=lambda delta: delta.text and _write(out, delta.text))
    except KeyboardInterrupt:
        stream.cancel()
        for _ in stream:
            pass
        _write(out, "\n")
        return None
    _write(out, "\n")
    return done


def _write(out, text: str) -> None:
    out.write(text)
    out.flush()

"""vLLM's POST /tokenize and /detokenize over the served model's tokenizer: clients (lm-eval,
agents counting their context) ask the server how it tokenizes instead of loading a tokenizer.

/tokenize takes a `prompt` (encoded with the model's special tokens unless `add_special_tokens` is
false) or chat `messages` (rendered through the chat template, as /v1/chat/completions renders them)
and answers `{"count", "max_model_len", "tokens"}`; /detokenize takes `tokens` and answers
`{"prompt"}`. A `model` other than the served one or its adapters is a 404. Both run on a thread:
a large body's tokenization never holds the event loop.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import Field

from ster_dist.errors import Refusal
from ster_dist.serve.errors import bad_request, not_found
from ster_dist.serve.openai_types import Message, _Body


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def router(state) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _served(state, body.model)
        return await asyncio.to_thread(_tokenize, state, body)

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _served(state, body.model)
        vocab = state.session.cfg.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens must be ids in [0, {vocab}) for this model", param="tokens")
        text = await asyncio.to_thread(state.session.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    return api


def _served(state, model: str | None) -> None:
    if model is not None and model not in state.models():
        raise not_found(
            f"The model `{model}` does not exist; this server serves: {', '.join(state.models())}",
            param="model",
            code="model_not_found",
        )


def _tokenize(state, body: TokenizeRequest) -> dict:
    tokenizer = state.session.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request(
            "give exactly one of 'prompt' (a text) or 'messages' (a chat)", param="prompt"
        )
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        if not tokenizer.has_chat_template:
            raise bad_request(
                f"{state.request.model} has no chat template, so chat messages cannot be rendered; "
                "send the text as 'prompt'",
                param="messages",
            )
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        try:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt
            )
        except Refusal as exc:
            raise bad_request(str(exc), param="messages") from None
    return {"count": len(ids), "max_model_len": state.session.cfg.max_position, "tokens": ids}

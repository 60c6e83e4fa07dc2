"""OpenAI's chat and completions requests as pydantic models, with vLLM's sampling extras and ours.

Fields OpenAI defines keep its names, defaults and ranges (temperature 1, n 1, max_tokens 16 for
completions). vLLM's extras (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are read
as vLLM reads them. Ours: `steering` (a vector per request). Unknown fields are ignored, as OpenAI's
own server and vLLM do; fields that would change the answer and are not served (tools, a streamed
echo, suffix, best_of, logit_bias, response_format, vLLM's guided decoding, non-text content parts)
are refused rather than ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_N = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Steering(_Body):
    model_config = ConfigDict(extra="forbid")

    vector: str | None = None  # NAME of a NAME.json in `ster serve --vectors DIR`
    artifact: dict[str, Any] | None = None  # or a Ster steering artifact inline
    strength: float = Field(allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # each choice (and chunk) carries its tokens' ids
    # ours
    steering: Steering | None = None
    # not served: read only to refuse them (openai_api.unserved), so an answer never silently
    # ignores them
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        return [value] if isinstance(value, str) else value


class ContentPart(_Body):
    type: str
    text: str | None = None  # a text part's; other types (image_url, input_audio, ...) are refused


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None  # OpenAI's older spelling of tools, refused as they are
    function_call: Any = None
    add_generation_prompt: bool = True  # vLLM's: False continues the last assistant message
    chat_template_kwargs: dict[str, Any] | None = None

    def limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One prompt or several, as text or token ids (OpenAI's four shapes)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

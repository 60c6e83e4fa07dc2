"""generate and parity: text from prompts, and the model against Transformers."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ValidationInfo, field_validator, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import context_of, field, label_in
from ster_dist.schema.common import ChatTemplate, Runtime, chat_template_field, no_stdin
from ster_dist.schema.engine_fields import EngineFields, ModifierFields, top_p_in_range


class GenerateRequest(Runtime, EngineFields, ModifierFields):
    kind = "generate"
    command = ("generate",)
    summary = "generate text"

    @model_validator(mode="before")
    @classmethod
    def _several_vectors(cls, data, info: ValidationInfo):
        """One --vector stays one path (as before); several need one finite strength each, not all
        zero."""
        if not isinstance(data, dict):
            return data
        vectors, strengths = data.get("vector"), data.get("strength")
        if isinstance(vectors, list) and len(vectors) == 1:
            data = {**data, "vector": vectors[0]}
        if isinstance(strengths, list) and len(strengths) == 1:
            data = {**data, "strength": strengths[0]}
        vectors, strengths = data.get("vector"), data.get("strength")
        for value in strengths if isinstance(strengths, list) else [strengths]:
            if isinstance(value, float) and not math.isfinite(value):
                raise Refusal(f"{label_in(info, 'strength')} must be a finite number, got {value}")
        if isinstance(vectors, list) or isinstance(strengths, list):
            count = len(vectors) if isinstance(vectors, list) else int(vectors is not None)
            given = len(strengths) if isinstance(strengths, list) else int(strengths is not None)
            if count != given:
                raise Refusal(
                    f"every {label_in(info, 'vector')} needs its own {label_in(info, 'strength')}: "
                    f"got {count} vectors and {given} strengths"
                )
            if all(isinstance(x, (int, float)) and x == 0 for x in strengths):
                raise Refusal(
                    f"every {label_in(info, 'strength')} is zero, so this mix would steer nothing"
                )
        return data

    # Ster 0.14: any number of --vector/--strength pairs, summed where they share a layer
    vector: str | list[str] | None = field(
        None,
        help="a steering vector artifact (V.json) added during generation; repeat the flag, each "
        "with its own --strength, to steer several traits at once",
        cli={"append": True},
    )
    strength: float | list[float] | None = field(
        None,
        help="the steering strength of the --vector before it (required with each)",
        cli={"append": True, "float": True},
    )
    prompt: str | None = field(None, help="one prompt, answered on stdout")
    prompts: str | None = field(
        None, help='a {"prompts": [...]} JSON file, answered in order (needs --output)'
    )
    output: str | None = field(None, help="the JSON file the answers to --prompts are written to")
    system: str | None = field(None, help="a file holding the system message")
    chat_template: ChatTemplate = chat_template_field()
    max_new_tokens: int = field(64, ge=0, help="the most tokens generated per prompt")
    temperature: float = field(0.0, ge=0, allow_inf_nan=False, help="0 is greedy; above 0 samples")
    top_p: float = field(
        1.0, allow_inf_nan=False, help="nucleus sampling: the probability mass kept, in (0, 1]"
    )
    top_k: int = field(0, ge=0, help="sample among the k most likely tokens only; 0 keeps them all")
    min_p: float = field(
        0.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        help="drop tokens less likely than min_p x the likeliest one's probability",
    )
    seed: int = field(
        0,
        ge=0,
        help="the sampling seed; prompt i of a file draws from seed + i (a queued job "
        "that samples must state it)",
    )
    stop: list[str] | None = field(
        None,
        help="a text that ends the answer where it appears (not shown); repeat "
        "the flag for several",
        cli={"append": True},
    )
    stop_token_ids: list[int] | None = field(
        None,
        help="a token id that ends the answer; repeat the flag for several",
        cli={"append": True, "int": True},
    )
    ignore_eos: bool = field(False, help="keep generating past end-of-sequence tokens (benchmarks)")
    repetition_penalty: float = field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        help="divide the logits of tokens already in the prompt or answer (1 is off)",
    )
    presence_penalty: float = field(
        0.0,
        ge=-2,
        le=2,
        allow_inf_nan=False,
        help="subtracted from the logits of tokens already in the answer",
    )
    frequency_penalty: float = field(
        0.0,
        ge=-2,
        le=2,
        allow_inf_nan=False,
        help="subtracted per occurrence from the logits of tokens already in the answer",
    )
    logprobs: int | None = field(
        None,
        ge=0,
        le=20,
        help="report each chosen token's log-probability and this many "
        "likeliest alternatives, each token's text beside its id",
    )
    stream: bool = field(
        False,
        help="print the answer's text on stdout as it is generated (with --prompt; a job "
        "sends it as text events)",
    )
    # how a command line prints the result; a job's record is the same JSON either way
    format: Literal["json", "text"] = field(
        "json",
        help="json prints the answer with its run's record; text prints "
        "the answer's text alone (with --prompt)",
    )

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float, info: ValidationInfo) -> float:
        return top_p_in_range(value, info)

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo):
        cli = context_of(info, "cli")
        if (self.prompt is None) == (self.prompts is None):
            raise Refusal(
                "give exactly one of --prompt TEXT or --prompts FILE"
                if cli
                else "a generate job spec needs exactly one of the fields 'prompt' (text) or 'prompts' (a file)"
            )
        if self.prompts is not None and self.output is None:
            raise Refusal(
                "--prompts needs --output FILE for the answers"
                if cli
                else "a generate job spec with 'prompts' needs 'output', the file for the answers"
            )
        if (
            context_of(info, "queued")
            and self.temperature > 0
            and "seed" not in self.model_fields_set
        ):
            raise Refusal(
                f"a generate job spec that samples (temperature {self.temperature}) must state 'seed', "
                "so that a retried or re-run job gives the same answer"
            )
        if self.stream and self.prompts is not None:
            raise Refusal(
                f"{label_in(info, 'stream')} prints one answer as it comes; use it with "
                f"{label_in(info, 'prompt')}"
            )
        if self.format == "text" and self.prompts is not None:
            raise Refusal(
                f"{label_in(info, 'format')} text prints one answer's text; use it with "
                f"{label_in(info, 'prompt')} (the answers to {label_in(info, 'prompts')} go to its output "
                "file)"
            )
        no_stdin(self, ("prompts", "system", "vector"), info)
        return self


class Completion(BaseModel):
    """One prompt's answer."""

    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    # "stop" (an end-of-sequence token, a stop token or text) or "length" (the budget ran out)
    finish_reason: str
    # per token: {"token", "text", "logprob", "top": [[id, logprob, text], ...]}
    logprobs: list | None = None


class GenerateResult(BaseModel):
    """What a generate request returns: the run's header and every prompt's completion (a --prompts
    request writes the completions to its output file and returns only their count)."""

    model: str
    model_revision: str | None
    precision: str
    tp: int
    ep: int
    weights: str | None = None  # "fp8" when an FP8 checkpoint's weights were kept as stored
    chat_template: str
    sampling: dict
    steering: dict | None = None
    adapter: dict | None = None
    results: list[Completion] = []
    answered: int = 0  # a --prompts request's answers, written to its output file as they finished

    def header(self) -> dict:
        header = self.model_dump(exclude={"results", "answered"})
        for optional in ("weights", "steering", "adapter"):  # present only when the run carried one
            if header[optional] is None:
                del header[optional]
        return header

    def shown(self, request: GenerateRequest) -> dict:
        """The JSON a command line prints: one prompt's fields inline, or the output file's name."""
        header = self.header()
        if request.prompts is None:
            return {**header, **self.results[0].model_dump(exclude_none=True)}
        return {**header, "output": request.output, "prompts": self.answered}


class ParityRequest(Runtime):
    kind = "parity"
    command = ("parity",)
    summary = "compare against Transformers per layer and on the logits"

    tokens: int = field(24, ge=1, help="tokens of the random sequence compared")
    seed: int = field(0, ge=0, help="the seed of that sequence")
    json_output: bool = field(
        False,
        alias="json",
        help="JSON output (always on; kept for Ster's flag)",
        cli={"flag": "--json"},
    )

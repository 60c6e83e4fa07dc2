"""generate and parity: text from prompts, and the model against Transformers."""

from __future__ import annotations

from pydantic import BaseModel, ValidationInfo, field_validator, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import context_of, field, label_in
from ster_dist.schema.common import (
    ChatTemplate,
    Runtime,
    adapter_field,
    chat_template_field,
    no_stdin,
)


class GenerateRequest(Runtime):
    kind = "generate"
    command = ("generate",)
    summary = "generate text"

    prompt: str | None = field(None, help="one prompt, answered on stdout")
    prompts: str | None = field(None, help='a {"prompts": [...]} JSON file, answered in order (needs --output)')
    output: str | None = field(None, help="the JSON file the answers to --prompts are written to")
    system: str | None = field(None, help="a file holding the system message")
    chat_template: ChatTemplate = chat_template_field()
    max_new_tokens: int = field(64, ge=0, help="the most tokens generated per prompt")
    temperature: float = field(0.0, ge=0, allow_inf_nan=False, help="0 is greedy; above 0 samples")
    top_p: float = field(1.0, allow_inf_nan=False, help="nucleus sampling: the probability mass kept, in (0, 1]")
    seed: int = field(0, ge=0, help="the sampling seed (a queued job that samples must state it)")
    vector: str | None = field(None, help="a steering vector artifact (V.json) added during generation")
    strength: float | None = field(None, allow_inf_nan=False, help="the steering strength; required with --vector")
    adapter: str | None = adapter_field()

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float, info: ValidationInfo) -> float:
        if not 0 < value <= 1:
            raise Refusal(f"{label_in(info, 'top_p')} must lie in (0, 1], got {value}")
        return value

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo):
        cli = context_of(info, "cli")
        if (self.prompt is None) == (self.prompts is None):
            raise Refusal("give exactly one of --prompt TEXT or --prompts FILE" if cli else
                          "a generate job spec needs exactly one of the fields 'prompt' (text) or 'prompts' (a file)")
        if self.prompts is not None and self.output is None:
            raise Refusal("--prompts needs --output FILE for the answers" if cli else
                          "a generate job spec with 'prompts' needs 'output', the file for the answers")
        if self.vector is not None and self.strength is None:
            raise Refusal(f"{label_in(info, 'vector')} needs {label_in(info, 'strength')}: Ster assumes no "
                          "strength (try 1, or a negative one to push away from the trait)")
        if self.vector is None and self.strength is not None:
            raise Refusal(f"{label_in(info, 'strength')} scales a steering vector and exists only with one: add "
                          f"{label_in(info, 'vector')} or drop it")
        if context_of(info, "queued") and self.temperature > 0 and "seed" not in self.model_fields_set:
            raise Refusal(f"a generate job spec that samples (temperature {self.temperature}) must state 'seed', "
                          "so that a retried or re-run job gives the same answer")
        no_stdin(self, ("prompts", "system", "vector"), info)
        return self


class Completion(BaseModel):
    """One prompt's answer."""

    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (an end-of-sequence token) or "length" (the budget ran out)


class GenerateResult(BaseModel):
    """What a generate request returns: the run's header and every prompt's completion (a --prompts
    request writes the completions to its output file and returns only their count)."""

    model: str
    model_revision: str | None
    precision: str
    tp: int
    ep: int
    chat_template: str
    sampling: dict
    steering: dict | None = None
    adapter: dict | None = None
    results: list[Completion] = []

    def header(self) -> dict:
        header = self.model_dump(exclude={"results"})
        for optional in ("steering", "adapter"):  # present only when the run carried one
            if header[optional] is None:
                del header[optional]
        return header

    def shown(self, request: GenerateRequest) -> dict:
        """The JSON a command line prints: one prompt's fields inline, or the output file's name."""
        header = self.header()
        if request.prompts is None:
            return {**header, **self.results[0].model_dump()}
        return {**header, "output": request.output, "prompts": len(self.results)}

    def written(self) -> dict:
        return {**self.header(), "results": [c.model_dump() for c in self.results]}


class ParityRequest(Runtime):
    kind = "parity"
    command = ("parity",)
    summary = "compare against Transformers per layer and on the logits"

    tokens: int = field(24, ge=1, help="tokens of the random sequence compared")
    seed: int = field(0, ge=0, help="the seed of that sequence")
    json_output: bool = field(False, alias="json", help="JSON output (always on; kept for Ster's flag)",
                              cli={"flag": "--json"})

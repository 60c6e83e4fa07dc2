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
    top_k: int = field(0, ge=0, help="sample among the k most likely tokens only; 0 keeps them all")
    min_p: float = field(0.0, ge=0, le=1, allow_inf_nan=False,
                         help="drop tokens less likely than min_p x the likeliest one's probability")
    seed: int = field(0, ge=0, help="the sampling seed; prompt i of a file draws from seed + i (a queued job "
                                    "that samples must state it)")
    stop: list[str] | None = field(None, help="a text that ends the answer where it appears (not shown); repeat "
                                              "the flag for several", cli={"append": True})
    stop_token_ids: list[int] | None = field(None, help="a token id that ends the answer; repeat the flag for several",
                                             cli={"append": True, "int": True})
    ignore_eos: bool = field(False, help="keep generating past end-of-sequence tokens (benchmarks)")
    repetition_penalty: float = field(1.0, gt=0, allow_inf_nan=False,
                                      help="divide the logits of tokens already in the prompt or answer (1 is off)")
    presence_penalty: float = field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                    help="subtracted from the logits of tokens already in the answer")
    frequency_penalty: float = field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                     help="subtracted per occurrence from the logits of tokens already in the answer")
    logprobs: int | None = field(None, ge=0, le=20, help="report each chosen token's log-probability and this many "
                                                       "likeliest alternatives")
    stream: bool = field(False, help="print the answer's text on stdout as it is generated (with --prompt; a job "
                                     "sends it as text events)")
    kv_cache_memory: str | None = field(None, help="bytes of KV cache per rank, e.g. 2GiB or 500MB (default: a "
                                                   "tenth of the memory free at start, at most 1GiB)")
    max_step_tokens: int = field(512, ge=16, help="tokens one forward step carries: decodes plus prefill chunks")
    vector: str | None = field(None, help="a steering vector artifact (V.json) added during generation")
    strength: float | None = field(None, allow_inf_nan=False, help="the steering strength; required with --vector")
    adapter: str | None = adapter_field()

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float, info: ValidationInfo) -> float:
        return top_p_in_range(value, info)

    @model_validator(mode="after")
    def _one_source(self, info: ValidationInfo):
        cli = context_of(info, "cli")
        if (self.prompt is None) == (self.prompts is None):
            raise Refusal("give exactly one of --prompt TEXT or --prompts FILE" if cli else
                          "a generate job spec needs exactly one of the fields 'prompt' (text) or 'prompts' (a file)")
        if self.prompts is not None and self.output is None:
            raise Refusal("--prompts needs --output FILE for the answers" if cli else
                          "a generate job spec with 'prompts' needs 'output', the file for the answers")
        check_vector_strength(self, info)
        if context_of(info, "queued") and self.temperature > 0 and "seed" not in self.model_fields_set:
            raise Refusal(f"a generate job spec that samples (temperature {self.temperature}) must state 'seed', "
                          "so that a retried or re-run job gives the same answer")
        if self.stream and self.prompts is not None:
            raise Refusal(f"{label_in(info, 'stream')} prints one answer as it comes; use it with "
                          f"{label_in(info, 'prompt')}")
        check_kv_cache_memory(self, info)
        no_stdin(self, ("prompts", "system", "vector"), info)
        return self

    def engine_options(self) -> tuple:
        """What the session's token engine is built with (requests with other options rebuild it)."""
        return engine_options(self)


# -- checks and options generation requests share (generate, chat) ------------------------------

def top_p_in_range(value: float, info: ValidationInfo) -> float:
    if not 0 < value <= 1:
        raise Refusal(f"{label_in(info, 'top_p')} must lie in (0, 1], got {value}")
    return value


def check_vector_strength(request, info: ValidationInfo) -> None:
    """--vector and --strength come together: Ster assumes no strength, and a strength alone scales nothing."""
    if request.vector is not None and request.strength is None:
        raise Refusal(f"{label_in(info, 'vector')} needs {label_in(info, 'strength')}: Ster assumes no "
                      "strength (try 1, or a negative one to push away from the trait)")
    if request.vector is None and request.strength is not None:
        raise Refusal(f"{label_in(info, 'strength')} scales a steering vector and exists only with one: add "
                      f"{label_in(info, 'vector')} or drop it")


def check_kv_cache_memory(request, info: ValidationInfo) -> None:
    if request.kv_cache_memory is not None:
        memory_bytes(request.kv_cache_memory, label_in(info, "kv_cache_memory"))


def engine_options(request) -> tuple:
    """(KV cache bytes or None, max step tokens): what a session's token engine is built with."""
    memory = memory_bytes(request.kv_cache_memory, "kv_cache_memory") if request.kv_cache_memory else None
    return (memory, request.max_step_tokens)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def memory_bytes(text: str, where: str) -> int:
    """'2GiB', '500MB', '1.5gb' or a plain byte count, as bytes; refused in one line otherwise."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise Refusal(f"{where} takes a size such as 2GiB, 500MB or a byte count, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise Refusal(f"{where} must be more than zero bytes, got {text!r}")
    return value


class Completion(BaseModel):
    """One prompt's answer."""

    prompt: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (an end-of-sequence token, a stop token or text) or "length" (the budget ran out)
    logprobs: list | None = None  # per token: {"token", "logprob", "top": [[id, logprob], ...]}


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
    answered: int = 0  # a --prompts request's answers, written to its output file as they finished

    def header(self) -> dict:
        header = self.model_dump(exclude={"results", "answered"})
        for optional in ("steering", "adapter"):  # present only when the run carried one
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
    json_output: bool = field(False, alias="json", help="JSON output (always on; kept for Ster's flag)",
                              cli={"flag": "--json"})

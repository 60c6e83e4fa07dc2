"""chat: a conversation with a model in the terminal, over the session's token engine.

Not a job kind: it reads its turns from standard input as they are typed. Its sampling, steering,
adapter and engine fields mean what generate's do (schema/generate.py) and are checked by the same
functions; only `system` differs: here it is the system message's text, not a file.
"""

from __future__ import annotations

from pydantic import ValidationInfo, field_validator, model_validator

from ster_dist.schema.base import field
from ster_dist.schema.common import Runtime, adapter_field
from ster_dist.schema.generate import (
    check_kv_cache_memory,
    check_vector_strength,
    engine_options,
    top_p_in_range,
)


class ChatRequest(Runtime):
    kind = None
    command = ("chat",)
    summary = "chat with a model in the terminal, answers streamed as they are generated"
    result_on_stdout = False

    system: str | None = field(None, help="the system message (its text), first in the conversation")
    max_new_tokens: int = field(256, ge=0, help="the most tokens generated per answer")
    temperature: float = field(0.0, ge=0, allow_inf_nan=False, help="0 is greedy; above 0 samples")
    top_p: float = field(1.0, allow_inf_nan=False, help="nucleus sampling: the probability mass kept, in (0, 1]")
    top_k: int = field(0, ge=0, help="sample among the k most likely tokens only; 0 keeps them all")
    seed: int = field(0, ge=0, help="the sampling seed; turn i of a conversation draws from seed + i")
    kv_cache_memory: str | None = field(None, help="bytes of KV cache per rank, e.g. 2GiB or 500MB (default: a "
                                                   "tenth of the memory free at start, at most 1GiB)")
    max_step_tokens: int = field(512, ge=16, help="tokens one forward step carries: decodes plus prefill chunks")
    vector: str | None = field(None, help="a steering vector artifact (V.json) added to every answer")
    strength: float | None = field(None, allow_inf_nan=False, help="the steering strength; required with --vector")
    adapter: str | None = adapter_field()

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float, info: ValidationInfo) -> float:
        return top_p_in_range(value, info)

    @model_validator(mode="after")
    def _pairs(self, info: ValidationInfo):
        check_vector_strength(self, info)
        check_kv_cache_memory(self, info)
        return self

    def engine_options(self) -> tuple:
        """What the session's token engine is built with."""
        return engine_options(self)

"""chat: a conversation with a model in the terminal, over the session's token engine.

Not a job kind: it reads its turns from standard input as they are typed. Its sampling, steering,
adapter and engine fields mean what generate's do (schema/generate.py) and are checked by the same
functions; only `system` differs: here it is the system message's text, not a file.
"""

from __future__ import annotations

from pydantic import ValidationInfo, field_validator

from ster_dist.schema.base import field
from ster_dist.schema.common import Runtime
from ster_dist.schema.engine_fields import EngineFields, ModifierFields, top_p_in_range


class ChatRequest(Runtime, EngineFields, ModifierFields):
    kind = None
    command = ("chat",)
    summary = "chat with a model in the terminal, answers streamed as they are generated"
    result_on_stdout = False

    system: str | None = field(
        None, help="the system message (its text), first in the conversation"
    )
    max_new_tokens: int = field(256, ge=0, help="the most tokens generated per answer")
    temperature: float = field(0.0, ge=0, allow_inf_nan=False, help="0 is greedy; above 0 samples")
    top_p: float = field(
        1.0, allow_inf_nan=False, help="nucleus sampling: the probability mass kept, in (0, 1]"
    )
    top_k: int = field(0, ge=0, help="sample among the k most likely tokens only; 0 keeps them all")
    seed: int = field(
        0, ge=0, help="the sampling seed; turn i of a conversation draws from seed + i"
    )
    events: bool = field(
        False,
        help="progress and totals as JSON events on stderr, as other commands print "
        "them (the default where stderr is not a terminal; on one, progress is a "
        "line that updates and the totals are words)",
    )

    @field_validator("top_p")
    @classmethod
    def _top_p_range(cls, value: float, info: ValidationInfo) -> float:
        return top_p_in_range(value, info)

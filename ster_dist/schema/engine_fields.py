"""Field groups of the requests that run on the token engine (generate, chat, serve): the engine's
own options and the modifiers a request carries (a steering vector, an adapter), each with its
checks, so the three commands name, default and refuse them alike."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ValidationInfo, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import Request, field, label_in
from ster_dist.schema.common import adapter_field

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def memory_bytes(text: str, where: str) -> int:
    """'2GiB', '500MB', '1.5gb' or a plain byte count, as bytes; refused in one line otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise Refusal(f"{where} takes a size such as 2GiB, 500MB or a byte count, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise Refusal(f"{where} must be more than zero bytes, got {text!r}")
    return value


class EngineFields(Request):
    kv_cache_memory: str | None = field(
        None,
        help="bytes of KV cache per rank (recurrent layers' states included), "
        "e.g. 2GiB or 500MB (default: a tenth of the memory free at "
        "start, at most 1GiB)",
    )
    max_step_tokens: int = field(
        512, ge=16, help="tokens one forward step carries: decodes plus prefill chunks"
    )
    speculative: Literal["mtp"] | None = field(
        None,
        help="speculative decoding: mtp drafts with the model's "
        "multi-token-prediction layer (DeepSeek-V3's), verified "
        "by the model in the same step (default: none)",
    )
    num_speculative_tokens: int = field(
        1, ge=1, le=8, help="draft tokens per decode step with --speculative"
    )
    enforce_eager: bool = field(
        False,
        help="run every step eagerly: no compiled layers (by default a CPU engine "
        "compiles its layers once it has run 128 steps)",
    )
    pack_weights: Literal["auto", "on", "off"] = field(
        "auto",
        help="on a CPU, hold each projection's weight a second time in a layout its products read "
        "faster (panels of 32 outputs with AVX-512, else oneDNN's own, bf16 as f32 on AVX2; auto: where "
        "the copies take at most a quarter of the memory free)",
    )

    kernels: Literal["triton", "native", "torch"] | None = field(
        None,
        help="the kernels layers run: triton (the Triton kernels: CUDA, or a CPU under TRITON_INTERPRET=1), "
        "native (our CPU kernels where built) or torch (torch's operations only); default: triton on "
        "CUDA, native on a CPU",
    )

    @model_validator(mode="after")
    def _triton_installed(self, info: ValidationInfo):
        if (
            self.kernels != "triton"
        ):  # kernels/ imports torch: a command line's refusals come before it
            return self
        from ster_dist.kernels import triton

        if not triton.installed():
            raise Refusal(
                f"{label_in(info, 'kernels')} triton needs the triton package (pip install "
                "'ster_dist[gpu]'); or pick native or torch"
            )
        # the run's, where the request has one: refused before loading
        device = getattr(self, "device", None)
        if device is not None:
            triton.refuse_unless_usable(device)
        return self

    @model_validator(mode="after")
    def _kv_cache_memory(self, info: ValidationInfo):
        if self.kv_cache_memory is not None:
            memory_bytes(self.kv_cache_memory, label_in(info, "kv_cache_memory"))
        return self

    @model_validator(mode="after")
    def _drafts_with_speculative(self, info: ValidationInfo):
        if self.speculative is None and "num_speculative_tokens" in self.model_fields_set:
            raise Refusal(
                f"{label_in(info, 'num_speculative_tokens')} counts the drafts of "
                f"{label_in(info, 'speculative')}; add --speculative mtp or drop it"
            )
        return self

    def engine_options(self) -> tuple:
        """(KV cache bytes or None, max step tokens, draft tokens per decode or 0, enforce eager,
        pack weights, kernels or None): what the session's token engine is built with (requests with
        other options rebuild an idle one)."""
        memory = (
            memory_bytes(self.kv_cache_memory, "kv_cache_memory") if self.kv_cache_memory else None
        )
        return (
            memory,
            self.max_step_tokens,
            self.num_speculative_tokens if self.speculative else 0,
            self.enforce_eager,
            self.pack_weights,
            self.kernels,
        )


class ModifierFields(Request):
    vector: str | None = field(
        None, help="a steering vector artifact (V.json) added during generation"
    )
    strength: float | None = field(
        None, allow_inf_nan=False, help="the steering strength; required with --vector"
    )
    adapter: str | None = adapter_field()

    @model_validator(mode="after")
    def _vector_with_strength(self, info: ValidationInfo):
        """--vector and --strength come together: Ster assumes no strength, and a strength alone
        scales nothing."""
        if self.vector is not None and self.strength is None:
            raise Refusal(
                f"{label_in(info, 'vector')} needs {label_in(info, 'strength')}: Ster assumes no "
                "strength (try 1, or a negative one to push away from the trait)"
            )
        if self.vector is None and self.strength is not None:
            raise Refusal(
                f"{label_in(info, 'strength')} scales a steering vector and exists only with one: add "
                f"{label_in(info, 'vector')} or drop it"
            )
        return self


def top_p_in_range(value: float, info: ValidationInfo) -> float:
    if not 0 < value <= 1:
        raise Refusal(f"{label_in(info, 'top_p')} must lie in (0, 1], got {value}")
    return value

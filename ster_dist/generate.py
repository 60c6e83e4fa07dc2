"""Batched sampling on the decoder: left-padded prompts, one prefill, then one token per step.

Temperature 0 is argmax; otherwise softmax at that temperature, cut to the
top-p nucleus, drawn from a generator seeded once, so the same seed gives the
same output. Rows stop at their first EOS token; the loop stops when all have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ster_dist import kernels
from ster_dist.errors import Refusal
from ster_dist.model.decoder import Decoder


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self, name: Callable[[str], str] = lambda field: f"--{field.replace('_', '-')}") -> "Sampling":
        """Refuse what cannot be sampled; `name` words a field (a flag by default, a job spec's
        field for the job queue's rules)."""
        if self.max_new_tokens < 0:
            raise Refusal(f"{name('max_new_tokens')} must be zero or more, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise Refusal(f"{name('temperature')} must be zero or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise Refusal(f"{name('top_p')} must lie in (0, 1], got {self.top_p}")
        return self


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, valid) for prompts left-padded to one length; positions skip the padding."""
    if any(len(p) == 0 for p in prompts):
        raise Refusal("a prompt encodes to no tokens; give it some text or turn the chat template on")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        valid[row, width - len(prompt):] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    return ids, positions, valid


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """One token per row from logits [batch, vocab]."""
    if sampling.temperature == 0:
        return kernels.argmax(logits)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > sampling.top_p  # keep the token that crosses p
        sorted_probs = sorted_probs.masked_fill(outside, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model: Decoder, prompts: list[list[int]], sampling: Sampling, eos_ids: tuple[int, ...] = (),
             pad_id: int = 0, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
    """New token ids for each prompt (EOS included when it ends a row).

    Under tensor parallelism every rank holds the gathered logits; `agree` hands
    each step's tokens to the lead rank's choice, so the ranks never drift apart. Under pipeline
    parallelism only the last stage holds logits (the model returns None elsewhere): the other
    stages take the tokens `agree` hands them.
    """
    sampling.check()
    ids, positions, valid = left_pad(prompts, pad_id)
    batch = ids.shape[0]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    if sampling.max_new_tokens == 0:
        return outputs
    cache = model.new_cache(batch, ids.shape[1] + sampling.max_new_tokens)
    # the draws' generator lies where the probabilities do (a CUDA one there; the CPU's otherwise)
    generator = torch.Generator(model.device if model.device.type == "cuda" else "cpu").manual_seed(sampling.seed)
    logits = _last(model(ids, positions, valid, cache, last_only=True))
    next_pos = positions[:, -1:] + 1
    done = [False] * batch
    eos = set(eos_ids)
    for step in range(sampling.max_new_tokens):
        tokens = sample(logits, sampling, generator) if logits is not None else torch.zeros(batch, dtype=torch.long)
        if agree is not None:
            tokens = agree(tokens)
        picked = tokens.tolist()  # the step's one read of the device: its sampled tokens (model/host.py)
        for row, token in enumerate(picked):
            if not done[row]:
                outputs[row].append(token)
                done[row] = token in eos
        if all(done) or step == sampling.max_new_tokens - 1:
            break
        logits = _last(model(tokens.unsqueeze(1), next_pos, torch.ones(next_pos.shape, dtype=torch.bool), cache))
        next_pos = next_pos + 1
    return outputs


def _last(logits: torch.Tensor | None) -> torch.Tensor | None:
    return None if logits is None else logits[:, -1]

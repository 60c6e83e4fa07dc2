"""Gemma 3n's widened residual stream read from its config (config.py's AltUp part): how many copies
of the hidden state AltUp carries, and the per-layer inputs added to them."""

from __future__ import annotations

from dataclasses import dataclass

from ster_dist.config.keys import Keys
from ster_dist.errors import Refusal


@dataclass(frozen=True)
class AltUpConfig:
    """AltUp's copies of the hidden state (the first is the one each block runs on) and the
    per-layer inputs: a width-`per_layer_width` slice per layer of a second embedding table, joined
    with a projection of the embedding and added, gated, to every copy but the first after each
    layer."""

    copies: int  # altup_num_inputs
    # the first corrected copy times correct_output_scale before its gate
    correct_scale: bool
    per_layer_width: int  # hidden_size_per_layer_input
    per_layer_vocab: int  # vocab_size_per_layer_input: ids past it read row 0


def altup_config(keys: Keys) -> AltUpConfig | None:
    """The AltUp part of a normalised config; None where it states no altup_num_inputs."""
    copies = keys.get("altup_num_inputs")
    if copies is None:
        return None
    width, vocab = keys.get("hidden_size_per_layer_input"), keys.get("vocab_size_per_layer_input")
    for key, value in (
        ("altup_num_inputs", copies),
        ("hidden_size_per_layer_input", width),
        ("vocab_size_per_layer_input", vocab),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise Refusal(
                f"invalid model config {keys.path}: {key} is {value!r}; state a positive integer"
            )
    return AltUpConfig(
        copies=copies,
        correct_scale=bool(keys.get("altup_correct_scale", default=True)),
        per_layer_width=width,
        per_layer_vocab=vocab,
    )

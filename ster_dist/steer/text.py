"""How steering, capture and decisions turn text into token ids, and what they record about it.

A direction is a displacement between two points of the residual stream, and where those points
sit depends on the markers around the text, so every read encodes a prompt the way generation
will: as a user turn through the chat template when the run applies one, else as plain text with
the tokenizer's special tokens. `chat_status` is the word an artifact records for that decision
(Ster's three: applied, absent, off).
"""

from __future__ import annotations

from ster_dist.errors import Refusal
from ster_dist.tokenizer import CHAT_TEMPLATE_MODES, Tokenizer


def chat_status(tokenizer: Tokenizer, mode: str) -> str:
    """ "applied" when prompts go through the chat template, "off" when the run turned it off,
    "absent" when auto found none."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise Refusal(
            f"--chat-template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}"
        )
    if mode == "off":
        return "off"
    if tokenizer.has_chat_template:
        return "applied"
    if mode == "on":
        raise Refusal(
            f"{tokenizer.directory} has no chat template: use --chat-template auto or off"
        )
    return "absent"


def encode_prompt(tokenizer: Tokenizer, text: str, mode: str) -> list[int]:
    """A prompt as generation encodes it: a user turn awaiting the answer, or plain text."""
    if not isinstance(text, str) or not text.strip():
        raise Refusal("prompt must not be empty; give every prompt some text")
    ids = tokenizer.prompt_ids(text, None, mode)
    if not ids:
        raise Refusal(
            "tokenizer produced no tokens for a prompt; give it text this tokenizer recognises"
        )
    return ids


def encode_response(tokenizer: Tokenizer, text: str, mode: str) -> list[int]:
    """A whole utterance as the model would produce it: under a template an assistant turn (so a
    pair's sides are scored inside the markers inference puts around them), else plain text."""
    if not isinstance(text, str) or not text.strip():
        raise Refusal("prompt must not be empty; give every pair side some text")
    if chat_status(tokenizer, mode) == "applied":
        rendered = tokenizer.render_chat(
            [{"role": "assistant", "content": text}], add_generation_prompt=False
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise Refusal(
            "tokenizer produced no tokens for a pair side; give it text this tokenizer recognises"
        )
    return ids

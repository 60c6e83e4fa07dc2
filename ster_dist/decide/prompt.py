"""The text the model reads for one question in one option order (Ster's rendering, byte for
byte), and the orders: n cyclic shifts, so every option wears every letter exactly once."""

from __future__ import annotations

from ster_dist.decide.request import Question, Request, text_of

LABELS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
HEADER = (
    "Decide the question below about the state. Reply with the letter of the one option that fits "
    "best.\n\nState:\n"
)


def orders(count: int, requested: int) -> list[list[int]]:
    """Position -> canonical option, per shift; 0 asks for every shift, n caps them at n."""
    shifts = count if requested == 0 else min(requested, count)
    return [[(position + shift) % count for position in range(count)] for shift in range(shifts)]


def render(request: Request, question: Question, options: list[str], order: list[int]) -> str:
    lines = [
        HEADER,
        text_of(request.state).strip(),
        "\n\nQuestion: ",
        text_of(question.instructions).strip(),
        "\n\nOptions:\n",
    ]
    for position, index in enumerate(order):
        lines.append(f"{LABELS[position]}. {options[index].strip()}\n")
    lines.append("\nAnswer:")
    return "".join(lines)

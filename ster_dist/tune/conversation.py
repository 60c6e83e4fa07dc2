"""Multi-turn GRPO rollouts (`tune grpo --turns N --user-model M`): a conversation between the
policy and a user model, N policy turns, sampled on the training rank or by the token engine
(tune/engine_rollouts.py).

The prompt is the user's first message. The policy answers it (its tokens as sampled, ended by a
stop token or --max-new-tokens); the user model answers that, and so on until the policy has had N
turns. The policy's sequence is one token row: its prompt, its turns exactly as sampled, and between
them the user's turns as the policy's chat template writes them (the end of the assistant's turn,
the user's message, the start of the next assistant turn). That text comes from rendering the
conversation with a marker in place of the last answer and taking what follows the marker; the stop
token the answer already ended with is not written twice. Only the policy's own tokens carry loss
(Rollout.user_spans are masked); the reward reads the whole conversation, `length` counting the
policy's tokens.

The user model sees the conversation from its side: its own messages (the prompt first) as the
assistant's, the policy's as the user's, through its own chat template, without the policy's
factors. Where each side's turns are drawn is the caller's (a `Side`'s draw): on the training ranks,
another checkpoint loaded beside the policy (its tensor-parallel shards, frozen) or, when
--user-model names the policy's base, the same decoder with the factors skipped; with --rollout
engine, the policy's turns by the engine under the pushed factors, the user's as requests without
the adapter on the same engine (the base) or on a second engine holding the other checkpoint. The
turns are taken in the same order and drawn from the same seeds wherever they are drawn, so where
the logits agree the conversations do. Texts pass between the two as decoded text, so the two may
have different tokenizers.

A conversation that would pass --max-sequence (or the user model's positions) ends after the last
turn that fits. Each turn draws from its own seed (tune/rollout.turn_seed): the same conversations
however dp and accumulation split a step, and turn 0 draws as a single-turn rollout does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ster_dist.errors import Refusal
from ster_dist.tune.rollout import Prompt, turn_seed

# stands for the last answer in a rendering: plain letters no template rewrites
MARK = "STERTURNMARK"


@dataclass(frozen=True)
class Rollout:
    """One sampled conversation as the policy's token row."""

    ids: tuple[int, ...]
    prompt_tokens: int
    # [start, stop) of ids written for the user's turns: no loss
    user_spans: tuple[tuple[int, int], ...]
    policy_tokens: int  # tokens the policy sampled, stop tokens included
    policy_stops: int  # how many of its turns ended with a stop token


# rows, one seed per row, one token limit per row -> each row's continuation (ended by a stop token
# or the limit)
Draw = Callable[[list[list[int]], list[int], list[int]], list[list[int]]]


@dataclass(frozen=True)
class Side:
    """One speaker: how its turns are drawn, the tokenizer that reads and writes them, the tokens
    that end them, and how long its sequence may grow (the policy: --max-sequence; the user: its
    positions)."""

    draw: Draw
    tokenizer: object
    stops: frozenset[int]
    max_position: int


def bridge_ids(
    tokenizer, messages: list[dict], user_text: str, ended_with: int | None
) -> list[int]:
    """The policy's tokens from the end of its last answer to the start of its next: the template's
    text after the answer (messages[-1], an assistant message) with the user's message and the
    generation prompt."""
    marked = [
        *messages[:-1],
        {**messages[-1], "content": MARK},
        {"role": "user", "content": user_text},
    ]
    rendered = tokenizer.render_chat(marked, add_generation_prompt=True)
    at = rendered.rfind(MARK)
    if at < 0:
        raise Refusal(
            "the chat template does not write the assistant's answer as given; multi-turn GRPO needs "
            "a template that writes each message's content"
        )
    tail = rendered[at + len(MARK) :]
    # the answer's own stop token already closed the turn: do not write it twice
    if ended_with is not None:
        stop_text = tokenizer.decode([ended_with], skip_special_tokens=False)
        if stop_text and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]
    return tokenizer.encode(tail, add_special_tokens=False)


@dataclass
class _Talk:
    """One conversation while it is sampled."""

    prompt: Prompt
    completion: int
    ids: list[int]
    policy_view: list[dict]
    user_view: list[dict]
    spans: list = field(default_factory=list)
    sampled: int = 0
    stopped: int = 0
    ended: int | None = None  # the stop token the policy's last turn ended with
    open: bool = True  # more turns may follow


def converse(
    policy: Side,
    user: Side,
    prompts: list[Prompt],
    group: int,
    turns: int,
    max_new_tokens: int,
    seed: int,
    step: int,
) -> list[list[Rollout]]:
    """Each prompt's `group` conversations at step `step`, every turn sampled for all of them at
    once."""
    stops, max_sequence, policy_tokenizer = policy.stops, policy.max_position, policy.tokenizer
    talks = [
        _Talk(
            p,
            j,
            list(p.ids),
            ([{"role": "system", "content": p.system}] if p.system is not None else [])
            + [{"role": "user", "content": p.text}],
            [{"role": "assistant", "content": p.text}],
        )
        for p in prompts
        for j in range(group)
    ]
    for turn in range(turns):
        talking = [t for t in talks if t.open and max_sequence - len(t.ids) >= 1]
        for t in talks:
            t.open = t in talking
        if not talking:
            break
        answers = policy.draw(
            [t.ids for t in talking],
            [turn_seed(seed, step, t.prompt.index, t.completion, turn) for t in talking],
            [min(max_new_tokens, max_sequence - len(t.ids)) for t in talking],
        )
        for t, answer in zip(talking, answers):
            t.ids += answer
            t.sampled += len(answer)
            t.ended = answer[-1] if answer and answer[-1] in stops else None
            t.stopped += t.ended is not None
            text = policy_tokenizer.decode(
                answer[:-1] if t.ended is not None else answer, skip_special_tokens=True
            )
            t.policy_view.append({"role": "assistant", "content": text})
            t.user_view.append({"role": "user", "content": text})
        if turn == turns - 1:
            break
        contexts = [
            user.tokenizer.apply_chat_template(t.user_view, add_generation_prompt=True)
            for t in talking
        ]
        room = [min(max_new_tokens, user.max_position - len(c)) for c in contexts]
        asked = [i for i, r in enumerate(room) if r >= 1]
        for i, t in enumerate(talking):
            t.open = i in asked
        replies = user.draw(
            [contexts[i] for i in asked],
            [
                turn_seed(
                    seed, step, talking[i].prompt.index, talking[i].completion, turn, user=True
                )
                for i in asked
            ],
            [room[i] for i in asked],
        )
        for i, reply in zip(asked, replies):
            t = talking[i]
            text = user.tokenizer.decode(
                reply[:-1] if reply and reply[-1] in user.stops else reply, skip_special_tokens=True
            )
            bridge = bridge_ids(policy_tokenizer, t.policy_view, text, t.ended)
            if len(t.ids) + len(bridge) + 1 > max_sequence:  # no room left for the policy to answer
                t.open = False
                continue
            t.user_view.append({"role": "assistant", "content": text})
            t.policy_view.append({"role": "user", "content": text})
            t.spans.append((len(t.ids), len(t.ids) + len(bridge)))
            t.ids += bridge
    rollouts = [
        Rollout(tuple(t.ids), len(t.prompt.ids), tuple(t.spans), t.sampled, t.stopped)
        for t in talks
    ]
    return [rollouts[i * group : (i + 1) * group] for i in range(len(prompts))]

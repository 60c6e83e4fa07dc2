"""/v1/completions' `echo`: the prompt before each choice's text and, with `logprobs`, the prompt's
own tokens in the choice's logprobs, each with its log-probability given the tokens before it (the
first null: nothing comes before it), as OpenAI's legacy completions and vLLM answer.
lm-evaluation-harness's loglikelihood tasks read exactly these (`echo: true, logprobs: 1`, often
`max_tokens: 0` or 1): without them its scores fall silently to chance.

The prompt's log-probabilities come from one forward pass over the whole prompt on the served
model's ranks (steer/evaluate.token_logprobs), run while the token engine waits between two of its
steps (session.exclusive), one prompt at a time.
"""

from __future__ import annotations

import math


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def finite(logprob: float) -> float:
    """JSON has no -inf nor NaN (a masked token's log-probability, or logits a steered model made
    non-finite): vLLM's floor of -9999.0 stands for them, so every client can parse the answer."""
    return logprob if math.isfinite(logprob) else -9999.0


def prompt_logprobs(session, prompts: list[list[int]], top: int) -> list[list]:
    """Per prompt, (log-probability, [(id, log-probability)] of the `top` likeliest) for each token
    after its first. Blocking: called on a thread."""
    from ster_dist.steer.evaluate import LogprobsOnRank

    with session.exclusive():
        group = session.group
        return group.on(LogprobsOnRank).token_logprobs(prompts, top)[group.lead]


def echoed(
    answer: dict,
    n: int,
    tokenizer,
    prompts: list[list[int]],
    texts: list[str],
    scored: list[list] | None,
) -> dict:
    """`answer` (a whole /v1/completions answer) with each choice's prompt put before its text and,
    when `scored`, before its logprobs. Choices are prompt-major: choice i is prompt i // n's."""
    for choice in answer["choices"]:
        index = choice["index"] // n
        choice["text"] = texts[index] + choice["text"]
        if scored is not None:
            choice["logprobs"] = _joined(
                tokenizer, prompts[index], scored[index], choice["logprobs"]
            )
    return answer


def _joined(tokenizer, ids: list[int], scored: list, generated: dict) -> dict:
    tokens = [token_text(tokenizer, i) for i in ids] + generated["tokens"]
    token_logprobs = [None, *(finite(lp) for lp, _ in scored), *generated["token_logprobs"]]
    top_logprobs = [
        None,
        *({token_text(tokenizer, i): finite(lp) for i, lp in best} for _, best in scored),
        *generated["top_logprobs"],
    ]
    return completion_logprobs(tokens, token_logprobs, top_logprobs)


def completion_logprobs(tokens: list[str], token_logprobs: list, top_logprobs: list) -> dict:
    """A completion choice's `logprobs` as OpenAI writes it: each token with its text offset."""
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }

"""One request's output as it comes: text deltas, readable from a thread or from asyncio.

The engine thread puts deltas; a consumer iterates them (`for delta in stream` blocks, `async for`
awaits without a thread per request). The last delta carries the finish reason; a failure of the
engine is raised to every consumer.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort", on the last delta only
    # per token: None or (id, logprob, [(id, logprob), ...])
    logprobs: list = field(default_factory=list)
    # per token, when logits_of was asked: those ids' raw logits
    scores: list = field(default_factory=list)


@dataclass(frozen=True)
class Finished:
    """A whole request: what its deltas add up to."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list
    cached_tokens: int = 0
    # per token: the raw logits of SamplingParams.logits_of
    scores: list = field(default_factory=list)


class RequestStream:
    def __init__(self, request_id: str, prompt_tokens: int, cancel, on_finish=None):
        self.id = request_id
        # called once, from the engine's thread, when the last delta is in
        self._on_finish = on_finish
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # prompt tokens the prefix cache served (set at admission)
        self._cancel = cancel
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._wakers: list = []
        self._done = False

    # -- the engine's side ----------------------------------------------------------------------
    def put(self, item: Delta | BaseException) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()
        if self._on_finish is not None and (
            isinstance(item, BaseException) or item.finish_reason is not None
        ):
            on_finish, self._on_finish = self._on_finish, None
            on_finish(self)

    # -- the consumer's side --------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop generating; the stream ends with finish_reason "abort" (its blocks are freed at
        once)."""
        self._cancel(self.id)

    @property
    def finished(self) -> bool:
        """The consumer has read the last delta (or the failure)."""
        return self._done

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        with self._cond:
            while not self._items:
                if self._done:
                    raise StopIteration
                self._cond.wait()
            return self._take()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        while True:
            with self._cond:
                if self._items:
                    return self._take()
                if self._done:
                    raise StopAsyncIteration
                event, loop = asyncio.Event(), asyncio.get_running_loop()
                self._wakers.append(lambda: loop.call_soon_threadsafe(event.set))
            await event.wait()

    def _take(self) -> Delta:
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def result(self, on_delta=None) -> Finished:
        """Wait for the whole output (handing each delta to `on_delta` as it comes)."""
        text, ids, logprobs, scores, reason = [], [], [], [], None
        for delta in self:
            if on_delta is not None:
                on_delta(delta)
            text.append(delta.text)
            ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
            scores.extend(delta.scores)
            reason = delta.finish_reason or reason
        return Finished(
            "".join(text),
            ids,
            reason or "abort",
            self.prompt_tokens,
            logprobs,
            self.cached_tokens,
            scores,
        )

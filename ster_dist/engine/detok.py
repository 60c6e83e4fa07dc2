"""Incremental detokenization: text deltas for a request's tokens as they come, and stop strings.

Each step decodes a short window of ids, vLLM's prefix_offset / read_offset trick: the window
starts at the tokens of the last released chunk (context for decoders that look at neighbours,
such as SentencePiece's leading-space strip) and the delta is what the new tokens add to that
context's text. A window whose text ends in U+FFFD is an incomplete UTF-8 character (byte-level
BPE splits them across tokens): nothing is released until a later token completes it.

The deltas add up to `tokenizer.decode(output ids)`, the text ster_dist's generate prints, until a
stop string fires; then the text ends right before it (or right after, with include_stop).
"""

from __future__ import annotations

# Transformers' clean_up_tokenization (ster_dist.tokenizer.Tokenizer.decode), in its order.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def _clean_up(text: str) -> str:
    for pattern, replacement in _CLEANUPS:
        text = text.replace(pattern, replacement)
    return text


class _PrefixHold:
    """How much of a text's end to hold back because it may be the start of one of some strings."""

    def __init__(self, strings: tuple[str, ...]):
        # For each last character: the proper-prefix lengths of each string ending in it, longest
        # first, so a step tests only the few prefixes that could match.
        self._by_last: dict[str, list[tuple[str, int]]] = {}
        for s in strings:
            for k in range(1, len(s)):
                self._by_last.setdefault(s[k - 1], []).append((s, k))
        for entries in self._by_last.values():
            entries.sort(key=lambda entry: -entry[1])

    def __call__(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of one of the strings."""
        if not text:
            return 0
        best = 0
        for s, k in self._by_last.get(text[-1], ()):
            if k <= best:
                break
            if k <= len(text) and text.endswith(s[:k]):
                best = k
        return best


def _clean_up_cut(raw: str) -> int:
    """The longest head of raw text that cleans up on its own: no pattern occurrence spans the
    cut at any stage of the clean-up (a stage's replacement can make the next stage's match:
    "  ' re" becomes " 're" becomes "'re"), so clean_up(head) + clean_up(rest) is clean_up(raw)."""
    cut = len(raw)
    while cut > 0 and _spans_a_pattern(raw[:cut]):
        cut -= 1
    return cut


def _spans_a_pattern(head: str) -> bool:
    for pattern, replacement in _CLEANUPS:
        if any(head.endswith(pattern[:k]) for k in range(1, len(pattern))):
            return True
        head = head.replace(pattern, replacement)
    return False


class Detokenizer:
    """Incremental, UTF-8 safe: text deltas for tokens as they come, never splitting a multi-byte
    character, with stop strings.

    prompt_ids are taken for vLLM's signature but not decoded: the text is the output's own
    decode, as Transformers' `decode(output ids)` and ster_dist generate give it (so a
    SentencePiece tokenizer strips the leading space of the first output token, as they do).
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # the window decoded each step starts here...
        self._read_offset = 0  # ...and its text up to here has been turned into deltas
        self._prefix_text: str | None = ""  # decode(ids[prefix_offset:read_offset]), None: stale
        # A tokenizer that cleans up spaces (" ." -> ".") changes text across window edges: the
        # windows decode raw, and the clean-up runs on raw text held until no pattern can span.
        self._cleans_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._raw_pending = ""
        self._stops = tuple(stop)
        self._include_stop = include_stop
        self._stop_hold = _PrefixHold(self._stops) if self._stops and not include_stop else None
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._decoded = ""  # text decoded so far, stop strings not yet applied past _released
        self._scanned = 0  # _decoded[:_scanned] has been searched for stop strings
        self._released = 0  # _decoded[:_released] has been handed out
        self._stopped: str | None = None
        self._flushed = False

    @property
    def stopped(self) -> str | None:
        """The stop string matched, once one has; the text then ends before it."""
        return self._stopped

    @property
    def text(self) -> str:
        """All output text released so far (the deltas joined)."""
        return self._decoded[: self._released]

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_id: int) -> str:
        """The text delta this token releases ('' when held back, or once a stop string fired)."""
        if self._flushed:
            raise ValueError("the detokenizer was flushed: its request has finished")
        if self._stopped is not None:
            return ""
        self._ids.append(int(token_id))
        self._decode_window(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At finish: what was held back (an incomplete character, a partial stop-string match
        that never completed). Adding tokens after it is an error."""
        if self._flushed or self._stopped is not None:
            self._flushed = True
            return ""
        self._flushed = True
        self._decode_window(final=True)
        return self._release(final=True)

    # ---- the window ----------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._cleans_up:
            return self._tokenizer.backend.decode(
                ids, skip_special_tokens=self._skip_special_tokens
            )
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self, final: bool) -> None:
        if self._read_offset == len(self._ids):
            raw = ""
        else:
            if self._prefix_text is None:
                self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            window_text = self._decode(self._ids[self._prefix_offset :])
            if not final and (
                window_text.endswith("\ufffd") or len(window_text) <= len(self._prefix_text)
            ):
                # An incomplete character: wait for the tokens that finish it. Or no text yet (a
                # skipped special token): keep the window, or its next start would have no text
                # for a leading-space strip to eat but the new token's own space.
                return
            raw = window_text[len(self._prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = None
        if not self._cleans_up:
            self._decoded += raw
            return
        self._raw_pending += raw
        ready = len(self._raw_pending) if final else _clean_up_cut(self._raw_pending)
        self._decoded += _clean_up(self._raw_pending[:ready])
        self._raw_pending = self._raw_pending[ready:]

    # ---- stop strings --------------------------------------------------------------------

    def _release(self, final: bool) -> str:
        text = self._decoded
        if self._stops and len(text) > self._scanned:
            match = self._first_stop(text)
            self._scanned = len(text)
            if match is not None:
                stop, start = match
                end = start + len(stop) if self._include_stop else start
                self._stopped = stop
                self._decoded = text[:end]
                delta = text[self._released : end]
                self._released = max(self._released, end)
                return delta
        keep = 0 if final or self._stop_hold is None else self._stop_hold(text[self._released :])
        end = len(text) - keep
        delta = text[self._released : end]
        self._released = end
        return delta

    def _first_stop(self, text: str) -> tuple[str, int] | None:
        """The stop string occurrence that completes first among the new text (the longest of
        those completing at the same character): what a character-by-character stream would
        have stopped at, so the result does not hang on how tokens cut the text."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, self._scanned - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[1])

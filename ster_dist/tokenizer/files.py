"""Which file a checkpoint's tokenizer is read from, and the files read in place of tokenizer.json.

seeds/000's "Local directory" list: tokenizer.json; or else PLaMo's tokenizer.jsonl; or else a
tokenizer.model that tokenizer_config.json names ChatGLM4Tokenizer (GLM-4); or else a tiktoken.model
it names TikTokenTokenizer (Kimi). Those two are tiktoken rank files: one `base64(bytes) rank` line
per token id. Any other tokenizer.model (SentencePiece's, named LlamaTokenizer and the like) is
refused by its class.

A rank file becomes the `tokenizers` pipeline tiktoken runs, as Transformers' TikTokenConverter
builds it: the class's split pattern, then byte-level BPE whose merges are recovered from the ranks
(a token is the merge of the two shorter tokens that spell it, ordered by its own rank, then
theirs); a piece that is itself a token stays whole (ignore_merges). The special tokens take the ids
after the ranks.

PLaMo's tokenizer.jsonl (plamo_backend) is one `[piece, score, kind]` JSON row per token id, a
unigram model: each stretch of text split into the pieces whose scores sum highest (`tokenizers`'
Unigram, the same Viterbi search), a character no piece covers spelled as its UTF-8 byte tokens
`<0xXX>`. Transformers reads the file only through the checkpoint's own code, which ster_dist never
runs; the tests check this reader against a split search written in the test from the seed's
description.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _BackendTokenizer

from ster_dist.errors import Refusal

# tiktoken's cl100k split, which GLM-4's ChatGLM4Tokenizer.pat_str is
_CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Kimi's TikTokenTokenizer.pat_str (tokenization_kimi.py): Han runs apart, cased words with their
# suffixes
_KIMI_PATTERN = "|".join(
    (
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    )
)


@dataclass(frozen=True)
class TiktokenClass:
    """A tokenizer class whose vocabulary is a tiktoken rank file."""

    file: str  # the rank file's name in the checkpoint
    pattern: str  # the class's pat_str
    # special ids after the ranks at least (Kimi: 256, unnamed ones reserved)
    reserved: int = 0
    # special tokens before every sequence encoded with special tokens
    prefix: tuple[str, ...] = ()


TIKTOKEN_CLASSES: dict[str, TiktokenClass] = {
    "ChatGLM4Tokenizer": TiktokenClass(
        "tokenizer.model", _CL100K_PATTERN, prefix=("[gMASK]", "<sop>")
    ),
    "TikTokenTokenizer": TiktokenClass("tiktoken.model", _KIMI_PATTERN, reserved=256),
}
# special ids after the ranks, at most (Kimi has 256): every id up to the last one named becomes a
# token
_MAX_SPECIALS = 1 << 16
# files other tokenizers ship in place of tokenizer.json: PLaMo's, and the rank files refused unless
# their class reads them
PLAMO_FILE = "tokenizer.jsonl"
OTHER_FILES = (PLAMO_FILE, "tokenizer.model", "tiktoken.model")
# rows a tokenizer.jsonl may hold (PLaMo's vocabularies are about 100,000)
_MAX_PLAMO_ROWS = 1 << 21
# what PLaMo charges a character no piece covers (UNKNOWN_SCORE -1e7 at its 1e4 score scale)
_UNKNOWN_PENALTY = 1000.0
_PLAMO_KINDS = ("NORMAL", "CONTROL", "UNKNOWN", "BYTE", "USER_DEFINED", "UNUSED")


def tokenizer_file(names: set[str], tokenizer_class: object, where: str) -> str:
    """The file among `names` the tokenizer is read from, given tokenizer_config.json's
    tokenizer_class."""
    if "tokenizer.json" in names:
        return "tokenizer.json"
    if PLAMO_FILE in names:
        return PLAMO_FILE
    declared = class_name(tokenizer_class)
    known = TIKTOKEN_CLASSES.get(declared)
    if known is not None and known.file in names:
        return known.file
    for other in OTHER_FILES:
        if other in names:
            raise Refusal(
                f"tokenizer {where}/{other} is not supported by this ster_dist build "
                f"({_why_not(other, declared)}); place the model's tokenizer.json "
                "(Hugging Face tokenizers format) beside it"
            )
    raise Refusal(
        f"tokenizer is missing: {where}/tokenizer.json; "
        "place the model's tokenizer.json beside its config"
    )


def _why_not(name: str, declared: str) -> str:
    readers = " or ".join(c for c, k in TIKTOKEN_CLASSES.items() if k.file == name)
    named = f"names {declared}" if declared else "names no tokenizer_class"
    return f"read as a tiktoken file when tokenizer_config.json names {readers}; it {named}"


def class_name(name: object) -> str:
    """A tokenizer_class without its Fast suffix; "" for none (or for a value that is no name)."""
    name = name if isinstance(name, str) else ""
    return name[: -len("Fast")] if name.endswith("Fast") else name


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one `base64(bytes) rank` line per token; the ranks must be 0 .. n-1."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise Refusal(f"failed to load tokenizer {path}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise Refusal(
                f"failed to load tokenizer {path}: line {number} is not `base64-token rank`"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise Refusal(
            f"failed to load tokenizer {path}: its ranks are not the ids 0 to {len(ranks) - 1}, "
            "each once"
        )
    return ranks


def _byte_table() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (ByteLevel's alphabet), as a str.translate table
    over the bytes read as latin-1."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TABLE = _byte_table()


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    text = {token: token.decode("latin-1").translate(_BYTE_TABLE) for token in ranks}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left = ranks.get(token[:cut])
            if left is None:
                continue
            right = ranks.get(token[cut:])
            if right is not None:
                merges.append((rank, left, right, token[:cut], token[cut:]))
    merges.sort(key=lambda m: m[:3])
    return {text[t]: r for t, r in ranks.items()}, [(text[a], text[b]) for *_, a, b in merges]


def tiktoken_backend(path: Path, kind: TiktokenClass, added: dict[int, str]) -> _BackendTokenizer:
    """The `tokenizers` pipeline of a rank file, its special tokens at the ids after the ranks.

    `added` is tokenizer_config.json's added_tokens_decoder (id -> content): every id from the first
    after the ranks to the last it names (and at least `kind.reserved` ids) becomes a special token,
    named by it or `<|reserved_token_{id}|>` where it names none."""
    ranks = read_ranks(path)
    vocab, merges = _vocab_and_merges(ranks)
    backend = _BackendTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(kind.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    base = len(ranks)
    last = max([base + kind.reserved - 1, *(i for i in added if i >= base)])
    if last - base >= _MAX_SPECIALS:  # each id up to the last named one becomes a token
        raise Refusal(
            f"failed to load tokenizer {path}: tokenizer_config.json's added_tokens_decoder names id "
            f"{last}, {last - base + 1} ids past the {base} ranks; at most {_MAX_SPECIALS} special ids "
            "follow the ranks"
        )
    specials = [added.get(i, f"<|reserved_token_{i}|>") for i in range(base, last + 1)]
    if specials:
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in specials]
        )
    if kind.prefix:
        missing = [t for t in kind.prefix if backend.token_to_id(t) is None]
        if missing:
            raise Refusal(
                f"failed to load tokenizer {path}: tokenizer_config.json's added_tokens_decoder "
                f"names no {missing[0]}, which starts every sequence"
            )
        single = " ".join([*kind.prefix, "$A"])
        backend.post_processor = processors.TemplateProcessing(
            single=single,
            pair=f"{single} $B:1",
            special_tokens=[(t, backend.token_to_id(t)) for t in kind.prefix],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def plamo_backend(path: Path, config: dict) -> _BackendTokenizer:
    """The `tokenizers` pipeline of PLaMo's tokenizer.jsonl, as the seed describes it.

    Every CONTROL and UNKNOWN piece is a special token (the UNKNOWN one is the unigram's unknown
    id). Scores are rounded to 1e-4, as PLaMo's own tokenizer keeps them. A BYTE piece `<0xXX>` is
    only ever the fallback spelling of a character no piece covers, never a piece matching its own
    spelling in the text: PLaMo leaves the byte rows out of its pieces and charges an unknown
    character 1,000 (-1e7 at its 1e4 scale), so the byte rows here score 1,000 below the lowest
    piece (the seed's "the lowest score any piece has" would let a spelled-out `<0x41>` beat six
    cheaper pieces of text), and
    `tokenizers` charges an unknown character 10 below that. Before the split, runs of one character
    repeated break_around_repeated_chars_threshold times or more, or of
    break_around_consecutive_spaces_threshold spaces or more (tokenizer_config.json), are cut out as
    stretches of their own (one alternation, as PLaMo's matcher); under add_bos_token the BOS token
    starts every sequence."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Refusal(
            f"failed to load tokenizer {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    vocab: list[tuple[str, float]] = []
    unknown, specials, byte_ids = None, [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(vocab) >= _MAX_PLAMO_ROWS:
            raise Refusal(
                f"failed to load tokenizer {path}: more than {_MAX_PLAMO_ROWS} rows; a PLaMo "
                "vocabulary has one row per token id"
            )
        piece, score, kind = _plamo_row(line, path, number)
        if kind == "UNKNOWN":
            if unknown is not None:
                raise Refusal(
                    f"failed to load tokenizer {path}: line {number} is a second UNKNOWN piece "
                    f"(the first is id {unknown}); keep one"
                )
            unknown = len(vocab)
        if kind in ("UNKNOWN", "CONTROL"):
            specials.append(piece)
        if kind == "BYTE":
            if not (
                len(piece) == 6
                and piece.startswith("<0x")
                and piece.endswith(">")
                and all(c in "0123456789abcdefABCDEF" for c in piece[3:5])
            ):
                raise Refusal(
                    f"failed to load tokenizer {path}: line {number} is a BYTE piece {piece!r}, not "
                    "<0xXX>"
                )
            byte_ids.append(len(vocab))
        vocab.append((piece, round(score * 1e4) / 1e4))
    if not vocab:
        raise Refusal(
            f"failed to load tokenizer {path}: it holds no rows; a PLaMo vocabulary has one "
            "[piece, score, kind] row per token id"
        )
    bytes_at = set(byte_ids)
    lowest = min((score for i, (_, score) in enumerate(vocab) if i not in bytes_at), default=0.0)
    for i in byte_ids:
        vocab[i] = (vocab[i][0], lowest - _UNKNOWN_PENALTY)
    try:
        backend = _BackendTokenizer(models.Unigram(vocab, unknown, bool(byte_ids)))
    except Exception as exc:  # the Rust side names what it cannot take (duplicate pieces, ...)
        raise Refusal(
            f"failed to load tokenizer {path}: not a unigram vocabulary ({exc})"
        ) from None
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    if specials:
        backend.add_special_tokens(
            [AddedToken(t, normalized=False, special=True) for t in specials]
        )
    breaks = []
    repeats = _threshold(config, "break_around_repeated_chars_threshold", path)
    if repeats:
        breaks.append(f"(.)\\1{{{repeats - 1},}}")
    spaces = _threshold(config, "break_around_consecutive_spaces_threshold", path)
    if spaces:
        breaks.append(f" {{{spaces},}}")
    if breaks:
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(breaks)), behavior="isolated")
    if config.get("add_bos_token") is True:
        bos = config.get("bos_token")
        bos = bos.get("content") if isinstance(bos, dict) else bos
        if not isinstance(bos, str) or backend.token_to_id(bos) is None:
            raise Refusal(
                f"failed to load tokenizer {path}: tokenizer_config.json adds a BOS token "
                f"({bos!r}) its vocabulary does not hold; name one of its CONTROL pieces"
            )
        backend = _prefixed(backend, [bos])
    return backend


def _plamo_row(line: str, path: Path, number: int) -> tuple[str, float, str]:
    try:
        row = json.loads(line)
    # RecursionError: a line nesting arrays past the recursion limit
    except (ValueError, RecursionError):
        row = None
    ok = (
        isinstance(row, list)
        and len(row) in (2, 3)
        and isinstance(row[0], str)
        and row[0]
        and isinstance(row[1], (int, float))
        and not isinstance(row[1], bool)
        and math.isfinite(row[1])
        and (len(row) == 2 or row[2] in _PLAMO_KINDS)
    )
    if not ok:
        raise Refusal(
            f"failed to load tokenizer {path}: line {number} is not a [piece, score, kind] row "
            f"(kind one of {', '.join(_PLAMO_KINDS)})"
        )
    return row[0], float(row[1]), row[2] if len(row) == 3 else "NORMAL"


def _threshold(config: dict, key: str, path: Path) -> int:
    value = config.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
        raise Refusal(
            f"failed to load tokenizer {path}: tokenizer_config.json's {key} is {value!r}, not a "
            "count from 0 to 4096"
        )
    return value


def _prefixed(backend: _BackendTokenizer, prefix: list[str]) -> _BackendTokenizer:
    """`backend` with `prefix` before every sequence. The template is written as JSON pieces, since
    its text form reads a `:` inside a token (PLaMo's `<|plamo:bos|>`) as a type-id separator."""
    pieces = [{"SpecialToken": {"id": t, "type_id": 0}} for t in prefix]
    single = [*pieces, {"Sequence": {"id": "A", "type_id": 0}}]
    pair = [*single, {"Sequence": {"id": "B", "type_id": 1}}]
    special = {t: {"id": t, "ids": [backend.token_to_id(t)], "tokens": [t]} for t in prefix}
    whole = json.loads(backend.to_str())
    whole["post_processor"] = {
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special,
    }
    return _BackendTokenizer.from_str(json.dumps(whole))


__all__ = [
    "OTHER_FILES",
    "PLAMO_FILE",
    "plamo_backend",
    "TIKTOKEN_CLASSES",
    "class_name",
    "TiktokenClass",
    "read_ranks",
    "tiktoken_backend",
    "tokenizer_file",
]

"""PLaMo's tokenizer.jsonl (tokenizer_files.plamo_backend) against a split search written here from
the seed's description: each stretch of text split into the pieces whose scores sum highest, a
character no piece covers spelled as its UTF-8 byte tokens, CONTROL and UNKNOWN pieces special, the
break_around_* stretches cut out first, BOS prepended under add_bos_token. The vocabulary is made
here with random scores (so no two splits tie), and texts mix covered and uncovered characters, runs
of repeats and spaces, special tokens and a spelled-out byte token. Transformers reads the file only
through the checkpoint's own code, which ster_dist never runs.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from ster_dist.errors import Refusal
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from tests.hub_server import config_json

ALPHABET = list("abcdefghijklmnopqrstuvwxyz ,.!?<>0x123456789") + list("日本語です")
UNCOVERED = "€é😀ß"  # in no piece: spelled as bytes
SPECIALS = [
    ("<|plamo:unk|>", "UNKNOWN"),
    ("<|plamo:bos|>", "CONTROL"),
    ("<|plamo:eos|>", "CONTROL"),
    ("<|plamo:pad|>", "CONTROL"),
]
REPEATS, SPACES = 4, 3


def make_rows(seed: int = 0) -> list[list]:
    rng = random.Random(seed)
    rows = [[piece, 0.0, kind] for piece, kind in SPECIALS]
    rows += [[f"<0x{b:02X}>", 0.0, "BYTE"] for b in range(256)]
    pieces = set(ALPHABET)
    while len(pieces) < len(ALPHABET) + 150:
        pieces.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 5))))
    # kind NORMAL left unstated
    rows += [[p, round(rng.uniform(-14.0, -1.0), 4)] for p in sorted(pieces)]
    rng.shuffle(rows)
    return rows


def write_plamo(directory: Path, rows: list[list], **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    settings = {
        "tokenizer_class": "Plamo3Tokenizer",
        "bos_token": "<|plamo:bos|>",
        "eos_token": "<|plamo:eos|>",
        "unk_token": "<|plamo:unk|>",
        "pad_token": "<|plamo:pad|>",
        "add_bos_token": True,
        "break_around_repeated_chars_threshold": REPEATS,
        "break_around_consecutive_spaces_threshold": SPACES,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


# ---- the reference: the seed's split, searched here ----


def reference_ids(
    text: str, rows: list[list], repeats: int = REPEATS, spaces: int = SPACES
) -> list[int]:
    ids = {r[0]: i for i, r in enumerate(rows)}
    specials = [r[0] for r in rows if len(r) > 2 and r[2] in ("CONTROL", "UNKNOWN")]
    scores = {r[0]: r[1] for r in rows if len(r) == 2 or r[2] not in ("BYTE", "CONTROL", "UNKNOWN")}
    out: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
        if part in specials:
            out.append(ids[part])
            continue
        # the break_around_* runs are stretches of their own (one alternation, leftmost first)
        pattern = re.compile(f"((.)\\2{{{repeats - 1},}}| {{{spaces},}})")
        at = 0
        for match in pattern.finditer(part):
            out += _best_split(part[at : match.start()], scores, ids) + _best_split(
                match.group(0), scores, ids
            )
            at = match.end()
        out += _best_split(part[at:], scores, ids)
    return out


def _best_split(text: str, scores: dict, ids: dict) -> list[int]:
    """The pieces whose scores sum highest (dynamic programming from the end); a character no piece
    starting there covers costs far more than any piece and is spelled as its bytes."""
    n = len(text)
    best: list[tuple[float, list]] = [(0.0, [])] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = [(-1e6 + best[i + 1][0], [("bytes", text[i])] + best[i + 1][1])]
        for j in range(i + 1, min(n, i + 5) + 1):
            if text[i:j] in scores:
                options.append(
                    (scores[text[i:j]] + best[j][0], [("piece", text[i:j])] + best[j][1])
                )
        best[i] = max(options, key=lambda o: o[0])
    out = []
    for kind, what in best[0][1]:
        out += (
            [ids[what]] if kind == "piece" else [ids[f"<0x{b:02X}>"] for b in what.encode("utf-8")]
        )
    return out


TEXTS = [
    "hello world, this is a test!",
    "日本語です。 and € prices, café ßtraße 😀",
    "aaaaaaa bbbb cc    dd  e!!!!!?",
    "spelled <0x41> byte and <|plamo:eos|> inside <|plamo:bos|>x",
    "",
]


@pytest.fixture(scope="module")
def rows():
    return make_rows()


@pytest.fixture(scope="module")
def tokenizer(rows, tmp_path_factory):
    return Tokenizer.from_directory(write_plamo(tmp_path_factory.mktemp("plamo"), rows))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_the_seeds_split(tokenizer, rows, text):
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert ids == reference_ids(text, rows)
    assert tokenizer.backend.encode(text).ids == [[r[0] for r in rows].index("<|plamo:bos|>"), *ids]


def test_random_texts_equal_the_seeds_split_and_decode_back(tokenizer, rows):
    rng = random.Random(1)
    chars = ALPHABET + list(UNCOVERED) + ["  ", "aaaa", "    "]
    for _ in range(60):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
        assert ids == reference_ids(text, rows), text
        assert tokenizer.backend.decode(ids) == text


def test_a_spelled_out_byte_token_is_split_as_text(tokenizer, rows):
    ids = tokenizer.backend.encode("<0x41>", add_special_tokens=False).ids
    assert [r[0] for r in rows].index("<0x41>") not in ids and len(ids) > 1
    assert tokenizer.backend.decode(ids) == "<0x41>"


def test_uncovered_characters_are_their_utf8_bytes(tokenizer, rows):
    pieces = [r[0] for r in rows]
    ids = tokenizer.backend.encode("€", add_special_tokens=False).ids
    assert ids == [pieces.index(f"<0x{b:02X}>") for b in "€".encode("utf-8")]


def test_specials_and_no_bos_without_add_bos_token(rows, tmp_path):
    tok = Tokenizer.from_directory(write_plamo(tmp_path / "t", rows, add_bos_token=False))
    assert tok.backend.encode("ab").ids == tok.backend.encode("ab", add_special_tokens=False).ids
    eos = [r[0] for r in rows].index("<|plamo:eos|>")
    assert (
        tok.backend.decode([eos, *tok.backend.encode("ab").ids], skip_special_tokens=True) == "ab"
    )


def test_resolution_reads_the_jsonl_before_any_rank_file(rows, tmp_path):
    from safetensors.torch import save_file

    directory = write_plamo(tmp_path / "m", rows)
    (directory / "config.json").write_bytes(config_json())
    save_file({"w": torch.zeros(2, 2)}, str(directory / "model.safetensors"))
    # a stray SentencePiece file is not read
    (directory / "tokenizer.model").write_bytes(b"\x0a\x05spm")
    assert resolve(str(directory)).tokenizer_path.name == "tokenizer.jsonl"


@pytest.mark.parametrize(
    "line, words",
    [
        ("not json", "line 1 is not a [piece, score, kind] row"),
        ('["a", "x", "NORMAL"]', "line 1 is not a [piece, score, kind] row"),
        ('["a", 1.0, "WEIRD"]', "kind one of NORMAL"),
        ('["<0xZZ>", 0.0, "BYTE"]', "is a BYTE piece '<0xZZ>', not <0xXX>"),
        ('["a", NaN]', "line 1 is not a [piece, score, kind] row"),
        # past json's recursion limit
        ("[" * 100_000 + "]" * 100_000, "line 1 is not a [piece, score, kind] row"),
    ],
)
def test_malformed_rows_are_refused_in_one_line(tmp_path, line, words):
    directory = tmp_path / "t"
    directory.mkdir()
    (directory / "tokenizer.jsonl").write_text(line + "\n")
    (directory / "tokenizer_config.json").write_text("{}")
    with pytest.raises(Refusal) as caught:
        Tokenizer.from_directory(directory)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_bos_the_vocabulary_lacks_and_a_bad_threshold_are_refused(rows, tmp_path):
    with pytest.raises(Refusal, match="adds a BOS token .* its vocabulary does not hold"):
        Tokenizer.from_directory(write_plamo(tmp_path / "a", rows, bos_token="<s>"))
    with pytest.raises(Refusal, match="break_around_repeated_chars_threshold is -1, not a count"):
        Tokenizer.from_directory(
            write_plamo(tmp_path / "b", rows, break_around_repeated_chars_threshold=-1)
        )

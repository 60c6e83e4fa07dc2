"""The engine's incremental detokenizer: deltas that add up to the full decode, UTF-8 safe, with
stop strings, on real tokenizers (tests/tiny_tokenizer.py's and SmolLM2's when it is present)."""

import random
from pathlib import Path

import pytest

from ster_dist.engine.detok import Detokenizer, _clean_up, _clean_up_cut
from ster_dist.tokenizer import Tokenizer
from tests.tiny_tokenizer import build_llama2_style_tokenizer, build_tiny_tokenizer

SMOLLM2 = Path("/work/main/models/smollm2")
TEXTS = [
    "Hello, world! The quick brown fox.",
    "café naïve — 日本語のテキスト and emoji 🙂🎉👩‍👩‍👧 mixed in",
    "数学 is 𝔐𝔞𝔱𝔥, Ünïcödé ✓ ∑ ∫ 🚀🚀🚀",
    "def f(x):\n    return x ** 2  # ok\n\n\tdone",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tiny")
    build_tiny_tokenizer(directory)
    return Tokenizer.from_directory(directory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("llama")
    build_llama2_style_tokenizer(directory)
    return Tokenizer.from_directory(directory)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"no SmolLM2 tokenizer at {SMOLLM2}")
    return Tokenizer.from_directory(SMOLLM2)


def stream(tokenizer, ids, **kwargs) -> tuple[list[str], Detokenizer]:
    """Feed ids one at a time, then flush; check every released prefix stays a prefix."""
    detok = Detokenizer(tokenizer, [], **kwargs)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas, detok


def assert_streams_like_decode(tokenizer, ids, skip_special_tokens=True):
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = Detokenizer(tokenizer, [7, 8], skip_special_tokens=skip_special_tokens)
    released = ""
    for i in ids:
        released += detok.add(i)
        assert full.startswith(released), (ids, released, full)  # nothing is ever taken back
    released += detok.flush()
    assert released == full == detok.text, ids
    assert detok.stopped is None


# ---- deltas add up to decode(output ids) ---------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_tiny(tiny, skip_special_tokens):
    """Any ids at all: byte-level BPE decodes invalid bytes locally, so even garbage streams."""
    rng, vocab = random.Random(0), tiny.vocab_size
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        assert_streams_like_decode(tiny, ids, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_smollm2(smollm2, skip_special_tokens):
    rng, vocab = random.Random(2), smollm2.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        assert_streams_like_decode(smollm2, ids, skip_special_tokens)


def is_byte_piece(token: str | None) -> bool:
    return token is not None and len(token) == 6 and token.startswith("<0x") and token.endswith(">")


def random_pieces_and_valid_bytes(tokenizer, rng) -> list[int]:
    """Random pieces with runs of <0xXX> byte pieces that spell whole UTF-8 characters.

    Byte fallback decodes a run of byte pieces together, and an invalid run turns every byte of
    it into U+FFFD, bytes already streamed included: no stream can take those back, so the
    property holds for the byte runs a model emits for real characters, not for garbage runs.
    """
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    byte_ids = {int(t[3:5], 16): i for t, i in vocab.items() if is_byte_piece(t)}
    pieces = sorted(i for t, i in vocab.items() if not is_byte_piece(t))
    ids: list[int] = []
    for _ in range(rng.randrange(0, 25)):
        if rng.random() < 0.3:
            ids += [byte_ids[b] for b in rng.choice("é日本🙂\x1d\n€𝔐").encode()]
        else:
            ids.append(rng.choice(pieces))
    return ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_pieces_llama_style(llama, skip_special_tokens):
    """SentencePiece pieces, <0xXX> byte fallback and the leading-space strip."""
    rng = random.Random(1)
    for _ in range(300):
        assert_streams_like_decode(
            llama, random_pieces_and_valid_bytes(llama, rng), skip_special_tokens
        )


def byte_heavy_ids(tokenizer, rng) -> list[int]:
    """Ids of real multi-byte text, with special tokens dropped in between some of them (not
    inside a run of byte-fallback pieces: that cuts a character in two, see is_byte_piece)."""
    text = "".join(rng.choice(TEXTS) for _ in range(2))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(rng.randrange(3)):
        places = [
            i
            for i in range(len(ids) + 1)
            if i == len(ids) or not is_byte_piece(tokenizer.id_to_token(ids[i]))
        ]
        ids.insert(rng.choice(places), rng.choice(tokenizer.all_special_ids))
    return ids


@pytest.mark.parametrize("name", ["tiny", "llama", "smollm2"])
def test_multibyte_text_streams_whole_characters(name, request):
    tokenizer = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.id_to_token(i) for i in ids]
        deltas, detok = stream(tokenizer, ids)
        assert detok.text == tokenizer.decode(ids)
        assert all("\ufffd" not in d for d in deltas), (pieces, deltas)
    rng = random.Random(3)
    for _ in range(100):
        for skip in (True, False):
            assert_streams_like_decode(tokenizer, byte_heavy_ids(tokenizer, rng), skip)


def test_an_emoji_split_over_byte_tokens_is_held_until_whole(tiny):
    ids = tiny.encode("a🙂b", add_special_tokens=False)
    assert len(ids) >= 4  # 'a', then the emoji's four bytes over several tokens, then 'b'
    detok = Detokenizer(tiny, [])
    deltas = [detok.add(i) for i in ids]
    assert deltas[0] == "a" and "🙂" in "".join(deltas) and "\ufffd" not in "".join(deltas)
    assert deltas.count("") >= 1  # the emoji's first bytes released nothing


def test_a_trailing_incomplete_character_comes_out_at_flush(tiny):
    ids = tiny.encode("ok🙂", add_special_tokens=False)[:-1]  # cut the emoji short
    deltas, detok = stream(tiny, ids)
    assert deltas[-1].endswith("\ufffd") and detok.text == tiny.decode(ids)


def test_clean_up_tokenization_spaces(tmp_path):
    """A tokenizer that cleans up " ." and " n't" across token edges streams its decode exactly."""
    # Transformers skips the clean-up for BPE models unless told to corrupt the text anyway.
    corrupt = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    build_tiny_tokenizer(tmp_path, config={"clean_up_tokenization_spaces": True, corrupt: True})
    tokenizer = Tokenizer.from_directory(tmp_path)
    assert tokenizer.clean_up_tokenization_spaces
    for text in ["don 't stop .", "it ' s", "!!  ' rere", "a , b ! c ? we 've they 're I 'm"]:
        ids = char_ids(tokenizer, text)
        assert tokenizer.decode(ids) != text  # the clean-up did change it
        assert_streams_like_decode(tokenizer, ids)
    rng = random.Random(4)
    pieces = [
        " ",
        "  ",
        ".",
        "?",
        "!",
        ",",
        "'",
        "n",
        "t",
        "s",
        "m",
        "ve",
        "re",
        "x",
        "ab",
        "é",
        "🙂",
    ]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 30)))
        assert_streams_like_decode(tokenizer, tokenizer.encode(text, add_special_tokens=False))
        assert_streams_like_decode(tokenizer, char_ids(tokenizer, text))


def test_clean_up_splits_where_no_pattern_spans():
    """The clean-up runs on pieces cut where no pattern can span: equal to one pass on the whole."""
    rng = random.Random(5)
    for _ in range(5000):
        text = "".join(rng.choice(" .?!,'ntsmvrex") for _ in range(rng.randrange(1, 20)))
        cut = _clean_up_cut(text[: rng.randrange(len(text) + 1)])
        assert _clean_up(text[:cut]) + _clean_up(text[cut:]) == _clean_up(text), (text, cut)


def test_each_step_decodes_a_short_window(tiny):
    """O(n) in all: no step decodes more than a few tokens, however long the output."""

    class Recording:
        def __init__(self, tokenizer):
            self.tokenizer, self.windows = tokenizer, []

        def decode(self, ids, skip_special_tokens=True):
            self.windows.append(len(ids))
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tiny.encode("The quick brown fox 🙂 jumps over 日本語. " * 60, add_special_tokens=False)
    recording = Recording(tiny)
    _, detok = stream(recording, ids)
    assert detok.text == tiny.decode(ids) and len(ids) > 1000
    assert max(recording.windows) <= 8 and len(recording.windows) <= 2 * len(ids) + 2


# ---- stop strings --------------------------------------------------------------------------


def char_ids(tokenizer, text) -> list[int]:
    """One token per character where the vocabulary has it: stops split across many tokens."""
    ids = []
    for ch in text:
        ids += tokenizer.encode(ch, add_special_tokens=False)
    return ids


def reference_stop(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """Character by character: stop at the first character that completes a stop string."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def test_stop_string_truncates_before_it(tiny):
    _, detok = stream(
        tiny, tiny.encode("Hello world. The end", add_special_tokens=False), stop=("world",)
    )
    assert detok.text == "Hello " and detok.stopped == "world"


def test_include_stop_keeps_it(tiny):
    ids = tiny.encode("Hello world. The end", add_special_tokens=False)
    _, detok = stream(tiny, ids, stop=("world",), include_stop=True)
    assert detok.text == "Hello world" and detok.stopped == "world"


def test_a_stop_split_across_tokens_is_caught_and_never_leaked(tiny):
    text = "abc lo wo lo world, more"
    stop = "lo wor"
    detok = Detokenizer(tiny, [], stop=(stop,))
    released = ""
    for token in char_ids(tiny, text):
        released += detok.add(token)
        held = len(tiny.decode(detok.token_ids)) - len(released)
        assert detok.stopped or held <= len(stop) - 1  # at most one short of the stop is held
    assert released == "abc lo wo " and detok.stopped == stop
    assert detok.add(tiny.encode("x", add_special_tokens=False)[0]) == "" and detok.flush() == ""
    assert detok.text == "abc lo wo "


def test_a_partial_match_at_the_end_is_released_at_flush(tiny):
    deltas, detok = stream(tiny, char_ids(tiny, "one two wor"), stop=("world",))
    assert detok.stopped is None and detok.text == "one two wor" and deltas[-1] == "wor"


def test_stop_inside_multibyte_text(tiny):
    ids = tiny.encode("見て🙂日本語です", add_special_tokens=False)
    _, detok = stream(tiny, ids, stop=("日本",))
    assert detok.text == "見て🙂" and detok.stopped == "日本"
    _, detok = stream(tiny, ids, stop=("🙂",), include_stop=True)
    assert detok.text == "見て🙂"


def test_stops_do_not_hang_on_how_tokens_cut_the_text(tiny):
    """Random texts, stops and token cuts all agree with a character-by-character stream."""
    rng = random.Random(6)
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 30)))
        stops = tuple(
            {
                "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 5)))
                for _ in range(rng.randrange(1, 4))
            }
        )
        include = rng.random() < 0.5
        expected = reference_stop(text, stops, include)
        for ids in (tiny.encode(text, add_special_tokens=False), char_ids(tiny, text)):
            _, detok = stream(tiny, ids, stop=stops, include_stop=include)
            assert (detok.text, detok.stopped) == expected, (text, stops, include)


def test_add_after_flush_is_an_error(tiny):
    detok = Detokenizer(tiny, [])
    assert detok.add(tiny.encode("a", add_special_tokens=False)[0]) == "a"
    assert detok.flush() == "" and detok.flush() == "" and detok.text == "a"
    with pytest.raises(ValueError):
        detok.add(5)

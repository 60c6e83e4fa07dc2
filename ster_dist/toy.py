"""`ster toy-model DIR`: a tiny random Llama checkpoint with a real tokenizer, for trying the CLI.

Weights are written under the family's own checkpoint names, found by walking the
FamilySpec name map backwards from the decoder's parameters (the same map the
loader reads), so a toy directory loads exactly like a downloaded one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.spec import FamilySpec
from ster_dist.shard.loader import build_decoder

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = (
    "What is the capital of France? The capital of France is Paris.",
    "You are a helpful assistant. Answer briefly and kindly.",
    "The quick brown fox jumps over the lazy dog, then sleeps in the sun.",
    "Distributed inference shards weights across ranks; experts route tokens between devices.",
    "Steering vectors nudge the residual stream toward a direction learned from contrastive pairs.",
)


def checkpoint_name(spec: FamilySpec, param: str) -> str:
    """The checkpoint tensor that fills `param` through a one-to-one rule (the name map read backwards)."""
    layer = None
    parts = param.split(".")
    if parts[0] == "layers":
        layer, generic = parts[1], ".".join(["layers", "{i}"] + parts[2:])
    else:
        generic = param
    for rule in spec.rules:
        if rule.target == generic:
            return rule.checkpoint.replace("{i}", layer) if layer is not None else rule.checkpoint
    raise Refusal(f"{spec.name} has no one-to-one checkpoint name for {param}")


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_toy_model(directory: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                   seed: int = 0) -> dict:
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise Refusal(f"{directory} exists and is not empty; choose a new directory for the toy model")
    tok = _tokenizer(512)
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": hidden * 2 + 8, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": eos, "torch_dtype": "float32", "hidden_act": "silu",
    }
    cfg = from_hf(config)
    model = build_decoder(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in model.named_parameters():
        scale = 0.0 if "norm" in name else 0.02
        value = torch.randn(param.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0)
        tensors[checkpoint_name(cfg.spec, name)] = value.contiguous()
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                                    "eos_token_id": eos}, indent=2))
        tok.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 512}, indent=2))
        if directory.exists():
            directory.rmdir()
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"output": str(directory), "family": "llama", "layers": layers, "hidden_size": hidden,
            "vocab_size": vocab, "tensors": len(tensors)}

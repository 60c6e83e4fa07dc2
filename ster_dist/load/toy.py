"""`ster toy-model DIR [--family llama|deepseek_v3]`: a tiny random checkpoint with a real
tokenizer, for trying the CLI (deepseek_v3: latent attention, a sigmoid noaux_tc router over
8 experts plus a shared one, a dense first layer and YaRN, for `--ep`).

Weights are written under the family's own checkpoint names, found by walking the
FamilySpec name map backwards from the decoder's parameters (the same map the loader
reads; experts one by one as published checkpoints store them), so a toy directory loads
exactly like a downloaded one, in ster_dist and in Transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ster_dist.atomic import staging_dir
from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.spec import FamilySpec
from ster_dist.model.decoder import meta_decoder

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


def llama_config(hidden: int, layers: int, experts: int) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": hidden * 2 + 8,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def deepseek_v3_config(hidden: int, layers: int, experts: int) -> dict:
    if experts % 4 or experts < 8:
        raise Refusal(
            f"--experts {experts}: the toy groups experts in 4 groups of at least 2; use 8, 12, 16, ..."
        )
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_interleave": True,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


PRESETS = {"llama": llama_config, "deepseek_v3": deepseek_v3_config}


def checkpoint_names(spec: FamilySpec, param: str, rows: int) -> list[str]:
    """The checkpoint tensors that fill `param` through a one-to-one rule (the name map read
    backwards): one name, or one per expert ({e}) for a stacked expert parameter."""
    parts = param.split(".")
    layer, generic = (
        (parts[1], ".".join(["layers", "{i}"] + parts[2:]))
        if parts[0] == "layers"
        else (None, param)
    )
    for rule in spec.rules:
        if rule.target == generic:
            name = rule.checkpoint.replace("{i}", layer) if layer is not None else rule.checkpoint
            return [name.replace("{e}", str(e)) for e in range(rows)] if "{e}" in name else [name]
    raise Refusal(f"{spec.name} has no one-to-one checkpoint name for {param}")


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_toy_model(
    directory: Path,
    family: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    experts: int = 8,
    seed: int = 0,
) -> dict:
    directory = Path(directory)
    if family not in PRESETS:
        raise Refusal(f"--family {family!r}: the toy model comes as {', '.join(PRESETS)}")
    if directory.exists() and any(directory.iterdir()):
        raise Refusal(
            f"{directory} exists and is not empty; choose a new directory for the toy model"
        )
    tok = _tokenizer(512)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = {
        **PRESETS[family](hidden, layers, experts),
        "vocab_size": tok.get_vocab_size(),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    cfg = from_hf(config)
    model = meta_decoder(cfg)  # shapes and names only: the values are drawn below
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in model.named_parameters():
        norm = name.endswith("norm.weight")
        value = (1.0 if norm else 0.0) + (0.1 if norm else 0.05) * torch.randn(
            param.shape, generator=gen
        )
        names = checkpoint_names(cfg.spec, name, param.shape[0])
        if len(names) > 1:
            tensors.update({n: value[e].contiguous() for e, n in enumerate(names)})
        else:
            tensors[names[0]] = value.contiguous()
    # an empty directory named by the user is swapped for the filled one (a non-empty one was
    # refused above)
    with staging_dir(directory, replace=True) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2)
        )
        tok.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "chat_template": CHATML,
                    "bos_token": "<|endoftext|>",
                    "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>",
                    "model_max_length": 512,
                },
                indent=2,
            )
        )
    return {
        "output": str(directory),
        "family": family,
        "layers": layers,
        "hidden_size": hidden,
        "vocab_size": config["vocab_size"],
        "tensors": len(tensors),
        **({"experts": experts} if family != "llama" else {}),
    }

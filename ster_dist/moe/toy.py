"""A tiny random DeepSeek-V3-layout checkpoint (latent attention, sigmoid noaux_tc router over 8 experts
plus a shared one, a dense first layer, YaRN), with a real tokenizer, for trying expert parallelism:

    python -m ster_dist.moe.toy /tmp/dsv3
    ster generate --model /tmp/dsv3 --ep 2 --prompt "hello" --max-new-tokens 8

Tensors are written under DeepSeek-V3's published names (experts one by one, experts.{e}.gate_proj ...),
found by walking the family's name map backwards from the decoder's parameters, so the directory
loads as a downloaded checkpoint does (Transformers' DeepseekV3ForCausalLM reads it too).
"""

from __future__ import annotations

import argparse
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
from ster_dist.toy import CHATML, _tokenizer, checkpoint_name


def _expert_names(spec: FamilySpec, param: str, count: int) -> list[str] | None:
    """The per-expert checkpoint tensors that fill a stacked expert parameter, expert by expert."""
    parts = param.split(".")
    generic = ".".join(["layers", "{i}"] + parts[2:])
    for rule in spec.rules:
        if rule.target == generic and "{e}" in rule.checkpoint:
            template = rule.checkpoint.replace("{i}", parts[1])
            return [template.replace("{e}", str(e)) for e in range(count)]
    return None


def deepseek_v3_config(vocab: int, layers: int, hidden: int, experts: int, eos: int, bos: int) -> dict:
    return {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": hidden * 2, "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "rope_interleave": True, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": bos,
        "eos_token_id": eos, "torch_dtype": "float32",
    }


def make_toy_deepseek_v3(directory: Path, layers: int = 3, hidden: int = 64, experts: int = 8,
                         seed: int = 0) -> dict:
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise Refusal(f"{directory} exists and is not empty; choose a new directory for the toy model")
    if experts % 4 or experts < 8:
        raise Refusal(f"--experts {experts}: the toy groups experts in 4 groups of at least 2; use 8, 12, 16, ...")
    tok = _tokenizer(512)
    eos, bos = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = deepseek_v3_config(tok.get_vocab_size(), layers, hidden, experts, eos, bos)
    cfg = from_hf(config)
    model = build_decoder(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif name.endswith("router.correction"):
            value = 0.05 * torch.randn(param.shape, generator=gen)
        else:
            value = 0.05 * torch.randn(param.shape, generator=gen)
        stacked = _expert_names(cfg.spec, name, param.shape[0]) if ".experts." in name else None
        if stacked:
            tensors.update({n: value[e].contiguous() for e, n in enumerate(stacked)})
        else:
            tensors[checkpoint_name(cfg.spec, name)] = value.contiguous()
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=parent))
    try:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos},
                                                                   indent=2))
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
    return {"output": str(directory), "family": "deepseek_v3", "layers": layers, "hidden_size": hidden,
            "experts": experts, "tensors": len(tensors)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        print(json.dumps(make_toy_deepseek_v3(args.directory, args.layers, args.hidden, args.experts, args.seed)))
    except Refusal as refusal:
        print(str(refusal), file=__import__("sys").stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

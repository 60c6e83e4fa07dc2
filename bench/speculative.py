"""MTP speculative decoding in the token engine: tokens/s with and without drafts, and the
acceptance rate.

What is built
    A small random DeepSeek-V3 (latent attention, 8 routed experts top-2 and a shared one; default
    hidden 256, 12 layers, vocab 4096) with one MTP layer after its decoder's, as published
    checkpoints store it, in three versions that bracket what a trained MTP layer gives:
      random       the MTP layer is the last decoder layer's weights with random enorm / hnorm /
      eh_proj / shared
                   head: a draft that is (almost) never right, so the figures are speculation's pure
                   cost;
      echo-often   an MTP layer built to propose the token it reads (eh_proj passes the normed
      embedding alone,
                   the layer's output projections are zero, its head is the embedding), over the
                   random model with its head made the embedding and its layers' output projections
                   x30: the model repeats a token for a while, then moves on, so some drafts are
                   right and some not;
      echo-always  the same MTP layer over the model with its layers' output projections zeroed: it
      repeats its
                   last token forever and every draft is right (the upper bound, at the same compute
                   per step).
    No trained DeepSeek MTP layer fits a CPU run; on a real checkpoint the acceptance rate is the
    MTP layer's (DeepSeek reports 85-90% for the second token). The MTP layer costs one decoder
    layer per draft: here 1/12 of the model, in DeepSeek-V3 1/61.

What is measured
    For each version and each --drafts value (0 = no speculation), --batch greedy requests of
    --prompt-len
    random tokens and --new-tokens each (ignore_eos) through one TokenEngine on this process
    (--device,
    --precision, --threads):
    tokens/s = generated tokens / seconds from the first submit to the last result (prefill
    included), best of
    --repeats (the settings alternating run by run) after one warm-up each; engine steps; and
    drafted / accepted tokens (acceptance = accepted / drafted). Every run's tokens are checked
    equal to the run without drafts (greedy speculation changes no token). Steps and acceptance are
    exact; tokens/s on a shared CPU moves with the neighbours' load (the 1-minute load average is in
    the JSON), so tokens per CPU-second of this process (time.process_time: the engine and its
    in-process rank, both torch threads) is printed beside it: what the work costs, whatever the
    wait.

    python bench/speculative.py [--hidden 256 --layers 12 --batch 1 4 --drafts 0 1 3 --new-tokens
    32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import set_threads, write_wordlevel_tokenizer
from ster_dist.config.load import model_config
from ster_dist.engine.loop import EngineConfig, TokenEngine
from ster_dist.engine.sampling import SamplingParams
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup


def build(
    directory: Path,
    hidden: int,
    layers: int,
    vocab: int,
    echo: bool,
    damp: float | None = None,
    seed: int = 0,
) -> None:
    """The checkpoint, its MTP layer random or echoing; `damp` scales every decoder layer's output
    projections and makes the head the embedding (final norm 1), so at 0 the model repeats its last
    token forever."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = transformers.DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=hidden // 2,
        kv_lora_rank=hidden // 4,
        q_lora_rank=hidden // 2,
        qk_nope_head_dim=hidden // 8,
        qk_rope_head_dim=hidden // 16,
        v_head_dim=hidden // 8,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.DeepseekV3ForCausalLM(config).eval().save_pretrained(
        directory, safe_serialization=True
    )
    tensors = load_file(str(directory / "model.safetensors"))
    raw = json.loads((directory / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    g = torch.Generator().manual_seed(seed + 1)
    extra = {mtp + n[len(last) :]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    extra[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    for name, shape in (
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("shared_head.norm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.head.weight", (vocab, hidden)),
    ):
        extra[mtp + name] = torch.randn(shape, generator=g) * 0.05
    if echo:
        for name, t in extra.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                extra[name] = torch.zeros_like(t)
        extra[mtp + "eh_proj.weight"] = torch.cat(
            (torch.eye(hidden), torch.zeros(hidden, hidden)), 1
        )
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            extra[mtp + norm + ".weight"] = torch.ones(hidden)
        extra[mtp + "shared_head.head.weight"] = tensors["model.embed_tokens.weight"].clone()
    if damp is not None:
        for name, t in tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = t * damp
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.norm.weight"] = torch.ones(hidden)
    tensors.update(extra)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    write_wordlevel_tokenizer(directory, vocab)


# (name, echoing MTP layer, damp): what the draft is and how often the model repeats itself
VERSIONS = (("random", False, None), ("echo-often", True, 30.0), ("echo-always", True, 0.0))


def run(group, cfg, tokenizer, prompts: list[list[int]], new_tokens: int, drafts: int) -> dict:
    config = EngineConfig(kv_cache_memory=64 << 20, max_step_tokens=512, speculative_tokens=drafts)
    with TokenEngine(group, cfg, tokenizer, (), config) as engine:
        start, cpu = time.perf_counter(), time.process_time()
        streams = [
            engine.submit(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            for p in prompts
        ]
        tokens = [s.result().token_ids for s in streams]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        stats = engine.stats()
    generated = sum(map(len, tokens))
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "tokens_per_cpu_s": generated / cpu_seconds,
        "steps": stats["steps"],
        "drafted": stats["drafted_tokens"],
        "accepted": stats["accepted_tokens"],
        "acceptance": stats["acceptance_rate"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("f32", "bf16"), default="f32")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    drafts = sorted(set(args.drafts) | {0})
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for version, echo, damp in VERSIONS:
            directory = Path(tmp) / version
            directory.mkdir()
            build(directory, args.hidden, args.layers, args.vocab, echo, damp)
            checkpoint = resolve(str(directory))
            cfg = model_config(checkpoint)
            tokenizer = Tokenizer.from_directory(checkpoint.directory)
            group = LocalGroup()
            group.call("load", checkpoint, args.precision, args.device)
            g = torch.Generator().manual_seed(5)
            for batch in args.batch:
                prompts = [
                    torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist()
                    for _ in range(batch)
                ]
                for k in drafts:
                    run(group, cfg, tokenizer, prompts, 4, k)  # warm-up
                bests: dict[int, dict] = {}
                # the settings alternate run by run: a neighbour's load hits them alike
                for _ in range(args.repeats):
                    for k in drafts:
                        result = run(group, cfg, tokenizer, prompts, args.new_tokens, k)
                        if k not in bests or result["tokens_per_s"] > bests[k]["tokens_per_s"]:
                            bests[k] = result
                plain = bests[0]
                for k in drafts:
                    best = bests[k]
                    row = {
                        "mtp": version,
                        "batch": batch,
                        "drafts": k,
                        "tokens_per_s": round(best["tokens_per_s"], 1),
                        "speedup": round(best["tokens_per_s"] / plain["tokens_per_s"], 2),
                        "tokens_per_cpu_s": round(best["tokens_per_cpu_s"], 1),
                        "cpu_speedup": round(
                            best["tokens_per_cpu_s"] / plain["tokens_per_cpu_s"], 2
                        ),
                        "steps": best["steps"],
                        "drafted": best["drafted"],
                        "accepted": best["accepted"],
                        "acceptance": round(best["acceptance"], 3),
                        "same_tokens": best["tokens"] == plain["tokens"],
                    }
                    results.append(row)
                    print(
                        f"{version:>11}  batch {batch}  drafts {k}  {row['tokens_per_s']:8.1f} tok/s  "
                        f"x{row['speedup']:.2f}  {row['tokens_per_cpu_s']:8.1f} tok/cpu-s  x{row['cpu_speedup']:.2f}  "
                        f"steps {row['steps']:4d}  accepted {row['accepted']}/{row['drafted']} "
                        f"({row['acceptance']:.1%})  same tokens: {row['same_tokens']}",
                        flush=True,
                    )
            group.close()
    print(
        json.dumps(
            {
                "benchmark": "speculative",
                "load_average": os.getloadavg(),
                "device": args.device,
                "precision": args.precision,
                "threads": args.threads,
                "hidden": args.hidden,
                "layers": args.layers,
                "new_tokens": args.new_tokens,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()

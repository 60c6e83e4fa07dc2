"""families, inspect-model, generate, parity, toy-model, gguf-import."""

from __future__ import annotations

from pathlib import Path

from ster_dist.commands.common import (
    model_args,
    modifiers,
    progress,
    read_json,
    read_text,
    runtime_args,
    session,
    write_json_atomic,
)
from ster_dist.errors import Refusal


def cmd_families(args) -> dict:
    from ster_dist.families.registry import family_table

    table = family_table()
    counts: dict[str, int] = {}
    for row in table:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"families": table, "counts": counts}


def cmd_inspect(args) -> dict:
    from ster_dist.config_load import model_config
    from ster_dist.resolve import describe, resolve

    checkpoint = resolve(args.model, args.revision)
    out = describe(checkpoint)
    try:
        out["config"] = model_config(checkpoint).summary()
    except Refusal as refusal:  # resolvable but not (yet) runnable: say so, still describe it
        out["config"] = None
        out["runnable"] = str(refusal)
    return out


def check_prompt_flags(prompt, prompts, output) -> None:
    if (prompt is None) == (prompts is None):
        raise Refusal("give exactly one of --prompt TEXT or --prompts FILE")
    if prompts is not None and output is None:
        raise Refusal("--prompts needs --output FILE for the answers")


def cmd_generate(args) -> dict:
    from ster_dist.generate import Sampling

    check_prompt_flags(args.prompt, args.prompts, args.output)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed).check()
    from ster_dist.steer.attach import check_strength

    check_strength(args.vector, args.strength)
    system = read_text(args.system, "--system") if args.system else None
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    with session(args) as run, modifiers(run, args):
        tokenizer = run.tokenizer
        encoded = [tokenizer.prompt_ids(p, system, args.chat_template) for p in prompts]
        eos = run.eos
        progress(f"generating for {len(prompts)} prompt(s), up to {sampling.max_new_tokens} tokens")
        outputs = run.group.call("generate", encoded, sampling, eos, tokenizer.pad_token_id or 0)[0]
        revision = run.checkpoint.model_revision
        steering = getattr(run, "steering", None)
    results = []
    for prompt, ids, new in zip(prompts, encoded, outputs):
        finished = bool(new) and new[-1] in eos
        results.append({"prompt": prompt, "text": tokenizer.decode(new[:-1] if finished else new),
                        "prompt_tokens": len(ids), "completion_tokens": len(new),
                        "finish_reason": "stop" if finished else "length"})
    header = {"model": args.model, "model_revision": revision, "precision": args.precision, "tp": args.tp,
              "ep": getattr(args, "ep", 1),
              "chat_template": "on" if args.chat_template != "off" and tokenizer.chat_template else "off",
              "sampling": {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                           "top_p": sampling.top_p, "seed": sampling.seed}}
    if steering is not None:
        header["steering"] = steering
    if args.prompts is None:
        return {**header, **results[0]}
    write_json_atomic(Path(args.output), {**header, "results": results})
    return {**header, "output": args.output, "prompts": len(results)}


def _read_prompts(path: str) -> list[str]:
    data = read_json(path, "--prompts")
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise Refusal(f'--prompts {path} must be {{"prompts": ["...", ...]}} with at least one string')
    return prompts


def cmd_parity(args) -> dict:
    with session(args) as run:
        progress("running ster_dist and the reference (Transformers) on the same tokens")
        result = run.group.call("parity", args.tokens, args.seed)[0]
    if not result["passed"]:
        args.exit_code = 1
        progress(f"parity FAILED: past the threshold {result['threshold']}")
    return result


def cmd_toy_model(args) -> dict:
    from ster_dist.toy import make_toy_model

    return make_toy_model(Path(args.directory), family=args.family, layers=args.layers, hidden=args.hidden,
                          experts=args.experts, seed=args.seed)


def cmd_gguf_import(args) -> dict:
    from ster_dist.gguf.importer import import_gguf

    return import_gguf(Path(args.file), Path(args.directory), to_safetensors=args.safetensors)


def register(sub) -> None:
    p = sub.add_parser("families", help="every family of the architecture gate with its status")
    p.set_defaults(run=cmd_families)

    p = sub.add_parser("inspect-model", help="resolve a model and describe it, reading no weights")
    model_args(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("generate", help="generate text")
    model_args(p)
    runtime_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompts", default=None, help='a {"prompts": [...]} JSON file, answered in order')
    p.add_argument("--output", default=None)
    p.add_argument("--system", default=None, help="a file holding the system message")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vector", default=None, help="a steering vector artifact (V.json) added during generation")
    p.add_argument("--strength", type=float, default=None, help="the steering strength; required with --vector")
    p.add_argument("--adapter", default=None, help="a LoRA adapter applied unmerged")
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("parity", help="compare against Transformers per layer and on the logits")
    model_args(p)
    runtime_args(p)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="JSON output (always on; kept for Ster's flag)")
    p.set_defaults(run=cmd_parity)

    p = sub.add_parser("toy-model", help="write a tiny random checkpoint (Llama or DeepSeek-V3) with a tokenizer")
    p.add_argument("directory")
    p.add_argument("--family", default="llama", choices=["llama", "deepseek_v3"])
    p.add_argument("--experts", type=int, default=8, help="routed experts (deepseek_v3)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_toy_model)

    p = sub.add_parser("gguf-import", help="turn a .gguf file into a model directory")
    p.add_argument("file")
    p.add_argument("directory")
    p.add_argument("--safetensors", action="store_true", help="write dequantized safetensors instead")
    p.set_defaults(run=cmd_gguf_import)

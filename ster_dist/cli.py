"""The `ster` command line: thin argument parsing over the library.

Every command prints its result as JSON on stdout and progress on stderr. A
Refusal is printed once, as one line on stderr, with exit status 2: never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ster_dist.errors import Refusal

LATER = {
    "extract": "capture of hidden states",
    "steer": "steering vectors",
    "decide": "decisions",
    "merge": "LoRA adapter merges",
    "submit": "Ray job submission",
}


def progress(message: str) -> None:
    print(json.dumps({"event": "progress", "time": round(time.time(), 3), "message": message}),
          file=sys.stderr, flush=True)


def emit(result: dict) -> None:
    print(json.dumps(result, indent=2, ensure_ascii=False))


# -- commands -------------------------------------------------------------------------------------

def cmd_families(args) -> dict:
    from ster_dist.families.registry import family_table

    table = family_table()
    counts: dict[str, int] = {}
    for row in table:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"families": table, "counts": counts}


def cmd_inspect(args) -> dict:
    from ster_dist.engine import model_config
    from ster_dist.resolve import describe, resolve

    checkpoint = resolve(args.model, args.revision)
    out = describe(checkpoint)
    try:
        out["config"] = model_config(checkpoint).summary()
    except Refusal as refusal:  # resolvable but not (yet) runnable: say so, still describe it
        out["config"] = None
        out["runnable"] = str(refusal)
    return out


class _Session:
    """The driver's view of one run: checkpoint resolved once, tokenizer, config, and the ranks."""

    def __init__(self, args):
        from ster_dist.engine import check_device, compute_dtype, model_config
        from ster_dist.resolve import resolve
        from ster_dist.tokenizer import Tokenizer
        from ster_dist.workers.group import load_on, open_group

        if args.tp < 1:
            raise Refusal(f"--tp must be 1 or more, got {args.tp}")
        check_device(args.device)
        compute_dtype(args.precision, args.device)
        progress(f"resolving {args.model}")
        self.checkpoint = resolve(args.model, args.revision)
        self.cfg = model_config(self.checkpoint)
        self.tokenizer = Tokenizer.from_directory(self.checkpoint.directory)
        where = f"{args.tp} ranks" if args.tp > 1 else "this process"
        progress(f"loading {self.checkpoint.weight_format} weights ({len(self.checkpoint.weight_files)} files) "
                 f"in {where}")
        self.group = open_group(args.tp, args.device, args.address)
        try:
            self.loads = load_on(self.group, self.checkpoint, args.precision, args.device)
        except BaseException:
            self.group.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.group.close()


def cmd_generate(args) -> dict:
    from ster_dist.generate import Sampling

    if (args.prompt is None) == (args.prompts is None):
        raise Refusal("give exactly one of --prompt TEXT or --prompts FILE")
    if args.prompts is not None and args.output is None:
        raise Refusal("--prompts needs --output FILE for the answers")
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed).check()
    system = _read_text(args.system, "--system") if args.system else None
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    with _Session(args) as session:
        tokenizer = session.tokenizer
        encoded = [tokenizer.prompt_ids(p, system, args.chat_template) for p in prompts]
        eos = session.cfg.eos_token_ids or tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
        progress(f"generating for {len(prompts)} prompt(s), up to {sampling.max_new_tokens} tokens")
        outputs = session.group.call("generate", encoded, sampling, eos, tokenizer.pad_token_id or 0)[0]
        revision = session.checkpoint.model_revision
    results = []
    for prompt, ids, new in zip(prompts, encoded, outputs):
        finished = bool(new) and new[-1] in eos
        results.append({"prompt": prompt, "text": tokenizer.decode(new[:-1] if finished else new),
                        "prompt_tokens": len(ids), "completion_tokens": len(new),
                        "finish_reason": "stop" if finished else "length"})
    header = {"model": args.model, "model_revision": revision, "precision": args.precision, "tp": args.tp, "chat_template": _template_state(tokenizer, args.chat_template),
              "sampling": {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                           "top_p": sampling.top_p, "seed": sampling.seed}}
    if args.prompts is None:
        return {**header, **results[0]}
    out = {**header, "results": results}
    _write_json_atomic(Path(args.output), out)
    return {**header, "output": args.output, "prompts": len(results)}


def cmd_parity(args) -> dict:
    with _Session(args) as session:
        progress("running ster_dist and the reference (Transformers) on the same tokens")
        result = session.group.call("parity", args.tokens, args.seed)[0]
    if not result["passed"]:
        args.exit_code = 1
        progress(f"parity FAILED: past the threshold {result['threshold']}")
    return result


def cmd_toy_model(args) -> dict:
    from ster_dist.toy import make_toy_model

    return make_toy_model(Path(args.directory), layers=args.layers, hidden=args.hidden, seed=args.seed)


def cmd_gguf_import(args) -> dict:
    from ster_dist.gguf.importer import import_gguf

    return import_gguf(Path(args.file), Path(args.directory), to_safetensors=args.safetensors)


def cmd_later(args) -> dict:
    raise Refusal(f"ster {args.command} ({LATER[args.command]}) is not available in this ster_dist build yet")


# -- helpers --------------------------------------------------------------------------------------

def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(f"{flag} {path}: {exc.strerror or exc}") from None


def _read_prompts(path: str) -> list[str]:
    try:
        data = json.loads(_read_text(path, "--prompts"))
    except json.JSONDecodeError as exc:
        raise Refusal(f"--prompts {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    prompts = data.get("prompts") if isinstance(data, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
        raise Refusal(f'--prompts {path} must be {{"prompts": ["...", ...]}} with at least one string')
    return prompts


def _template_state(tokenizer, mode: str) -> str:
    return "on" if mode != "off" and tokenizer.chat_template else "off"


def _write_json_atomic(path: Path, data: dict) -> None:
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False)
    os.replace(tmp, path)


# -- parser ---------------------------------------------------------------------------------------

def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a local model directory or a Hugging Face Hub id")
    p.add_argument("--revision", default=None, help="Hub revision (default main); metadata only for a directory")


def _runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (Ray actors when above 1)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (else RAY_ADDRESS, else a local one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ster", description="Run Hugging Face decoder checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("families", help="every family of the architecture gate with its status")
    p.set_defaults(run=cmd_families)

    p = sub.add_parser("inspect-model", help="resolve a model and describe it, reading no weights")
    _model_args(p)
    p.set_defaults(run=cmd_inspect)

    p = sub.add_parser("generate", help="generate text")
    _model_args(p)
    _runtime_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("--prompts", default=None, help='a {"prompts": [...]} JSON file, answered in order')
    p.add_argument("--output", default=None)
    p.add_argument("--system", default=None, help="a file holding the system message")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("parity", help="compare against Transformers per layer and on the logits")
    _model_args(p)
    _runtime_args(p)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="JSON output (always on; kept for Ster's flag)")
    p.set_defaults(run=cmd_parity)

    p = sub.add_parser("toy-model", help="write a tiny random Llama checkpoint with a tokenizer")
    p.add_argument("directory")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=cmd_toy_model)

    p = sub.add_parser("gguf-import", help="turn a .gguf file into a model directory")
    p.add_argument("file")
    p.add_argument("directory")
    p.add_argument("--safetensors", action="store_true", help="write dequantized safetensors instead")
    p.set_defaults(run=cmd_gguf_import)

    for name, what in LATER.items():
        p = sub.add_parser(name, help=f"{what} (not in this build yet)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(run=cmd_later)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.exit_code = 0
    try:
        emit(args.run(args))
    except Refusal as refusal:
        print(str(refusal), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""`ster extract`: residual-stream hidden states at the named layers, streamed to safetensors.

The file holds `layers.{L}` (F32, [rows, hidden]: one row per prompt with --positions last, one per
token of every prompt, prompt after prompt, with --positions all), `lengths` (I64, tokens per
prompt), with --positions all `token_ids` (I64, the tokens those rows belong to), and a metadata
block: model, model_revision ("" when none), precision, chat_template, layers (a JSON list),
positions, hidden_size, prompts. Batches go to disk as they are read (the shapes are known once
the prompts are tokenized), and the file appears under its name only when whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ster_dist.commands.common import model_args, progress, runtime_args, session
from ster_dist.commands.steer import adapted, adapter_arg
from ster_dist.errors import Refusal


def cmd_extract(args) -> dict:
    from ster_dist.steer.bar import bar
    from ster_dist.steer.capture import POSITIONS, capture
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.pairs import load_prompts
    from ster_dist.steer.preflight import model_config_of, positive
    from ster_dist.steer.store import StreamedSafetensors
    from ster_dist.steer.text import chat_status, encode_prompt

    positions = getattr(args, "positions", "last")
    mode = getattr(args, "chat_template", "auto")
    if positions not in POSITIONS:
        raise Refusal(f"--positions must be last or all, got {positions!r}")
    batch_size = positive(getattr(args, "batch_size", 8), "--batch-size")
    output = Path(args.output)
    if output.is_dir():
        raise Refusal(f"--output {output} is a directory; name the .safetensors file to write")
    prompts = load_prompts(args.input)
    cfg = model_config_of(args)
    layers = parse_layers(getattr(args, "layers", "all"), cfg.num_layers)
    with session(args) as run, adapted(run, args):
        tokenizer = run.tokenizer
        chat = chat_status(tokenizer, mode)
        encoded = [encode_prompt(tokenizer, p, mode) for p in prompts]
        for ids in encoded:
            if len(ids) > cfg.max_position:
                raise Refusal(f"prompt contains {len(ids)} tokens, model context allows {cfg.max_position}; "
                              "shorten it")
        lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
        rows = len(encoded) if positions == "last" else int(lengths.sum())
        tensors = {f"layers.{layer}": (torch.float32, (rows, cfg.hidden_size)) for layer in layers}
        tensors["lengths"] = (torch.int64, (len(encoded),))
        if positions == "all":
            tensors["token_ids"] = (torch.int64, (rows,))
        revision = run.checkpoint.model_revision
        metadata = {"format": "ster_dist.activations", "model": args.model, "model_revision": revision or "",
                    "precision": args.precision, "chat_template": chat, "layers": json.dumps(layers),
                    "positions": positions, "hidden_size": str(cfg.hidden_size), "prompts": str(len(encoded)),
                    "adapter": getattr(args, "adapter", None) or ""}
        progress(f"capturing {len(encoded)} prompts at layers {layers} ({positions} positions) in batches of "
                 f"{batch_size}")
        update = bar("extract")
        with StreamedSafetensors(output, tensors, metadata) as store:
            store.write_rows("lengths", 0, lengths)
            if positions == "all":
                store.write_rows("token_ids", 0, torch.tensor([t for ids in encoded for t in ids]))
            row = 0
            for start, read in capture(run.group, encoded, layers, positions, tokenizer.pad_token_id or 0,
                                       batch_size):
                for layer in layers:
                    store.write_rows(f"layers.{layer}", row, read[layer])
                row += read[layers[0]].shape[0]
                update(min(start + batch_size, len(encoded)), len(encoded))
    return {"model": args.model, "model_revision": revision, "precision": args.precision, "chat_template": chat,
            "layers": layers, "positions": positions, "hidden_size": cfg.hidden_size, "prompts": len(encoded),
            "rows": rows, "tp": args.tp, "adapter": getattr(args, "adapter", None), "output": str(output)}


def register(sub) -> None:
    p = sub.add_parser("extract", help="hidden states at named layers, written as safetensors")
    model_args(p)
    runtime_args(p)
    p.add_argument("--input", required=True, help='a {"prompts": [...]} JSON file')
    p.add_argument("--output", required=True, help="the .safetensors file to write")
    p.add_argument("--layers", default="all", help="all, a comma list, or a half-open range such as 8..16")
    p.add_argument("--positions", default="last", choices=["last", "all"])
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    adapter_arg(p)
    p.set_defaults(run=cmd_extract)

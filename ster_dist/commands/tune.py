"""tune: LoRA adapters trained across ranks with DeepSpeed, and completion-token evaluation.

    ster tune sft --model M --examples EX.json --output ADAPTER --learning-rate LR --epochs N --seed S
                  [--rank R] [--alpha A] [--targets q,k,v,o[,gate,up,down]] [--adapter-layers all|L1,L2|A..B]
                  [--batch-size B] [--accumulation K] [--max-sequence T] [--dp N] [--tp N] [--zero 1|2]
                  [--precision f32|bf16]
    ster tune evaluate --model M [--adapter A] --examples EX.json [--tp N]

sft writes a PEFT adapter directory and prints the run's report; evaluate writes nothing.
"""

from __future__ import annotations

import math
import time

from ster_dist.commands.common import (
    model_args,
    modifiers,
    progress,
    read_text,
    runtime_args,
    session,
)
from ster_dist.errors import Refusal


def _bar(step: int, steps: int, out: dict, width: int = 24) -> None:
    filled = width * step // max(steps, 1)
    progress(f"training [{'#' * filled}{'.' * (width - filled)}] {step}/{steps} loss {out['loss']:.4f}",
             step=step, steps=steps, loss=out["loss"], tokens=out["tokens"])


def cmd_sft(args) -> dict:
    from ster_dist.tune.prepare import prepare
    from ster_dist.tune.spec import TrainSettings, parse_targets, require_numbers
    from ster_dist.tune.train import train
    from ster_dist.tune.writer import write_adapter
    from ster_dist.workers.group import open_group

    require_numbers(args)
    settings = TrainSettings(
        rank=args.rank, alpha=args.alpha, targets=parse_targets(args.targets), layers=(), epochs=args.epochs,
        learning_rate=args.learning_rate, seed=args.seed, batch_size=args.batch_size, accumulation=args.accumulation,
        max_sequence=args.max_sequence, dp=args.dp, tp=args.tp, precision=args.precision, zero_stage=args.zero,
        max_grad_norm=args.max_grad_norm, weight_decay=args.weight_decay, device=args.device)
    system = read_text(args.system, "--system") if args.system else None
    progress(f"resolving {args.model}")
    plan, header = prepare(args.model, args.examples, settings, args.adapter_layers, args.revision,
                           args.chat_template, system, args.output)
    world = settings.dp * settings.tp
    progress(f"training {len(plan.sites)} projections on {world} rank(s) (dp {settings.dp} x tp {settings.tp}): "
             f"{header['examples']} examples, {header['steps']} steps")
    start = time.perf_counter()
    group = open_group(world, args.device, args.address, args.launcher)
    try:
        result = train(group, plan, on_step=_bar)
    finally:
        group.close()
    report = {**header, "final_loss": result["losses"][-1], "first_loss": result["losses"][0],
              "epoch_losses": _epoch_losses(result, header["steps"] // settings.epochs),
              "output": str(args.output), "seconds": round(time.perf_counter() - start, 3)}
    files = write_adapter(args.output, plan.sites, result["factors"], report, header["num_layers"])
    progress(f"wrote adapter {args.output}")
    return {**report, "files": files}


def _epoch_losses(result: dict, per_epoch: int) -> list[float]:
    """Token-weighted loss of each epoch (its steps' losses weighted by their completion tokens)."""
    out = []
    for start in range(0, len(result["losses"]), per_epoch):
        losses, tokens = result["losses"][start:start + per_epoch], result["tokens"][start:start + per_epoch]
        out.append(sum(x * t for x, t in zip(losses, tokens)) / sum(tokens))
    return out


def cmd_evaluate(args) -> dict:
    from ster_dist.steer.text import chat_status
    from ster_dist.tune.data import encode_examples, read_examples
    from ster_dist.tune.evaluate import LossesOnRank, summarise

    if args.batch_size < 1:
        raise Refusal(f"--batch-size must be a whole number of at least 1, got {args.batch_size}")
    rows = read_examples(args.examples)
    system = read_text(args.system, "--system") if args.system else None
    args.vector = None  # evaluate carries an adapter, never a steering vector
    with session(args) as run, modifiers(run, args):
        tokenizer, cfg = run.tokenizer, run.cfg
        chat = chat_status(tokenizer, args.chat_template)
        max_sequence = args.max_sequence or cfg.max_position
        examples, truncated = encode_examples(tokenizer, rows, args.chat_template, system, run.eos, max_sequence)
        progress(f"scoring {len(examples)} examples")
        per_example = run.group.on(LossesOnRank).losses(examples, tokenizer.pad_token_id or 0, args.batch_size)[0]
        revision = run.checkpoint.model_revision
    summary = summarise(per_example)
    if not math.isfinite(summary["loss"]):
        progress("the loss is not finite: the model gives some completion token zero probability")
    return {"model": args.model, "model_revision": revision, "adapter": args.adapter, "precision": args.precision,
            "tp": args.tp, "chat_template": chat, "truncated_examples": truncated, **summary}


def register(sub) -> None:
    p = sub.add_parser("tune", help="train LoRA adapters across ranks (DeepSpeed) and evaluate them")
    tune = p.add_subparsers(dest="tune_command", required=True)

    p = tune.add_parser("sft", help="supervised fine-tuning of LoRA factors (the base frozen)")
    model_args(p)
    p.add_argument("--examples", required=True, help='a {"examples": [{"prompt", "completion"}, ...]} JSON file')
    p.add_argument("--output", required=True, help="the PEFT adapter directory to write (must not exist)")
    p.add_argument("--learning-rate", type=float, default=None, help="required: AdamW's learning rate")
    p.add_argument("--epochs", type=int, default=None, help="required: passes over the examples")
    p.add_argument("--seed", type=int, default=None, help="required: seeds the factors' start and the order")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha; the update is scaled by alpha / r")
    p.add_argument("--targets", default="q,k,v,o", help="projections to adapt: q,k,v,o,gate,up,down")
    p.add_argument("--adapter-layers", default="all", help="all, a comma list, or START..END (end excluded)")
    p.add_argument("--batch-size", type=int, default=1, help="examples per micro-batch on each data-parallel rank")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--max-sequence", type=int, default=None,
                   help="tokens per example, prompt and completion (default: the model's positions)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (world = dp x tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--zero", type=int, default=2, help="DeepSpeed ZeRO stage: 1 or 2 (default 2)")
    p.add_argument("--precision", default="f32", help="f32 or bf16 (f32 master factors either way)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--address", default=None, help="an existing Ray cluster (else RAY_ADDRESS, else a local one)")
    p.add_argument("--launcher", default="ray", choices=["ray", "spawn"],
                   help="ranks as Ray actors, or as local processes (one machine, no Ray)")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--system", default=None, help="a file holding the system message of every example")
    p.set_defaults(run=cmd_sft)

    p = tune.add_parser("evaluate", help="loss and perplexity over completion tokens; nothing written")
    model_args(p)
    runtime_args(p)
    p.add_argument("--examples", required=True, help='a {"examples": [{"prompt", "completion"}, ...]} JSON file')
    p.add_argument("--adapter", default=None, help="a LoRA adapter applied unmerged")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-sequence", type=int, default=None)
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--system", default=None, help="a file holding the system message of every example")
    p.set_defaults(run=cmd_evaluate)

"""tune sft | evaluate: LoRA adapters trained across dp x tp ranks with DeepSpeed (the base frozen,
loaded by the streaming loader), and loss over completion tokens. sft writes a PEFT adapter
directory and returns the run's report; evaluate writes nothing."""

from __future__ import annotations

import math
import time

from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, read_text
from ster_dist.schema.tune import TuneEvaluateRequest, TuneSftRequest
from ster_dist.session import Session, modifiers


def _bar(step: int, steps: int, out: dict, width: int = 24) -> None:
    filled = width * step // max(steps, 1)
    progress(f"training [{'#' * filled}{'.' * (width - filled)}] {step}/{steps} loss {out['loss']:.4f}",
             step=step, steps=steps, loss=out["loss"], tokens=out["tokens"])


def sft(request: TuneSftRequest) -> dict:
    from ster_dist.tune.prepare import prepare
    from ster_dist.tune.spec import TrainSettings, parse_targets
    from ster_dist.tune.train import train
    from ster_dist.tune.writer import write_adapter
    from ster_dist.workers.group import open_group

    r = request
    output_not_an_input(r)
    settings = TrainSettings(
        rank=r.rank, alpha=r.alpha, targets=parse_targets(r.targets), layers=(), epochs=r.epochs,
        learning_rate=r.learning_rate, seed=r.seed, batch_size=r.batch_size, accumulation=r.accumulation,
        max_sequence=r.max_sequence, dp=r.dp, tp=r.tp, precision=r.precision, zero_stage=r.zero,
        max_grad_norm=r.max_grad_norm, weight_decay=r.weight_decay, device=r.device)
    system = read_text(r.system, r.label("system")) if r.system else None
    progress(f"resolving {r.model}")
    plan, header = prepare(r.model, r.examples, settings, r.adapter_layers, r.revision, r.chat_template, system,
                           r.output)
    world = settings.dp * settings.tp
    progress(f"training {len(plan.sites)} projections on {world} rank(s) (dp {settings.dp} x tp {settings.tp}): "
             f"{header['examples']} examples, {header['steps']} steps")
    start = time.perf_counter()
    group = open_group(world, r.device, r.address, r.launcher)
    try:
        result = train(group, plan, on_step=_bar)
    finally:
        group.close()
    report = {**header, "final_loss": result["losses"][-1], "first_loss": result["losses"][0],
              "epoch_losses": _epoch_losses(result, header["steps"] // settings.epochs),
              "output": str(r.output), "seconds": round(time.perf_counter() - start, 3)}
    files = write_adapter(r.output, plan.sites, result["factors"], report, header["num_layers"])
    progress(f"wrote adapter {r.output}")
    return {**report, "files": files}


def _epoch_losses(result: dict, per_epoch: int) -> list[float]:
    """Token-weighted loss of each epoch (its steps' losses weighted by their completion tokens)."""
    out = []
    for start in range(0, len(result["losses"]), per_epoch):
        losses, tokens = result["losses"][start:start + per_epoch], result["tokens"][start:start + per_epoch]
        out.append(sum(x * t for x, t in zip(losses, tokens)) / sum(tokens))
    return out


def evaluate(session: Session, request: TuneEvaluateRequest) -> dict:
    from ster_dist.steer.text import chat_status
    from ster_dist.tune.data import encode_examples, read_examples
    from ster_dist.tune.evaluate import LossesOnRank, summarise

    rows = read_examples(request.examples)
    system = read_text(request.system, request.label("system")) if request.system else None
    with modifiers(session, request, steering=False):
        tokenizer, cfg = session.tokenizer, session.cfg
        chat = chat_status(tokenizer, request.chat_template)
        max_sequence = request.max_sequence or cfg.max_position
        examples, truncated = encode_examples(tokenizer, rows, request.chat_template, system, session.eos,
                                              max_sequence)
        progress(f"scoring {len(examples)} examples")
        per_example = session.group.on(LossesOnRank).losses(examples, session.pad_id, request.batch_size)[0]
        revision = session.checkpoint.model_revision
    summary = summarise(per_example)
    if not math.isfinite(summary["loss"]):
        progress("the loss is not finite: the model gives some completion token zero probability")
    return {"model": request.model, "model_revision": revision, "adapter": request.adapter,
            "precision": request.precision, "tp": request.tp, "chat_template": chat,
            "truncated_examples": truncated, **summary}

"""The driver's half of `ster tune sft` before any rank starts: resolve, refuse, plan, tokenize.

Everything here reads the config, the safetensors headers, the tokenizer and the examples, never a
weight: a run that would be refused is refused before a rank is started or a byte of weights is read.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ster_dist.errors import Refusal
from ster_dist.tune.data import encode_examples, read_examples, schedule
from ster_dist.tune.spec import TrainSettings, check_values, refuse_checkpoint
from ster_dist.tune.train import TrainPlan


def prepare(model: str, examples: str, settings: TrainSettings, layers: str = "all", revision: str | None = None,
            chat_template: str = "auto", system: str | None = None,
            output: str | Path | None = None) -> tuple[TrainPlan, dict]:
    """(the plan, the report's header: model, revision, targets, layers, examples, steps, chat_template)."""
    from ster_dist.config_load import model_config
    from ster_dist.load import check_device
    from ster_dist.resolve import resolve
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.text import chat_status
    from ster_dist.tokenizer import Tokenizer
    from ster_dist.tune.lora import plan_sites

    check_values(settings)
    check_device(settings.device)
    if output is not None and Path(output).exists():
        raise Refusal(f"output {output} already exists; remove it or choose another --output")
    checkpoint = resolve(model, revision)
    refuse_checkpoint(checkpoint, settings.targets)
    cfg = model_config(checkpoint)
    chosen = tuple(parse_layers(layers, cfg.num_layers))
    if settings.max_sequence is None:
        settings = replace(settings, max_sequence=cfg.max_position)
    settings = replace(settings, layers=chosen)
    if settings.max_sequence > cfg.max_position:
        raise Refusal(f"--max-sequence {settings.max_sequence} is past the model's {cfg.max_position} positions; "
                      f"use at most --max-sequence {cfg.max_position}")
    sites = plan_sites(cfg, checkpoint, settings.targets, chosen)
    tokenizer = Tokenizer.from_directory(checkpoint.directory)
    chat = chat_status(tokenizer, chat_template)
    eos = cfg.eos_token_ids or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    encoded, truncated = encode_examples(tokenizer, read_examples(examples), chat_template, system, eos,
                                         settings.max_sequence)
    steps = schedule(len(encoded), settings.epochs, settings.step_examples, settings.seed)
    plan = TrainPlan(checkpoint, settings, sites, encoded, steps, tokenizer.pad_token_id or 0)
    header = {"model": model, "model_revision": checkpoint.model_revision, "family": cfg.family,
              "rank": settings.rank, "alpha": settings.alpha, "targets": list(settings.targets),
              "layers": list(chosen), "examples": len(encoded), "truncated_examples": truncated,
              "completion_tokens": sum(e.completion_tokens for e in encoded), "epochs": settings.epochs,
              "steps": len(steps), "step_examples": settings.step_examples, "batch_size": settings.batch_size,
              "accumulation": settings.accumulation, "learning_rate": settings.learning_rate, "seed": settings.seed,
              "max_sequence": settings.max_sequence, "dp": settings.dp, "tp": settings.tp,
              "zero_stage": settings.zero_stage, "precision": settings.precision, "chat_template": chat,
              "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers}
    return plan, header

"""The driver's half of `ster tune sft | dpo | reward | grpo` before any rank starts: resolve,
refuse, plan, tokenize.

Everything here reads the config, the safetensors headers, the tokenizer and the examples (pairs,
prompts, a reward model's factors), never a base weight: a run that would be refused is refused
before a rank is started or a byte of base weights is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ster_dist.errors import Refusal
from ster_dist.tune.data import schedule
from ster_dist.tune.objective import SFT, Objective
from ster_dist.tune.spec import TrainSettings, check_values, refuse_checkpoint
from ster_dist.tune.train import TrainPlan


def prepare(
    model: str,
    examples: str,
    settings: TrainSettings,
    layers: str = "all",
    revision: str | None = None,
    chat_template: str = "auto",
    system: str | None = None,
    output: str | Path | None = None,
) -> tuple[TrainPlan, dict]:
    """`tune sft`'s (the plan, the report's header: model, revision, targets, layers, examples,
    steps, chat_template, ...)."""
    from ster_dist.tune.data import encode_examples, read_examples

    rows = read_examples(examples)
    base = _base(model, settings, layers, revision, chat_template, output)
    encoded, truncated = encode_examples(
        base.tokenizer, rows, chat_template, system, base.eos, base.settings.max_sequence
    )
    return _plan(
        base,
        encoded,
        SFT,
        {
            "examples": len(encoded),
            "truncated_examples": truncated,
            "completion_tokens": sum(e.completion_tokens for e in encoded),
        },
    )


def prepare_pairs(
    model: str,
    pairs: str,
    settings: TrainSettings,
    objective: Objective,
    layers: str = "all",
    revision: str | None = None,
    chat_template: str = "auto",
    system: str | None = None,
    output: str | Path | None = None,
) -> tuple[TrainPlan, dict]:
    """`tune dpo` / `tune reward`'s plan and header (the pairs and the objective instead of
    examples)."""
    from ster_dist.tune.pairs import encode_pairs, read_pairs

    rows = read_pairs(pairs)
    base = _base(model, settings, layers, revision, chat_template, output)
    encoded = encode_pairs(
        base.tokenizer, rows, chat_template, system, base.eos, base.settings.max_sequence
    )
    return _plan(
        base,
        encoded,
        objective,
        {
            "objective": objective.name,
            "pairs": len(encoded),
            "completion_tokens": sum(p.completion_tokens for p in encoded),
        },
    )


def prepare_prompts(
    model: str,
    prompts: str,
    settings: TrainSettings,
    rollout: dict,
    layers: str = "all",
    revision: str | None = None,
    chat_template: str = "auto",
    system: str | None = None,
    output: str | Path | None = None,
) -> tuple[TrainPlan, dict]:
    """`tune grpo`'s plan and header: the prompts, and the objective that samples and scores their
    groups (rollout: group_size, max_new_tokens, temperature, beta, reward: "length" or a reward
    model directory)."""
    from ster_dist.tune.grpo import Grpo
    from ster_dist.tune.rollout import encode_prompts, open_reward, read_prompts, reward_config

    rows = read_prompts(prompts)
    scorer = None if rollout["reward"] == "length" else reward_config(rollout["reward"])
    base = _base(model, settings, layers, revision, chat_template, output)
    if not base.eos:
        raise Refusal(
            f"{model} names no end-of-sequence token, so a sampled completion could never stop; add "
            "eos_token to tokenizer_config.json"
        )
    turns = rollout.get("turns", 1)
    user = _user_model(base, model, rollout.get("user_model"), chat_template) if turns > 1 else None
    reward = (
        None
        if scorer is None
        else open_reward(rollout["reward"], scorer, base.cfg, base.checkpoint, model)
    )
    encoded = encode_prompts(
        base.tokenizer,
        rows,
        chat_template,
        system,
        rollout["max_new_tokens"],
        base.settings.max_sequence,
    )
    objective = Grpo(
        rollout["group_size"],
        rollout["max_new_tokens"],
        rollout["temperature"],
        rollout["beta"],
        base.settings.seed,
        frozenset(base.eos),
        reward,
        turns,
        user,
        base.settings.max_sequence,
        base.settings.precision,
        base.settings.device,
        str(base.checkpoint.directory),
    )
    conversation = {"turns": turns, "user_model": rollout.get("user_model")} if turns > 1 else {}
    return _plan(
        base,
        encoded,
        objective,
        {
            "objective": "grpo",
            "prompts": len(encoded),
            "group_size": objective.group_size,
            "max_new_tokens": objective.max_new_tokens,
            "temperature": objective.temperature,
            "beta": objective.beta,
            "reward": "length" if reward is None else reward.path,
            **conversation,
        },
    )


def _user_model(base: _Base, model: str, user_model: str, chat_template: str):
    """The model playing the user (resolved, its config and tokenizer read; no weight), refused
    unless both sides can hold a conversation: the policy and the user each through a chat
    template."""
    from ster_dist.config.load import model_config
    from ster_dist.resolve import resolve
    from ster_dist.tokenizer import Tokenizer
    from ster_dist.tune.grpo import UserModel

    if chat_template == "off" or not base.tokenizer.has_chat_template:
        why = (
            "--chat-template is off" if chat_template == "off" else f"{model} has no chat template"
        )
        raise Refusal(
            f"--turns needs the policy's chat template to write the user's turns, but {why}; use a chat "
            "model with --chat-template auto, or --turns 1"
        )
    checkpoint = resolve(user_model)
    if Path(checkpoint.directory).resolve() == Path(base.checkpoint.directory).resolve():
        return UserModel(None, frozenset(base.eos), base.cfg.max_position)
    tokenizer = Tokenizer.from_directory(checkpoint.directory)
    if not tokenizer.has_chat_template:
        raise Refusal(
            f"--user-model {user_model} has no chat template, so it cannot answer as the user; pass a chat "
            "model (or the policy's own --model)"
        )
    cfg = model_config(checkpoint)
    eos = cfg.eos_token_ids or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    if not eos:
        raise Refusal(
            f"--user-model {user_model} names no end-of-sequence token, so its turns could never stop; add "
            "eos_token to its tokenizer_config.json"
        )
    return UserModel(checkpoint, frozenset(eos), cfg.max_position)


@dataclass(frozen=True)
class _Base:
    model: str  # as the request named it (the adapter records it so)
    checkpoint: object
    cfg: object
    settings: TrainSettings
    sites: list
    tokenizer: object
    eos: tuple[int, ...]
    chat: str


def _base(
    model: str,
    settings: TrainSettings,
    layers: str,
    revision: str | None,
    chat_template: str,
    output: str | Path | None,
) -> _Base:
    """What every objective's run needs: the settings and output refused, the model resolved and
    refused, the sites planned, the tokenizer read."""
    from ster_dist.config.load import model_config
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
        raise Refusal(
            f"--max-sequence {settings.max_sequence} is past the model's {cfg.max_position} positions; "
            f"use at most --max-sequence {cfg.max_position}"
        )
    sites = plan_sites(cfg, checkpoint, settings.targets, chosen)
    tokenizer = Tokenizer.from_directory(checkpoint.directory)
    chat = chat_status(tokenizer, chat_template)
    eos = cfg.eos_token_ids or (
        (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    )
    return _Base(model, checkpoint, cfg, settings, sites, tokenizer, eos, chat)


def _plan(base: _Base, items: list, objective: Objective, counts: dict) -> tuple[TrainPlan, dict]:
    settings, cfg = base.settings, base.cfg
    steps = schedule(len(items), settings.epochs, settings.step_examples, settings.seed)
    plan = TrainPlan(
        base.checkpoint,
        settings,
        base.sites,
        items,
        steps,
        base.tokenizer.pad_token_id or 0,
        objective,
    )
    header = {
        "model": base.model,
        "model_revision": base.checkpoint.model_revision,
        "family": cfg.family,
        "rank": settings.rank,
        "alpha": settings.alpha,
        "targets": list(settings.targets),
        "layers": list(settings.layers),
        **counts,
        "epochs": settings.epochs,
        "steps": len(steps),
        "step_examples": settings.step_examples,
        "batch_size": settings.batch_size,
        "accumulation": settings.accumulation,
        "learning_rate": settings.learning_rate,
        "seed": settings.seed,
        "max_sequence": settings.max_sequence,
        "dp": settings.dp,
        "tp": settings.tp,
        "zero_stage": settings.zero_stage,
        "precision": settings.precision,
        "chat_template": base.chat,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
    }
    return plan, header

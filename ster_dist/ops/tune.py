"""tune sft | dpo | reward | grpo | evaluate: LoRA adapters trained across dp x tp ranks with
DeepSpeed (the base frozen, loaded by the streaming loader), and loss over completion tokens. sft,
dpo and grpo write a PEFT adapter directory, reward a PEFT sequence-classification adapter (kind
"reward"), each returning the run's report; evaluate writes nothing."""

from __future__ import annotations

import contextlib
import math
import time

from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, read_text
from ster_dist.schema.tune import (
    TuneDpoRequest,
    TuneEvaluateRequest,
    TuneGrpoRequest,
    TuneRewardRequest,
    TuneSftRequest,
)
from ster_dist.session import Session, modifiers


def _bar(step: int, steps: int, out: dict, width: int = 24) -> None:
    filled = width * step // max(steps, 1)
    progress(
        f"training [{'#' * filled}{'.' * (width - filled)}] {step}/{steps} loss {out['loss']:.4f}",
        step=step,
        steps=steps,
        **{k: v for k, v in out.items() if k not in ("step", "units")},
    )


def sft(request: TuneSftRequest) -> dict:
    from ster_dist.tune.prepare import prepare

    system = _system(request)
    return _train(
        request,
        lambda settings: prepare(
            request.model,
            request.examples,
            settings,
            request.adapter_layers,
            request.revision,
            request.chat_template,
            system,
            request.output,
        ),
    )


def dpo(request: TuneDpoRequest) -> dict:
    from ster_dist.tune.preference import DirectPreference
    from ster_dist.tune.spec import check_beta

    objective = DirectPreference(request.loss, check_beta(request.beta))
    return _train(request, _pairs(request, objective), {"beta": request.beta})


def reward(request: TuneRewardRequest) -> dict:
    from ster_dist.tune.preference import RewardModel

    return _train(request, _pairs(request, RewardModel()))


def grpo(request: TuneGrpoRequest) -> dict:
    from ster_dist.tune.prepare import prepare_prompts

    system = _system(request)
    rollout = {
        "group_size": request.group_size,
        "max_new_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "beta": request.beta,
        "reward": request.reward,
        "turns": request.turns,
        "user_model": request.user_model,
    }
    extra = {
        "rollout": request.rollout,
        **({"rollout_tp": request.rollout_tp} if request.rollout == "engine" else {}),
    }
    return _train(
        request,
        lambda settings: prepare_prompts(
            request.model,
            request.prompts,
            settings,
            rollout,
            request.adapter_layers,
            request.revision,
            request.chat_template,
            system,
            request.output,
        ),
        extra,
        _engine_rollouts(request) if request.rollout == "engine" else None,
    )


def _engine_rollouts(request: TuneGrpoRequest):
    """--rollout engine: a token engine on --rollout-tp ranks of its own, beside the training ranks
    (on the same Ray cluster, which the training group has joined or started by the time this runs);
    for conversations with another checkpoint as --user-model, a second engine on --rollout-tp ranks
    holding it."""
    from ster_dist.tune.engine_rollouts import EngineRollouts, needs_user_group
    from ster_dist.workers.group import open_group

    def open_beside(training):
        from ster_dist.workers.ray_group import RayGroup

        # beside the training ranks on their cluster, even for one rank
        if isinstance(training, RayGroup):
            return RayGroup(request.rollout_tp, request.device, request.address)
        return open_group(request.rollout_tp, request.device, request.address, request.launcher)

    @contextlib.contextmanager
    def opened(plan, training):
        with contextlib.ExitStack() as stack:
            progress(f"starting the rollout engine on {request.rollout_tp} rank(s)")
            group = stack.enter_context(contextlib.closing(open_beside(training)))
            user_group = None
            if needs_user_group(plan):
                progress(f"starting the user model's engine on {request.rollout_tp} rank(s)")
                user_group = stack.enter_context(contextlib.closing(open_beside(training)))
            rollouts = stack.enter_context(
                contextlib.closing(EngineRollouts(group, plan, user_group=user_group))
            )
            yield rollouts

    return opened


def _system(request) -> str | None:
    return read_text(request.system, request.label("system")) if request.system else None


def _pairs(request, objective):
    from ster_dist.tune.prepare import prepare_pairs

    system = _system(request)
    return lambda settings: prepare_pairs(
        request.model,
        request.pairs,
        settings,
        objective,
        request.adapter_layers,
        request.revision,
        request.chat_template,
        system,
        request.output,
    )


def _train(request, prepare, extra: dict | None = None, rollouts=None) -> dict:
    """Every training command's run: settings, the plan (refused before any rank starts), the ranks,
    the report, the adapter directory."""
    from ster_dist.tune.spec import TrainSettings, parse_targets
    from ster_dist.tune.train import train
    from ster_dist.tune.writer import write_adapter
    from ster_dist.workers.group import open_group

    r = request
    output_not_an_input(r)
    settings = TrainSettings(
        rank=r.rank,
        alpha=r.alpha,
        targets=parse_targets(r.targets),
        layers=(),
        epochs=r.epochs,
        learning_rate=r.learning_rate,
        seed=r.seed,
        batch_size=r.batch_size,
        accumulation=r.accumulation,
        max_sequence=r.max_sequence,
        dp=r.dp,
        tp=r.tp,
        precision=r.precision,
        zero_stage=r.zero,
        max_grad_norm=r.max_grad_norm,
        weight_decay=r.weight_decay,
        device=r.device,
    )
    progress(f"resolving {r.model}")
    plan, header = prepare(settings)
    header = {**header, **(extra or {})}
    world = settings.dp * settings.tp
    what = next(k for k in ("pairs", "prompts", "examples") if k in header)
    progress(
        f"training {len(plan.sites)} projections on {world} rank(s) (dp {settings.dp} x tp {settings.tp}): "
        f"{header[what]} {what}, {header['steps']} steps"
    )
    start = time.perf_counter()
    group = open_group(world, r.device, r.address, r.launcher)
    try:
        # the engine's group is closed first: the training group may own the Ray cluster both are on
        with rollouts(plan, group) if rollouts is not None else contextlib.nullcontext() as engine:
            result = train(group, plan, on_step=_bar, rollouts=engine)
    finally:
        group.close()
    report = {
        **header,
        "final_loss": result["losses"][-1],
        "first_loss": result["losses"][0],
        "epoch_losses": _epoch_losses(result, header["steps"] // settings.epochs),
        **_last_metrics(result),
        "output": str(r.output),
        "seconds": round(time.perf_counter() - start, 3),
    }
    files = write_adapter(r.output, plan.sites, result["factors"], report, header["num_layers"])
    progress(
        f"wrote {'reward model' if 'score.weight' in result['factors'] else 'adapter'} {r.output}"
    )
    return {**report, "files": files}


def _last_metrics(result: dict) -> dict:
    """A preference or grpo run's reward numbers (margin, accuracy, mean reward, KL, ...) of its
    first and final steps."""
    from ster_dist.tune.grpo import METRICS as GRPO
    from ster_dist.tune.preference import METRICS as PREFERENCE

    first, last = result["steps"][0], result["steps"][-1]
    return {
        f"{when}_{name}": step[name]
        for name in PREFERENCE + GRPO
        if name in last
        for when, step in (("first", first), ("final", last))
    }


def _epoch_losses(result: dict, per_epoch: int) -> list[float]:
    """Each epoch's loss (its steps' losses weighted by their units: completion tokens, or
    pairs)."""
    out = []
    for start in range(0, len(result["losses"]), per_epoch):
        losses, tokens = (
            result["losses"][start : start + per_epoch],
            result["units"][start : start + per_epoch],
        )
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
        examples, truncated = encode_examples(
            tokenizer, rows, request.chat_template, system, session.eos, max_sequence
        )
        progress(f"scoring {len(examples)} examples")
        per_example = session.group.on(LossesOnRank).losses(
            examples, session.pad_id, request.batch_size
        )[session.group.lead]
        revision = session.checkpoint.model_revision
    summary = summarise(per_example)
    if not math.isfinite(summary["loss"]):
        progress("the loss is not finite: the model gives some completion token zero probability")
    return {
        "model": request.model,
        "model_revision": revision,
        "adapter": request.adapter,
        "precision": request.precision,
        "tp": request.tp,
        "chat_template": chat,
        "truncated_examples": truncated,
        **summary,
    }

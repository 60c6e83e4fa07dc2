"""Training LoRA factors with DeepSpeed on dp x tp ranks.

The driver (tune/prepare.py, then `train` here) resolves the model, runs every refusal, tokenizes
the examples and fixes the seeded order of steps, then drives the ranks one optimizer step per call,
so it can draw the progress bar with each step's loss whether the ranks are Ray actors or spawned
processes. Each rank (`TrainingOnRank`, a rank extension: setup, step, finish) loads its
tensor-parallel shard of the frozen base with the same streaming loader as inference
(load.load_model under a TrainCtx), attaches the factors (tune/lora.py) and hands DeepSpeed a module
whose only parameters are the
factors:
DeepSpeed averages their gradients over the data-parallel group, partitions the optimizer state over
it (ZeRO stage 1 or 2), accumulates micro-batches and keeps f32 master factors under bf16.

What is minimised is the plan's objective (tune/objective.py: sft's completion NLL,
tune/preference.py: DPO, IPO and the reward model's Bradley-Terry loss, tune/grpo.py: GRPO over
completions it samples on the rank); the loop is theirs in common. The loss is weighted over each
whole step: every micro-batch's summed loss is scaled by dp x accumulation / (step units x tp), the
units being the objective's (completion tokens, pairs, or sampled completions), so after DeepSpeed's
1 / accumulation, its data-parallel mean and the tensor-parallel sum, the gradient is that of the
mean loss over every unit of the step, however dp, tp and accumulation split it.

DeepSpeed on CPU: its TorchBackend builds the shared-memory all-reduce op (a 34 s JIT compile on
first use, ~66 MB per rank left in /dev/shm) for inference_all_reduce alone, which training never
calls; the op is marked incompatible before the backend starts, so no op is built and nothing is
left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ster_dist.checkpoint import Checkpoint
from ster_dist.errors import Refusal
from ster_dist.tune.data import micro_batches
from ster_dist.tune.lora import Attached, LoraFactors, TrainSite
from ster_dist.tune.objective import SFT, Objective
from ster_dist.tune.parallel import forget_layouts, layout
from ster_dist.tune.spec import TrainSettings
from ster_dist.workers.extension import RankExtension


@dataclass
class TrainPlan:
    """Everything the ranks need, decided on the driver (no rank re-reads the examples or the seed's
    order)."""

    checkpoint: Checkpoint
    settings: TrainSettings
    sites: list[TrainSite]
    # the objective's items: Examples for sft, Pairs for dpo / ipo / reward, Prompts for grpo
    examples: list
    steps: list[list[int]]
    pad_id: int
    objective: Objective = SFT
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


# ---- driver -----------------------------------------------------------------------------------


def train(
    group, plan: TrainPlan, on_step=None, gradients_at: int | None = None, rollouts=None
) -> dict:
    """Run the plan on `group` (world = dp x tp ranks). Returns {"factors": {"a.i"/"b.j" (and the
    objective's head, "score.weight"): f32 global values}, "ranks": every rank's, "losses", "tokens"
    and "units" per step, "steps": each step's report, "gradients": the full gradients of step
    `gradients_at` (before its update) when asked}. `rollouts` (grpo's
    tune/engine_rollouts.EngineRollouts), when given, samples each step's items before the step,
    under the factors as they stand, in place of the ranks."""
    world = plan.settings.dp * plan.settings.tp
    training = group.on(TrainingOnRank)
    setup = training.setup(plan)
    if len(setup) != world:
        raise Refusal(
            f"the worker group has {len(setup)} ranks; --dp {plan.settings.dp} x --tp "
            f"{plan.settings.tp} needs {world}"
        )
    losses, tokens, reports, gradients = [], [], [], None
    try:
        for index in range(len(plan.steps)):
            drawn = None
            if rollouts is not None:
                rollouts.refresh(training.factors(plan.token)[0])
                drawn = rollouts.draw([plan.examples[i] for i in plan.steps[index]], index)
            out = training.step(plan.token, index, index == gradients_at, drawn)[0]
            losses.append(out["loss"])
            tokens.append(out.get("tokens"))
            if out.get("gradients") is not None:
                gradients = out.pop("gradients")
            reports.append(out)
            if on_step is not None:
                on_step(index + 1, len(plan.steps), out)
        ranks = training.finish(plan.token)
    except BaseException:
        with contextlib.suppress(BaseException):
            training.abandon(plan.token)
        raise
    return {
        "factors": ranks[0],
        "ranks": ranks,
        "losses": losses,
        "tokens": tokens,
        "units": [r["units"] for r in reports],
        "steps": reports,
        "gradients": gradients,
        "bytes_read": sum(s["bytes_read"] for s in setup),
    }


# ---- ranks ------------------------------------------------------------------------------------


class _Objective(nn.Module):
    """What DeepSpeed wraps: only the factors (and the objective's head, if it has one) are its
    parameters, so only they are broadcast, cast to bf16 and partitioned; the frozen decoder is held
    beside them, unregistered. What is minimised is the plan's Objective (tune/objective.py)."""

    def __init__(
        self,
        factors: LoraFactors,
        head: nn.Module | None,
        decoder,
        attached: Attached,
        objective: Objective,
    ):
        super().__init__()
        self.factors = factors
        # "score": the name Transformers' sequence-classification models give the head
        self.score = head
        # a tuple: nn.Module does not register what it holds
        self.held = (decoder, attached, objective)
        self.last = None

    def trainable(self) -> dict[str, nn.Parameter]:
        """Every trained value by the name the run returns it under: "a.i", "b.j",
        "score.weight"."""
        out = dict(self.factors.named_parameters())
        if self.score is not None:
            out |= {f"score.{n}": p for n, p in self.score.named_parameters()}
        return out

    def forward(self, *batch_and_weight):
        *batch, weight = batch_and_weight
        decoder, attached, objective = self.held
        attached.refresh()
        loss, self.last = objective.loss(decoder, attached, self.score, tuple(batch))
        return loss * weight


@dataclass
class _Run:
    plan: TrainPlan
    engine: object
    objective: _Objective
    attached: Attached
    lay: object
    own_group: bool


class _Stderr:
    """Whatever sys.stderr is when written to."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@contextlib.contextmanager
def _quiet():
    """DeepSpeed prints and logs to stdout, where the CLI writes its JSON: send both to stderr, and
    only its errors (its logger's handler holds the stdout of the moment it was imported)."""
    with contextlib.redirect_stdout(sys.stderr):
        logger = logging.getLogger("DeepSpeed")
        logger.setLevel(logging.ERROR)
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and not isinstance(handler.stream, _Stderr):
                # not setStream, which flushes the old stream first: it may be closed by now (a
                # stdout replaced
                # after DeepSpeed was imported, such as a test's captured one)
                with handler.lock:
                    handler.stream = _Stderr()
        yield


def _deepspeed(device: str):
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    # DeepSpeed insists on LOCAL_RANK; every rank here sees its one device as device 0 (Ray gives
    # each
    # actor one GPU; spawned ranks run on the CPU)
    os.environ.setdefault("LOCAL_RANK", "0")
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    return deepspeed


def _ensure_group(world: int) -> bool:
    """A one-rank run in this process has no process group yet: make one (True when made here)."""
    if dist.is_initialized():
        return False
    if world != 1:
        raise Refusal(f"a {world}-rank run needs a worker group of {world} ranks")
    # one rank has no one to meet: an in-process store, not a TCPStore listening on every interface
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def ds_config(s: TrainSettings) -> dict:
    return {
        "train_micro_batch_size_per_gpu": s.batch_size,
        "gradient_accumulation_steps": s.accumulation,
        "train_batch_size": s.step_examples,
        "zero_optimization": {"stage": s.zero_stage},
        "bf16": {"enabled": s.precision == "bf16"},
        "gradient_clipping": s.max_grad_norm,
        "zero_allow_untested_optimizer": True,  # torch's AdamW: no CPU-Adam op to JIT-build
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class TrainingOnRank(RankExtension):
    """The training runs set up on one rank: token -> its DeepSpeed engine, factors and layout.
    Closing the rank abandons any run left (a driver that died mid-run), releasing its process
    group."""

    def __init__(self, rank):
        super().__init__(rank)
        self.runs: dict[str, _Run] = {}

    def setup(self, plan: TrainPlan) -> dict:
        from ster_dist.load import load_model

        s = plan.settings
        deepspeed = _deepspeed(s.device)
        with _quiet():
            own = _ensure_group(s.dp * s.tp)
            try:
                lay = layout(s.dp, s.tp)
                torch.manual_seed(s.seed)
                loaded = load_model(plan.checkpoint, s.precision, s.device, lay.ctx())
                factors = LoraFactors(plan.sites, s.rank, s.seed, s.b_init_std)
                head = plan.objective.head(loaded.cfg.hidden_size, s.seed, s.head_init_std)
                attached = Attached(loaded.model, factors, plan.sites, s.scale, lay.ctx())
                objective = _Objective(factors, head, loaded.model, attached, plan.objective)
                optimizer = torch.optim.AdamW(
                    objective.parameters(), lr=s.learning_rate, weight_decay=s.weight_decay
                )
                engine, *_ = deepspeed.initialize(
                    model=objective, optimizer=optimizer, config=ds_config(s), mpu=lay.mpu()
                )
            except BaseException:
                if own:
                    dist.destroy_process_group()
                    forget_layouts()
                raise
        self.runs[plan.token] = _Run(plan, engine, objective, attached, lay, own)
        return {
            "rank": lay.rank,
            "dp_rank": lay.dp_rank,
            "tp_rank": lay.tp_rank,
            "bytes_read": loaded.bytes_read,
            "trainable": sum(p.numel() for p in objective.parameters()),
        }

    def step(
        self, token: str, index: int, gradients: bool = False, drawn: list | None = None
    ) -> dict:
        """One optimizer step: this rank's micro-batches of step `index`; the step's report (its
        loss weighted by the objective's units: tokens or pairs). `drawn`: the step's items as the
        driver sampled them (grpo's prompts with their completions), in the step's order, in place
        of the plan's."""
        from deepspeed.utils import safe_get_full_grad

        run = self._run(token)
        plan, s, engine = run.plan, run.plan.settings, run.engine
        step = plan.steps[index]
        items = dict(zip(step, drawn)) if drawn is not None else plan.examples
        units = plan.objective.units([plan.examples[i] for i in step])
        weight = s.dp * s.accumulation / (units * s.tp)
        sums = torch.zeros(plan.objective.width, dtype=torch.float64)
        grads = None
        with _quiet():
            for micro in micro_batches(step, s.batch_size, s.accumulation, s.dp, run.lay.dp_rank):
                # an empty slot (a short last step) still runs, weighted zero: every rank must reach
                # each reduction
                batch = [items[i] for i in micro] or [items[step[0]]]
                decoder, attached, _ = run.objective.held
                inputs = plan.objective.inputs(decoder, attached, batch, plan.pad_id, index)
                loss = engine(*inputs, weight if micro else 0.0)
                engine.backward(loss)
                if micro:
                    sums += run.objective.last
                if gradients and engine.is_gradient_accumulation_boundary():
                    grads = {
                        n: safe_get_full_grad(p).float().clone()
                        for n, p in run.objective.trainable().items()
                    }
                engine.step()
        dist.all_reduce(sums, group=run.lay.dp_group)
        out = {"step": index + 1, **plan.objective.report(sums)}
        if grads is not None and run.lay.rank == 0:
            out["gradients"] = grads
        return out

    def factors(self, token: str) -> dict[str, torch.Tensor]:
        """The global factors and head as they stand (the f32 masters), gathered over the
        data-parallel ranks (every rank must be asked)."""
        from deepspeed.utils import safe_get_full_fp32_param

        run = self._run(token)
        with _quiet():
            return {
                n: safe_get_full_fp32_param(p).float().clone()
                for n, p in run.objective.trainable().items()
            }

    def finish(self, token: str) -> dict[str, torch.Tensor]:
        """The trained global factors and head, from every rank; then the run is torn down."""
        try:
            return self.factors(token)
        finally:
            self.abandon(token)

    def abandon(self, token: str) -> bool:
        run = self.runs.pop(token, None)
        if run is None:
            return False
        run.attached.detach()
        run.engine = run.objective = None
        gc.collect()
        if run.own_group:
            dist.destroy_process_group()
            forget_layouts()
        return True

    def close(self) -> None:
        for token in list(self.runs):
            self.abandon(token)

    def _run(self, token: str) -> _Run:
        run = self.runs.get(token)
        if run is None:
            raise Refusal("this rank holds no such training run; it was finished or never set up")
        return run

"""`ster tune grpo --rollout engine`: GRPO's groups sampled by the token engine on its own ranks,
the trained factors pushed to it as a per-request adapter before every step.

On the tiny llama planted to stop early (as tests/tune/test_tune_grpo.py): the engine draws, token
for token, the completions the in-process sampler draws from the same factors (B at zero, B away
from zero, and after the adapter's tensors are replaced in place); two training steps with engine
rollouts report the numbers in-process rollouts report (the first loss and KL exactly zero, the same
rewards and lengths, the second step sampled under the factors the first step trained); the same
with the engine on two tensor-parallel ranks (--rollout-tp 2, spawned gloo ranks: through the API
and the command), and with a reward model from `ster tune reward` scoring the engine's completions
and conversations; and on a local Ray cluster (127.0.0.1, started and shut down here) the training
rank and the engine's rank, two groups on one cluster, give the first step's numbers of a run in one
process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# as tests/tune/test_tune.py
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

from ster_dist.load import load_model
from ster_dist.tune.engine_rollouts import EngineRollouts
from ster_dist.tune.lora import Attached, LoraFactors
from ster_dist.tune.parallel import TrainCtx
from ster_dist.tune.prepare import prepare_prompts
from ster_dist.tune.rollout import sample_group
from ster_dist.tune.spec import TrainSettings
from ster_dist.tune.train import train
from ster_dist.workers.group import LocalGroup
from tests.tiny_models import make_tiny
from tests.tune_checks import grpo_argv, trains_as_the_rank, write_jsonl
from tests.tune_checks import plant_early_stops as _plant_early_stops
from tests.tune_checks import quiet_cli as _quiet_cli

PROMPTS = [{"prompt": f"question {i} about the weather"} for i in range(4)]
PAIRS = [
    {"prompt": f"question {i}", "chosen": "yes it is", "rejected": f"answer {i * 7}"}
    for i in range(2)
]
ALL = ("query", "key", "value", "output", "gate", "up", "down")
ROLLOUT = {
    "group_size": 4,
    "max_new_tokens": 8,
    "temperature": 1.0,
    "beta": 0.04,
    "reward": "length",
}
pytestmark = pytest.mark.filterwarnings("ignore:Unexpected keyword arguments:UserWarning")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo_engine")
    _plant_early_stops(make_tiny("llama", root / "base"), root / "base")
    write_jsonl(root / "prompts.jsonl", PROMPTS)
    return root


def _plan(llama: Path, steps: int, rollout: dict | None = None, **extra):
    settings = TrainSettings(
        **{
            "rank": 4,
            "alpha": 8,
            "targets": ALL,
            "layers": (),
            "epochs": 2,
            "learning_rate": 3e-2,
            "seed": 0,
            "batch_size": 4,
            **extra,
        }
    )
    plan, _ = prepare_prompts(
        str(llama / "base"), str(llama / "prompts.jsonl"), settings, {**ROLLOUT, **(rollout or {})}
    )
    plan.steps = plan.steps[:steps]
    return plan


def _in_process(decoder, plan, factors: LoraFactors, step: int) -> list[list[list[int]]]:
    """Every prompt's group as the training rank samples it, under `factors`."""
    o = plan.objective
    attached = Attached(decoder, factors, plan.sites, plan.settings.scale, TrainCtx())
    try:
        with torch.no_grad():
            attached.refresh()
        return [
            sample_group(
                decoder,
                attached.ctx,
                p,
                o.group_size,
                o.max_new_tokens,
                o.temperature,
                o.stops,
                o.seed,
                step,
            )
            for p in plan.examples
        ]
    finally:
        attached.detach()


def _state(factors: LoraFactors) -> dict:
    return {n: p.detach().clone() for n, p in factors.named_parameters()}


def _draws_as_the_rank(rollouts: EngineRollouts, decoder) -> None:
    """The engine's groups are the rank's, token for token, under B at zero, B away from zero and
    after the adapter's tensors are replaced in place, at two steps."""
    plan = rollouts.plan
    start = LoraFactors(plan.sites, 4, 0)  # B at zero: the base
    moved = LoraFactors(plan.sites, 4, 0, b_init_std=0.3)  # B away from zero: another policy
    seen = []
    for factors, step in ((start, 0), (moved, 0), (moved, 1), (start, 1)):
        rollouts.refresh(_state(factors))  # registered once, then its tensors replaced in place
        drawn = [[list(c) for c in p.completions] for p in rollouts.draw(plan.examples, step)]
        assert drawn == _in_process(decoder, plan, factors, step), (step, len(seen))
        seen.append(drawn)
    assert seen[0] != seen[1]  # the pushed factors are the ones sampled under
    assert seen[0] != seen[3]  # another step draws other completions


def test_the_engine_draws_the_completions_the_rank_draws(llama):
    plan = _plan(llama, 1)
    with LocalGroup() as group:
        rollouts = EngineRollouts(group, plan)
        try:
            _draws_as_the_rank(rollouts, load_model(plan.checkpoint).model)
        finally:
            rollouts.close()


def test_engine_rollouts_train_as_rank_rollouts(llama):
    reference = train(LocalGroup(), _plan(llama, 2))
    with LocalGroup() as group:
        rollouts = EngineRollouts(group, _plan(llama, 2))
        try:
            got = train(LocalGroup(), rollouts.plan, rollouts=rollouts)
        finally:
            rollouts.close()
    trains_as_the_rank(got, reference)


def test_an_engine_on_two_ranks_samples_as_the_rank(llama, tp2):
    """--rollout-tp 2: the engine's ranks each hold half of every head and projection (the adapter's
    factors split as the base's rows are), and the rank-0 draw is every rank's; on the tiny llama
    its paged TP=2 logits and the rank's whole re-read draw the same tokens, so the equality checks
    of TP=1 hold as they stand."""
    plan = _plan(llama, 2)
    reference = train(LocalGroup(), _plan(llama, 2))
    rollouts = EngineRollouts(tp2, plan)
    try:
        _draws_as_the_rank(rollouts, load_model(plan.checkpoint).model)
        # the adapter replaced once more, by the trained factors
        got = train(LocalGroup(), plan, rollouts=rollouts)
    finally:
        rollouts.close()
    trains_as_the_rank(got, reference)


@pytest.fixture(scope="module")
def reward_model(llama) -> Path:
    """A `ster tune reward` model of the planted base, as tests/tune/test_tune_grpo.py trains
    one."""
    write_jsonl(llama / "pairs.jsonl", PAIRS)
    _quiet_cli(
        "tune",
        "reward",
        "--model",
        str(llama / "base"),
        "--pairs",
        str(llama / "pairs.jsonl"),
        "--output",
        str(llama / "reward"),
        "--learning-rate",
        "1e-2",
        "--epochs",
        "1",
        "--seed",
        "0",
        "--batch-size",
        "2",
    )
    return llama / "reward"


@pytest.mark.parametrize("turns", [1, 2])
def test_a_reward_model_scores_the_engines_rollouts_as_the_ranks(llama, reward_model, turns):
    """--reward DIR with engine rollouts: the reward model scores on the training rank what the
    engine drew, the same rewards as for the rank's own draws, single turns and conversations with
    the policy's base as the user (its turns drawn on the same engine without the adapter)."""
    rollout = {"reward": str(reward_model)}
    if turns > 1:
        rollout |= {
            "turns": turns,
            "user_model": str(llama / "base"),
            "group_size": 2,
            "max_new_tokens": 6,
        }
    reference = train(LocalGroup(), _plan(llama, 2, rollout))
    with LocalGroup() as group:
        rollouts = EngineRollouts(group, _plan(llama, 2, rollout))
        try:
            got = train(LocalGroup(), rollouts.plan, rollouts=rollouts)
        finally:
            rollouts.close()
    assert rollouts.plan.objective.reward is not None and (turns > 1) == (
        rollouts.plan.objective.turns > 1
    )
    trains_as_the_rank(got, reference)


def _argv(llama: Path, output: str, *extra) -> list[str]:
    return grpo_argv(
        llama,
        llama / output,
        "--learning-rate",
        "3e-2",
        "--epochs",
        "1",
        "--max-new-tokens",
        "8",
        *extra,
    )


@pytest.fixture(scope="module")
def one_process(llama) -> dict:
    """The command's report with rollouts on the training rank, in this process."""
    return _quiet_cli(*_argv(llama, "one_process"))


def test_the_command_runs_an_engine_on_two_spawned_ranks(llama, one_process):
    """`--rollout engine --rollout-tp 2 --launcher spawn`: the one training rank here, the engine's
    two ranks spawned processes; the report names them and has the numbers of rollouts on the
    rank."""
    got = _quiet_cli(
        *_argv(llama, "tp2", "--rollout", "engine", "--rollout-tp", "2", "--launcher", "spawn")
    )
    assert got["rollout"] == "engine" and got["rollout_tp"] == 2
    assert got["first_loss"] == 0.0 and got["first_kl"] == 0.0
    for key in (
        "first_reward",
        "first_completion_length",
        "final_reward",
        "final_completion_length",
    ):
        assert got[key] == one_process[key], key


def test_on_a_local_ray_cluster_the_first_step_is_the_one_process_step(llama, one_process):
    """The training rank and the engine's rank as two groups on one Ray cluster (loopback, this
    test's own)."""
    import ray

    from ster_dist.workers.ray_group import start_ray

    assert start_ray(None, num_cpus=2)
    try:
        address = ray.get_runtime_context().gcs_address
        assert address.startswith("127.0.0.1:")
        on_ray = _quiet_cli(*_argv(llama, "on_ray", "--rollout", "engine", "--address", address))
        assert not ray.util.placement_group_table() or all(
            # both groups gone
            pg["state"] == "REMOVED"
            for pg in ray.util.placement_group_table().values()
        )
    finally:
        ray.shutdown()
    assert (
        on_ray["rollout"] == "engine"
        and on_ray["rollout_tp"] == 1
        and one_process["rollout"] == "rank"
    )
    assert on_ray["first_loss"] == 0.0 and on_ray["first_kl"] == 0.0
    for key in (
        "first_reward",
        "first_completion_length",
        "final_reward",
        "final_completion_length",
    ):
        assert on_ray[key] == one_process[key], key

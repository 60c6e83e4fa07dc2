"""`ster tune grpo --turns N --user-model M`: conversations between the policy and a user model, the
loss over the policy's tokens alone.

On the tiny llama planted to stop early (tests/tune/test_tune_grpo.py) as the policy and another
tiny llama (another seed) as the user: the first step's loss and KL are exactly zero; every
conversation's row is its prompt, then the policy's turns as sampled and the user's turns as the
policy's chat template writes them, and only the policy's tokens are targets (the length reward
counts them); the policy's own base as the user model speaks with the factors skipped; one step's
gradients at TP=2 (the user model sharded too) equal TP=1's for the same seeded conversations; with
--rollout engine the token engine holds the same conversations token for token (the user's turns on
a second engine, or on the same engine without the adapter when the user model is the policy's base)
and two training steps give the rank's numbers, in this process and (-m slow) as three groups on a
local Ray cluster; every refusal comes before a weight is read.
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
from ster_dist.tokenizer import Tokenizer
from ster_dist.tune.data import IGNORE
from ster_dist.tune.engine_rollouts import EngineRollouts
from ster_dist.tune.lora import Attached, LoraFactors
from ster_dist.tune.parallel import TrainCtx
from ster_dist.tune.prepare import prepare_prompts
from ster_dist.tune.spec import TrainSettings
from ster_dist.tune.train import train
from ster_dist.workers.group import LocalGroup
from tests.tiny_models import make_tiny
from tests.tiny_tokenizer import build_tiny_tokenizer
from tests.tune_checks import grpo_argv, run_cli, trains_as_the_rank, write_jsonl
from tests.tune_checks import plant_early_stops as _plant_early_stops
from tests.tune_checks import quiet_cli as _quiet_cli

PROMPTS = [{"prompt": f"question {i} about the weather"} for i in range(4)]
ALL = ("query", "key", "value", "output", "gate", "up", "down")
EOS = 2
pytestmark = pytest.mark.filterwarnings("ignore:Unexpected keyword arguments:UserWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo_turns")
    _plant_early_stops(make_tiny("llama", root / "base"), root / "base")
    make_tiny("llama", root / "user", seed=1)
    make_tiny("llama", root / "plain", seed=2)
    build_tiny_tokenizer(root / "plain", chat_template=None)  # a base model: no chat template
    write_jsonl(root / "prompts.jsonl", PROMPTS)
    return root


def _rollout(models: Path, user: str, turns: int = 3) -> dict:
    return {
        "group_size": 2,
        "max_new_tokens": 6,
        "temperature": 1.0,
        "beta": 0.04,
        "reward": "length",
        "turns": turns,
        "user_model": str(models / user),
    }


def _plan(models: Path, user: str = "user", turns: int = 3, **extra):
    settings = TrainSettings(
        **{
            "rank": 4,
            "alpha": 8,
            "targets": ALL,
            "layers": (),
            "epochs": 1,
            "learning_rate": 1e-2,
            "seed": 0,
            "batch_size": 4,
            **extra,
        }
    )
    plan, header = prepare_prompts(
        str(models / "base"), str(models / "prompts.jsonl"), settings, _rollout(models, user, turns)
    )
    return plan, header


@pytest.fixture(scope="module")
def batches(models) -> dict:
    """Conversations sampled once per user model, for the tests that read them (sampling is the slow
    part)."""
    return {}


def _sampled(models: Path, batches: dict, user: str):
    if user not in batches:
        batches[user] = _batch(models, user)
    return batches[user]


def _batch(models: Path, user: str):
    plan, _ = _plan(models, user)
    decoder = load_model(plan.checkpoint).model
    attached = Attached(
        decoder, LoraFactors(plan.sites, 4, 0), plan.sites, plan.settings.scale, TrainCtx()
    )
    try:
        with torch.no_grad():
            attached.refresh()
        return plan, plan.objective.inputs(decoder, attached, plan.examples, 0, 0)
    finally:
        attached.detach()


@pytest.mark.parametrize("user", ["user", "base"])
def test_only_the_policys_tokens_are_targets(models, batches, user):
    """Each row: the prompt, then three policy turns (targets) with two user turns between them (not
    targets), each written as ChatML writes a user message after the policy's end of turn; the
    length reward counts the policy's tokens less the stop tokens that ended its turns."""
    plan, (inputs, valid, targets, _, rewards) = _sampled(models, batches, user)
    tokenizer = Tokenizer.from_directory(models / "base")
    for row in range(len(inputs)):
        n = int(valid[row].sum())
        assert targets[row, n - 1] != IGNORE  # a conversation ends with the policy's turn
        # position t predicts ids[t + 1]
        ids = inputs[row, :n].tolist() + [targets[row, n - 1].item()]
        counted = [targets[row, t].item() != IGNORE for t in range(n)]
        prompt = plan.examples[row // 2].ids
        assert tuple(ids[: len(prompt)]) == prompt and not any(counted[: len(prompt) - 1])
        # the runs of ids after the prompt, policy's (counted) or user's
        runs = []
        # id i is the policy's when position i - 1 predicts it with loss
        for i in range(len(prompt), n + 1):
            if runs and runs[-1][0] == counted[i - 1]:
                runs[-1][1].append(ids[i])
            else:
                runs.append((counted[i - 1], [ids[i]]))
        assert [policy for policy, _ in runs] == [True, False, True, False, True]
        for (_, before), (_, user_turn) in zip(runs[0::2], runs[1::2]):
            text = tokenizer.decode(user_turn, skip_special_tokens=False)
            opening = (
                "\n<|im_start|>user\n" if before[-1] == EOS else "<|im_end|>\n<|im_start|>user\n"
            )
            assert text.startswith(opening) and text.endswith(
                "<|im_end|>\n<|im_start|>assistant\n"
            ), text
        policy = [t for is_policy, run in runs if is_policy for t in run]
        assert rewards[row] == len(policy) - policy.count(EOS)
    assert not torch.equal(inputs[0], inputs[1])  # two conversations of one prompt differ


def test_the_users_turns_carry_no_gradient(models, batches):
    """The loss's gradient reaches the logits at the policy's positions and is exactly zero at the
    user's."""
    plan, batch = _sampled(models, batches, "user")
    inputs, valid, targets, _, _ = batch
    decoder = load_model(plan.checkpoint).model
    seen = []

    def recording(*args):
        logits = decoder(*args)
        if torch.is_grad_enabled():  # the policy's forward (the reference runs under no_grad)
            logits.retain_grad()
            seen.append(logits)
        return logits

    recording.device = decoder.device
    factors = LoraFactors(plan.sites, 4, 0, b_init_std=0.1)
    attached = Attached(decoder, factors, plan.sites, plan.settings.scale, TrainCtx())
    try:
        attached.refresh()
        loss, _ = plan.objective.loss(recording, attached, None, batch)
        loss.backward()
    finally:
        attached.detach()
    grad = seen[0].grad.abs().amax(-1)  # [rows, positions]
    counted = targets != IGNORE
    after_prompt = torch.zeros_like(counted)
    for row in range(len(inputs)):
        after_prompt[row, len(plan.examples[row // 2].ids) - 1 : int(valid[row].sum())] = True
    user = after_prompt & ~counted
    assert user.any() and counted.any()
    assert (grad[user] == 0).all()
    assert (grad[counted] > 0).all()


def _argv(models: Path, output: Path, *extra) -> list[str]:
    return grpo_argv(
        models,
        output,
        "--learning-rate",
        "1e-2",
        "--epochs",
        "1",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        *extra,
    )


def test_the_first_conversation_step_is_the_identity(models, tmp_path):
    report = _quiet_cli(
        *_argv(models, tmp_path / "out", "--turns", "2", "--user-model", str(models / "user"))
    )
    assert report["first_loss"] == 0.0 and report["first_kl"] == 0.0
    assert report["turns"] == 2 and report["user_model"] == str(models / "user")
    assert report["first_completion_length"] > 0


def test_gradients_at_tp2_equal_tp1(models, tp2):
    def step(group, **extra):
        plan, _ = _plan(models, turns=2, b_init_std=0.1, **extra)
        return train(group, plan, gradients_at=0)

    reference = step(LocalGroup())
    got = step(tp2, tp=2)
    for key in ("reward", "completion_length", "tokens", "completions"):
        assert got["steps"][0][key] == reference["steps"][0][key], key
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    scale = max(g.abs().max() for g in reference["gradients"].values())
    worst = (
        max((got["gradients"][k] - g).abs().max() for k, g in reference["gradients"].items())
        / scale
    )
    assert worst < 1e-5, worst


# ---- conversations on the token engine (--rollout engine)
# -----------------------------------------


def _rank_conversations(decoder, plan, factors: LoraFactors, step: int) -> list:
    """Every prompt's group of conversations as the training rank samples them, under `factors`."""
    attached = Attached(decoder, factors, plan.sites, plan.settings.scale, TrainCtx())
    try:
        with torch.no_grad():
            attached.refresh()
        return plan.objective.conversations(decoder, attached, plan.examples, step)
    finally:
        attached.detach()


def _state(factors: LoraFactors) -> dict:
    return {n: p.detach().clone() for n, p in factors.named_parameters()}


@pytest.mark.parametrize("user", ["user", "base"])
def test_the_engine_holds_the_conversations_the_rank_holds(models, user):
    """Token for token, user's turns and spans included: the policy's turns under the pushed factors
    (B at zero, B away from zero, then replaced in place), the user's on a second engine holding the
    user model, or on the same engine without the adapter when the user model is the policy's
    base."""
    plan, _ = _plan(models, user)
    decoder = load_model(plan.checkpoint).model
    start = LoraFactors(plan.sites, 4, 0)
    moved = LoraFactors(plan.sites, 4, 0, b_init_std=0.3)
    with LocalGroup() as group, LocalGroup() as user_group:
        rollouts = EngineRollouts(group, plan, user_group=user_group if user == "user" else None)
        assert (rollouts.user_engine is not None) == (user == "user")
        try:
            seen = []
            for factors, step in ((start, 0), (moved, 0), (start, 1)):
                rollouts.refresh(_state(factors))
                drawn = [list(p.conversations) for p in rollouts.draw(plan.examples, step)]
                assert drawn == _rank_conversations(decoder, plan, factors, step), (
                    user,
                    step,
                    len(seen),
                )
                seen.append(drawn)
        finally:
            rollouts.close()
    conversations = [c for group in seen[0] for c in group]
    # three policy turns, the user answering between
    assert all(len(c.user_spans) == 2 for c in conversations)
    # the factors pushed, and the step, are the ones drawn under
    assert seen[0] != seen[1] and seen[0] != seen[2]


def test_engine_conversations_train_as_rank_conversations(models):
    """Two steps of conversations with another user model: the first the identity (loss and KL
    exactly zero) either way, the same rewards and lengths, the second sampled under the factors the
    first trained."""
    reference = train(LocalGroup(), _plan(models, turns=2, epochs=2)[0])
    plan, _ = _plan(models, turns=2, epochs=2)
    with LocalGroup() as group, LocalGroup() as user_group:
        rollouts = EngineRollouts(group, plan, user_group=user_group)
        try:
            got = train(LocalGroup(), plan, rollouts=rollouts)
        finally:
            rollouts.close()
    trains_as_the_rank(got, reference)


def test_the_command_runs_conversations_on_the_engine(models, tmp_path):
    """`--rollout engine` with `--turns`: the rollout engine and the user model's engine beside the
    training rank, the first step's numbers those of conversations sampled on the rank."""
    common = ("--turns", "2", "--user-model", str(models / "user"))
    on_rank = _quiet_cli(*_argv(models, tmp_path / "rank", *common))
    on_engine = _quiet_cli(*_argv(models, tmp_path / "engine", *common, "--rollout", "engine"))
    assert on_engine["rollout"] == "engine" and on_engine["turns"] == 2
    assert on_engine["first_loss"] == 0.0 and on_engine["first_kl"] == 0.0
    for key in ("first_reward", "first_completion_length"):
        assert on_engine[key] == on_rank[key], key


@pytest.mark.slow
def test_on_a_local_ray_cluster_three_groups_hold_the_conversations(models, tmp_path):
    """The training rank, the rollout engine's and the user model's engine's as three groups on one
    Ray cluster (loopback, this test's own): the conversations reach the training actor with the
    step, and the first step's numbers are those of conversations sampled on the rank in this
    process."""
    import ray

    from ster_dist.workers.ray_group import start_ray

    common = ("--turns", "2", "--user-model", str(models / "user"))
    on_rank = _quiet_cli(*_argv(models, tmp_path / "rank", *common))
    assert start_ray(None, num_cpus=4)  # a CPU each (Ray's bookkeeping), one left unreserved
    try:
        address = ray.get_runtime_context().gcs_address
        on_ray = _quiet_cli(
            *_argv(models, tmp_path / "ray", *common, "--rollout", "engine", "--address", address)
        )
        assert not ray.util.placement_group_table() or all(
            # every group gone
            pg["state"] == "REMOVED"
            for pg in ray.util.placement_group_table().values()
        )
    finally:
        ray.shutdown()
    assert (
        on_ray["rollout"] == "engine" and on_ray["first_loss"] == 0.0 and on_ray["first_kl"] == 0.0
    )
    for key in ("first_reward", "first_completion_length"):
        assert on_ray[key] == on_rank[key], key


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--turns", "0"), "--turns must be at least 1"),
        (("--turns", "2"), "--turns 2 needs --user-model"),
        (("--user-model", "USER"), "--turns 1 has none"),
        (
            ("--turns", "2", "--user-model", "PLAIN"),
            "has no chat template, so it cannot answer as the user",
        ),
        (
            ("--turns", "2", "--user-model", "USER", "--chat-template", "off"),
            "--turns needs the policy's chat template",
        ),
    ],
)
def test_refusals(models, tmp_path, capsys, extra, message):
    extra = tuple(
        str(models / "user") if e == "USER" else str(models / "plain") if e == "PLAIN" else e
        for e in extra
    )
    code, _, err = run_cli(capsys, *_argv(models, tmp_path / "out", *extra))
    said = [
        line for line in err.strip().splitlines() if not line.startswith('{"event": "progress"')
    ]
    assert code == 2 and "Traceback" not in err and len(said) == 1 and "training [" not in err, err
    assert message in err
    assert not (tmp_path / "out").exists()

"""`ster tune dpo` (DPO, IPO) and `ster tune reward` (Bradley-Terry): the preference objectives on
the sft training loop, against PEFT and Transformers.

On a tiny llama: the first step's loss is the identity each objective starts at (DPO and the reward
model ln 2, IPO 1 / (4 beta^2)), since LoRA's B and the reward head start at zero; the loss falls on
a planted preference (the chosen completion always the same words); one step's gradients (factors
and head) at TP=2 equal TP=1's on real gloo ranks (--dp 2, accumulation and IPO's marked slow); the
DPO adapter loads in PEFT with the logits the runtime attach gives, the reward model loads in PEFT
as a sequence-classification adapter with the rewards the run's head gives; `--adapter` refuses a
reward model; every refusal of the pairs and the settings comes before a weight is read.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# as tests/tune/test_tune.py
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

from ster_dist.cli import main
from ster_dist.load import load_model
from ster_dist.tune.lora import Attached, LoraFactors
from ster_dist.tune.pairs import collate_whole
from ster_dist.tune.parallel import TrainCtx
from ster_dist.tune.preference import DirectPreference, RewardModel, rewards
from ster_dist.tune.prepare import prepare_pairs
from ster_dist.tune.spec import TrainSettings
from ster_dist.tune.train import train
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.tiny_models import make_tiny
from tests.tune_checks import relative as _rel
from tests.tune_checks import run_cli as _cli
from tests.tune_checks import write_jsonl as _jsonl

# the planted preference: whatever the question, the chosen answer is the same three words
PLANTED = [
    {
        "prompt": f"question {i} about the weather",
        "chosen": "yes it is",
        "rejected": f"answer {i * 7} is sunny",
    }
    for i in range(4)
]
ALL = ("query", "key", "value", "output", "gate", "up", "down")
IDS = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
pytestmark = pytest.mark.filterwarnings("ignore:Unexpected keyword arguments:UserWarning")


def _settings(**extra) -> TrainSettings:
    s = {
        "rank": 4,
        "alpha": 8,
        "targets": ALL,
        "layers": (),
        "epochs": 1,
        "learning_rate": 1e-2,
        "seed": 0,
        "batch_size": 4,
    }
    return TrainSettings(**{**s, **extra})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preference")
    make_tiny("llama", root / "base")
    _jsonl(root / "planted.jsonl", PLANTED)
    return root


@pytest.fixture(scope="module")
def runs(llama):
    """Each command once on the planted pairs, in this process (one rank): name -> report."""
    import contextlib
    import io

    out = {}
    for name, command, extra in (
        ("dpo", "dpo", ()),
        ("ipo", "dpo", ("--loss", "ipo", "--beta", "0.5")),
        ("reward", "reward", ()),
    ):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(
                [
                    "tune",
                    command,
                    "--model",
                    str(llama / "base"),
                    "--pairs",
                    str(llama / "planted.jsonl"),
                    "--output",
                    str(llama / name),
                    "--learning-rate",
                    "1e-2",
                    "--epochs",
                    "3",
                    "--seed",
                    "0",
                    "--batch-size",
                    "2",
                    *extra,
                ]
            )
        assert code == 0, stderr.getvalue()
        out[name] = json.loads(stdout.getvalue())
    return out


# ---- the identities of the first step, and a planted preference learned
# ----------------------------


def test_first_losses_are_each_objectives_identity(runs):
    assert runs["dpo"]["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert runs["ipo"]["first_loss"] == pytest.approx(1 / (4 * 0.5**2), abs=1e-6)
    assert runs["reward"]["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    for report in runs.values():  # pi == ref (B at zero) and every reward zero (the head at zero)
        assert report["first_reward_margin"] == 0 and report["first_reward_accuracy"] == 0


@pytest.mark.parametrize("beta", [0.05, 2.0])
def test_ipo_starts_at_its_own_value_for_any_beta(llama, beta):
    plan, _ = prepare_pairs(
        str(llama / "base"),
        str(llama / "planted.jsonl"),
        _settings(),
        DirectPreference("ipo", beta),
    )
    out = train(LocalGroup(), plan)
    # pi == ref up to f32 rounding: the policy's read (with gradients) and the reference's (without)
    # may take
    # kernels that round the last bit apart (seen on an AVX-512 CPU), which moves the margin by
    # about 3e-7
    assert out["losses"][0] == pytest.approx(1 / (4 * beta**2), rel=1e-6, abs=1e-6)


def test_the_planted_preference_is_learned(runs):
    for name, report in runs.items():
        assert report["objective"] == ("ipo" if name == "ipo" else name)
        assert report["final_loss"] < report["first_loss"] - 0.1, name
        assert report["epoch_losses"][-1] < report["epoch_losses"][0], name
        assert report["final_reward_accuracy"] == 1.0 and report["final_reward_margin"] > 0, name
        for key in (
            "model",
            "model_revision",
            "rank",
            "alpha",
            "targets",
            "layers",
            "pairs",
            "steps",
            "precision",
            "chat_template",
            "files",
            "seconds",
            "dp",
            "tp",
            "zero_stage",
        ):
            assert key in report, (name, key)
        assert report["pairs"] == len(PLANTED) and report["steps"] == 6
    assert (
        runs["dpo"]["beta"] == 0.1 and runs["ipo"]["beta"] == 0.5 and "beta" not in runs["reward"]
    )


# ---- what is written ----------------------------------------------------------------------------


def test_the_dpo_adapter_loads_in_peft_with_the_attached_logits_and_generates(llama, runs, capsys):
    import transformers
    from peft import PeftModel

    from ster_dist.adapters.attach import attach
    from ster_dist.adapters.format import open_adapter
    from ster_dist.adapters.targets import sites_for
    from ster_dist.resolve import resolve
    from tests.cli_run import cli_generate

    adapter = llama / "dpo"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (
        config["kind"] == "adapter"
        and config["task_type"] == "CAUSAL_LM"
        and config["modules_to_save"] is None
    )
    assert config["train"]["objective"] == "dpo"
    peft_model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama / "base"), adapter
    )
    with torch.no_grad():
        expected = peft_model.eval()(IDS).logits
    loaded = load_model(resolve(str(llama / "base")))
    with torch.no_grad():
        detach = attach(
            loaded.model, sites_for(open_adapter(adapter), loaded.cfg, str(llama / "base"))
        )
        attached = loaded.model(IDS)
        detach()
    assert _rel(attached, expected) < 1e-5
    # a generation adapter: `ster generate --adapter` takes it, and it changes what is generated
    common = (
        "--model",
        str(llama / "base"),
        "--prompt",
        PLANTED[0]["prompt"],
        "--max-new-tokens",
        "8",
    )
    code, tuned, err = _cli(capsys, "generate", *common, "--adapter", str(adapter))
    assert code == 0, err
    assert tuned["text"] != cli_generate(*common)["text"]


def test_the_reward_model_loads_in_peft_as_sequence_classification(llama, runs):
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    adapter = llama / "reward"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (
        config["kind"] == "reward"
        and config["task_type"] == "SEQ_CLS"
        and config["modules_to_save"] == ["score"]
    )
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert tensors["base_model.model.score.weight"].shape == (1, 48)
    # our rewards: the trained factors attached to our decoder, the written head over its last
    # hidden state
    plan, _ = prepare_pairs(
        str(llama / "base"),
        str(llama / "planted.jsonl"),
        _settings(targets=("query", "key", "value", "output")),
        RewardModel(),
    )
    loaded = load_model(plan.checkpoint)
    factors = LoraFactors(plan.sites, 8, 0)
    factors.load_state_dict(_factors_of(adapter, plan.sites))
    trained_on = Attached(loaded.model, factors, plan.sites, 2.0, TrainCtx())
    sequences = [e for p in plan.examples for e in (p.chosen, p.rejected)]
    with torch.no_grad():
        trained_on.refresh()
        ours = rewards(
            loaded.model, tensors["base_model.model.score.weight"], *collate_whole(sequences, 0)
        )
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        llama / "base", num_labels=1
    )
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        expected = torch.stack(
            [peft_model(input_ids=torch.tensor([e.ids])).logits[0, 0] for e in sequences]
        )
    assert _rel(ours, expected) < 1e-5
    assert (ours[0::2] > ours[1::2]).all()  # every chosen completion outscores its rejected one


def _factors_of(adapter: Path, sites) -> dict[str, torch.Tensor]:
    """The run's "a.i" / "b.j" factors back from the PEFT file (every module here is one site's)."""
    from safetensors.torch import load_file

    from ster_dist.tune.lora import modules_of

    tensors = load_file(adapter / "adapter_model.safetensors")
    modules = modules_of(sites)
    out = {f"a.{i}": tensors[f"base_model.model.{m}.lora_A.weight"] for i, m in enumerate(modules)}
    out |= {
        f"b.{j}": tensors[f"base_model.model.{s.module}.lora_B.weight"] for j, s in enumerate(sites)
    }
    return out


def test_adapter_refuses_a_reward_model_for_generation(llama, runs, capsys):
    examples = llama / "examples.json"
    examples.write_text(json.dumps({"examples": [{"prompt": "p", "completion": "c"}]}))
    for command in (
        ("generate", "--prompt", "hi"),
        ("tune", "evaluate", "--examples", str(examples)),
    ):
        code, _, err = _cli(
            capsys, *command, "--model", str(llama / "base"), "--adapter", str(llama / "reward")
        )
        assert (
            code == 2 and "adapter artifact is a reward model, not a generation adapter" in err
        ), err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---- gradients across ranks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    with SpawnGroup(2) as group:
        yield group


def _close(got: dict, want: dict, tolerance: float) -> None:
    assert set(got) == set(want)
    scale = max(t.abs().max() for t in want.values())
    worst = max((got[k] - want[k]).abs().max() for k in want) / scale
    assert worst < tolerance, worst


def _gradient_runs(llama: Path, objective, groups) -> None:
    """One step's gradients (and its factors after AdamW) on each (group, settings) equal one
    rank's."""
    # B and the head away from zero: no first gradient is zero
    start = {"b_init_std": 0.1, "head_init_std": 0.1}

    def run(group, **extra):
        plan, _ = prepare_pairs(
            str(llama / "base"),
            str(llama / "planted.jsonl"),
            _settings(**start, **extra),
            objective,
        )
        return train(group, plan, gradients_at=0)

    reference = run(LocalGroup())
    assert all(g.abs().max() > 0 for g in reference["gradients"].values())
    assert ("score.weight" in reference["gradients"]) == isinstance(objective, RewardModel)
    for group, extra in groups:
        got = run(group, **extra)
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        _close(got["gradients"], reference["gradients"], 1e-5)
        # one AdamW step from the same gradients; its first step moves each element by lr * g / (|g|
        # + 1e-8),
        # so an element whose gradient is rounding-sized (near eps) is left out
        kept = {k: g.abs() > 1e-6 for k, g in reference["gradients"].items()}
        _close(
            {k: v[kept[k]] for k, v in got["factors"].items()},
            {k: v[kept[k]] for k, v in reference["factors"].items()},
            1e-4,
        )


@pytest.mark.parametrize(
    "objective", [DirectPreference("dpo", 0.1), RewardModel()], ids=["dpo", "reward"]
)
def test_gradients_at_tp2_equal_tp1(llama, pair, objective):
    _gradient_runs(llama, objective, [(pair, {"tp": 2})])


@pytest.mark.slow
@pytest.mark.parametrize(
    "objective",
    [DirectPreference("dpo", 0.1), DirectPreference("ipo", 0.5), RewardModel()],
    ids=["dpo", "ipo", "reward"],
)
def test_gradients_at_dp2_and_ipo_at_tp2_equal_tp1(llama, pair, objective):
    groups = [
        (pair, {"dp": 2, "batch_size": 2}),
        (LocalGroup(), {"batch_size": 2, "accumulation": 2}),
    ]
    if objective.name == "ipo":
        groups.append((pair, {"tp": 2}))
    _gradient_runs(llama, objective, groups)


# ---- refusals, all before a weight is read
# --------------------------------------------------------


@pytest.fixture(scope="module")
def unreadable(llama, tmp_path_factory) -> Path:
    """The base with weights that cannot be read: a refusal naming its own problem came before any
    read."""
    import shutil

    directory = tmp_path_factory.mktemp("unreadable") / "base"
    shutil.copytree(llama / "base", directory)
    for path in directory.glob("*.safetensors"):
        path.write_bytes(b"not a safetensors file")
    return directory


GOOD = {"prompt": "p", "chosen": "yes", "rejected": "no"}


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"prompt": "p", "rejected": "no"}], "line 1 has no chosen text"),
        ([GOOD, {"prompt": "p", "chosen": "yes", "rejected": "  "}], "line 2 has no rejected text"),
        ([{"chosen": "yes", "rejected": "no"}], "line 1 has no prompt text"),
        ([{**GOOD, "rejected": "yes"}], "line 1: chosen and rejected are the same text"),
        (["{not json"], "line 1 is not JSON"),
        (["[1, 2]"], "line 1 is not an object"),
        ([{**GOOD, "system": 3}], "line 1: system must be text"),
        ([], "holds no pairs"),
    ],
)
@pytest.mark.parametrize("command", ["dpo", "reward"])
def test_bad_pairs_are_refused_by_line(unreadable, tmp_path, capsys, rows, message, command):
    pairs = _jsonl(tmp_path / "pairs.jsonl", rows)
    code, _, err = _cli(
        capsys,
        "tune",
        command,
        "--model",
        str(unreadable),
        "--pairs",
        str(pairs),
        "--output",
        str(tmp_path / "out"),
        "--learning-rate",
        "1e-3",
        "--epochs",
        "1",
        "--seed",
        "0",
    )
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command,extra,message",
    [
        ("dpo", ("--beta", "0"), "--beta must be a positive number"),
        ("dpo", ("--beta", "-1"), "--beta must be a positive number"),
        ("dpo", ("--loss", "kto"), "--loss"),
        ("reward", ("--beta", "0.1"), "--beta"),
        ("reward", ("--targets", "q,banana"), "unknown adapter target 'banana'"),
        ("dpo", ("--zero", "3"), "--zero 3"),
    ],
)
def test_bad_settings_are_refused(unreadable, llama, tmp_path, capsys, command, extra, message):
    code, _, err = _cli(
        capsys,
        "tune",
        command,
        "--model",
        str(unreadable),
        "--pairs",
        str(llama / "planted.jsonl"),
        "--output",
        str(tmp_path / "out"),
        "--learning-rate",
        "1e-3",
        "--epochs",
        "1",
        "--seed",
        "0",
        *extra,
    )
    assert code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["dpo", "reward"])
def test_a_pair_past_max_sequence_is_refused_not_cut(llama, tmp_path, capsys, command):
    """Tokens are counted once the tokenizer has encoded the pairs, still before any rank starts."""
    long = _jsonl(tmp_path / "long.jsonl", [GOOD, {**GOOD, "chosen": "yes " * 200}])
    for pairs, extra, message in (
        (long, (), "pair on line 2 is"),
        (llama / "planted.jsonl", ("--max-sequence", "8"), "past --max-sequence 8"),
    ):
        code, _, err = _cli(
            capsys,
            "tune",
            command,
            "--model",
            str(llama / "base"),
            "--pairs",
            str(pairs),
            "--output",
            str(tmp_path / "out"),
            "--learning-rate",
            "1e-3",
            "--epochs",
            "1",
            "--seed",
            "0",
            *extra,
        )
        assert code == 2 and message in err and "a preference pair is never cut" in err, err
        assert (
            "Traceback" not in err and "training [" not in err and not (tmp_path / "out").exists()
        )


@pytest.mark.parametrize("command", ["dpo", "reward"])
def test_numbers_without_defaults_and_an_existing_output_are_refused(
    unreadable, llama, tmp_path, capsys, command
):
    common = (
        "tune",
        command,
        "--model",
        str(unreadable),
        "--pairs",
        str(llama / "planted.jsonl"),
        "--output",
    )
    code, _, err = _cli(capsys, *common, str(tmp_path / "out"), "--epochs", "1", "--seed", "0")
    assert code == 2 and "--learning-rate is required and has no default" in err
    (tmp_path / "there").mkdir()
    code, _, err = _cli(
        capsys,
        *common,
        str(tmp_path / "there"),
        "--learning-rate",
        "1e-3",
        "--epochs",
        "1",
        "--seed",
        "0",
    )
    assert code == 2 and "already exists" in err and "training [" not in err

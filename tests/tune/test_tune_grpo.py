"""`ster tune grpo`: group-relative policy optimisation on the shared training loop, completions
sampled on the ranks from the policy being trained.

On a tiny llama planted to stop early (its end-of-sequence row of the head pushed along the mean
final hidden state, so many completions end well before --max-new-tokens): the first step's loss is
exactly zero and its KL zero (B starts at zero, so policy and reference agree bit for bit); the mean
`length` reward rises over a few steps; one step's gradients at TP=2 equal TP=1's on real gloo ranks
for the same seeded sampled batch; the adapter loads in PEFT with the logits the runtime attach
gives; a reward model from
`ster tune reward` scores completions as PEFT's sequence-classification model scores them and drives
a run; every refusal comes before a weight is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# as tests/tune/test_tune.py
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

from ster_dist.load import load_model
from ster_dist.tune.lora import Attached, LoraFactors
from ster_dist.tune.parallel import TrainCtx
from ster_dist.tune.prepare import prepare_prompts
from ster_dist.tune.rollout import model_rewards, open_reward, reward_config
from ster_dist.tune.spec import TrainSettings
from ster_dist.tune.train import train
from ster_dist.workers.group import LocalGroup
from tests.tiny_models import make_tiny
from tests.tune_checks import grpo_argv
from tests.tune_checks import plant_early_stops as _plant_early_stops
from tests.tune_checks import quiet_cli as _quiet_cli
from tests.tune_checks import relative as _rel
from tests.tune_checks import run_cli as _cli
from tests.tune_checks import write_jsonl as _jsonl

PROMPTS = [{"prompt": f"question {i} about the weather"} for i in range(4)]
PAIRS = [
    {"prompt": f"question {i}", "chosen": "yes it is", "rejected": f"answer {i * 7}"}
    for i in range(2)
]
ALL = ("query", "key", "value", "output", "gate", "up", "down")
EOS = 2  # tests/tiny_models.py's eos_token_id
IDS = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
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
    root = tmp_path_factory.mktemp("grpo")
    _plant_early_stops(make_tiny("llama", root / "base"), root / "base")
    _jsonl(root / "prompts.jsonl", PROMPTS)
    _jsonl(root / "pairs.jsonl", PAIRS)
    return root


def _train_argv(llama: Path, output: str, *extra) -> list[str]:
    # 1e-2, not higher: once every completion of a step runs to --max-new-tokens the advantages are
    # all zero and
    # only the KL's small gradient is left, which Adam still turns into a full-sized step; at 3e-2
    # such a step
    # could throw the policy to stopping at once, depending on the draws
    return grpo_argv(
        llama, llama / output, "--learning-rate", "1e-2", "--max-new-tokens", "8", *extra
    )


@pytest.fixture(scope="module")
def run(llama) -> dict:
    return _quiet_cli(
        *_train_argv(llama, "length", "--epochs", "4", "--targets", "q,k,v,o,gate,up,down")
    )


# ---- the identity check, and a planted reward learned
# ----------------------------------------------


def test_the_first_step_is_the_identity(run):
    # exactly: B at zero, policy == reference
    assert run["first_loss"] == 0.0 and run["first_kl"] == 0.0
    assert run["objective"] == "grpo" and run["reward"] == "length" and run["beta"] == 0.04


def test_the_length_reward_rises(run):
    assert run["first_reward"] < 7  # the planted base stops early
    assert run["final_reward"] > run["first_reward"] + 0.5
    assert run["final_completion_length"] > run["first_completion_length"]
    assert run["final_kl"] > 0  # the policy has left the reference
    for key in (
        "model",
        "model_revision",
        "rank",
        "alpha",
        "targets",
        "layers",
        "prompts",
        "group_size",
        "steps",
        "max_new_tokens",
        "temperature",
        "precision",
        "chat_template",
        "files",
        "seconds",
        "dp",
        "tp",
        "zero_stage",
        "epoch_losses",
    ):
        assert key in run, key
    assert run["prompts"] == len(PROMPTS) and run["steps"] == 4


def test_the_adapter_loads_in_peft_with_the_attached_logits(llama, run):
    import transformers
    from peft import PeftModel

    from ster_dist.adapters.attach import attach
    from ster_dist.adapters.format import open_adapter
    from ster_dist.adapters.targets import sites_for
    from ster_dist.resolve import resolve

    adapter = llama / "length"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["kind"] == "adapter" and config["task_type"] == "CAUSAL_LM"
    assert config["train"]["objective"] == "grpo"
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


# ---- a reward model as the reward ---------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model(llama) -> Path:
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


def test_a_reward_model_scores_as_peft_and_drives_a_run(llama, reward_model):
    import transformers
    from peft import PeftModel

    plan, _ = prepare_prompts(
        str(llama / "base"),
        str(llama / "prompts.jsonl"),
        _settings(),
        {**ROLLOUT, "reward": str(reward_model)},
    )
    loaded = load_model(plan.checkpoint)
    policy = Attached(loaded.model, LoraFactors(plan.sites, 4, 0), plan.sites, 2.0, TrainCtx())
    sequences = [list(p.ids) + [40 + i, 50, EOS] for i, p in enumerate(plan.examples)]
    artifact = open_reward(
        str(reward_model),
        reward_config(str(reward_model)),
        loaded.cfg,
        plan.checkpoint,
        str(llama / "base"),
    )
    ours = torch.tensor(model_rewards(loaded.model, TrainCtx(), artifact, policy, sequences, 0))
    base = transformers.AutoModelForSequenceClassification.from_pretrained(
        llama / "base", num_labels=1
    )
    peft_model = PeftModel.from_pretrained(base, reward_model).eval()
    with torch.no_grad():
        expected = torch.stack(
            [peft_model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences]
        )
    assert _rel(ours, expected) < 1e-5
    report = _quiet_cli(
        *_train_argv(llama, "scored", "--epochs", "1", "--reward", str(reward_model))
    )
    assert report["first_loss"] == 0.0 and report["reward"] == str(reward_model)


# ---- gradients across ranks ---------------------------------------------------------------------


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


def test_gradients_at_tp2_equal_tp1(llama, tp2):
    """The same seeded groups are sampled at TP=2 (the rewards and lengths agree) and give the same
    gradients."""

    def step(group, **extra):
        # B away from zero: every factor has a gradient, and the KL term is not zero
        plan, _ = prepare_prompts(
            str(llama / "base"),
            str(llama / "prompts.jsonl"),
            _settings(b_init_std=0.1, **extra),
            ROLLOUT,
        )
        plan.steps = plan.steps[:1]
        return train(group, plan, gradients_at=0)

    reference = step(LocalGroup())
    assert all(g.abs().max() > 0 for g in reference["gradients"].values())
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


def _refused(capsys, model: Path, prompts: Path, output: Path, *extra) -> str:
    code, _, err = _cli(
        capsys,
        "tune",
        "grpo",
        "--model",
        str(model),
        "--prompts",
        str(prompts),
        "--output",
        str(output),
        "--learning-rate",
        "1e-3",
        "--epochs",
        "1",
        "--seed",
        "0",
        *extra,
    )
    said = [
        line for line in err.strip().splitlines() if not line.startswith('{"event": "progress"')
    ]
    assert code == 2 and "Traceback" not in err and len(said) == 1, err
    assert not output.exists()
    return err


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"system": "s"}], "line 1 has no prompt text"),
        ([{"prompt": "p"}, {"prompt": "  "}], "line 2 has no prompt text"),
        (["{not json"], "line 1 is not JSON"),
        (["[1, 2]"], "line 1 is not an object"),
        ([{"prompt": "p", "system": 3}], "line 1: system must be text"),
        ([], "holds no prompts"),
    ],
)
def test_bad_prompts_are_refused_by_line(unreadable, tmp_path, capsys, rows, message):
    err = _refused(capsys, unreadable, _jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "out")
    assert message in err


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--turns", "2"), "--turns 2 needs --user-model"),
        (("--user-model", "other"), "--turns 1 has none"),
        (("--rollout-tp", "2"), "pass --rollout engine with it"),
        (("--group-size", "1"), "--group-size must be at least 2"),
        (("--temperature", "0"), "--temperature must be positive"),
        (("--max-new-tokens", "0"), "--max-new-tokens must be at least 1"),
        (("--beta", "-1"), "--beta must be zero (no KL) or positive"),
        (("--targets", "q,banana"), "unknown adapter target 'banana'"),
        (("--zero", "3"), "--zero 3"),
        (("--reward", "/no/such/dir"), "is neither `length` nor a reward model directory"),
    ],
)
def test_bad_settings_are_refused(unreadable, llama, tmp_path, capsys, extra, message):
    err = _refused(capsys, unreadable, llama / "prompts.jsonl", tmp_path / "out", *extra)
    assert message in err


def test_a_generation_adapter_or_another_models_reward_is_refused_as_the_reward(
    unreadable, llama, run, tmp_path, capsys
):
    err = _refused(
        capsys,
        unreadable,
        llama / "prompts.jsonl",
        tmp_path / "out",
        "--reward",
        str(llama / "length"),
    )
    assert "is not a reward model (its kind is 'adapter')" in err
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((llama / "length" / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(
        json.dumps({**config, "kind": "reward", "hidden_size": 7})
    )
    # the model's config and headers are read first: the real base, refused before a rank starts
    err = _refused(
        capsys, llama / "base", llama / "prompts.jsonl", tmp_path / "out", "--reward", str(other)
    )
    assert "train a reward model on this base" in err and "training [" not in err


def test_a_prompt_past_max_sequence_is_refused(llama, tmp_path, capsys):
    """Tokens are counted once the tokenizer has encoded the prompts, still before any rank
    starts."""
    err = _refused(
        capsys, llama / "base", llama / "prompts.jsonl", tmp_path / "out", "--max-sequence", "20"
    )
    assert "with --max-new-tokens 16 passes --max-sequence 20" in err and "training [" not in err


def test_numbers_without_defaults_and_an_existing_output_are_refused(
    unreadable, llama, tmp_path, capsys
):
    common = (
        "tune",
        "grpo",
        "--model",
        str(unreadable),
        "--prompts",
        str(llama / "prompts.jsonl"),
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

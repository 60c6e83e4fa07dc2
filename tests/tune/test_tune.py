"""`ster tune`: LoRA training across ranks with DeepSpeed, against PEFT and Transformers.

On a tiny llama the loss falls on a memorisation set and `ster generate --adapter` then answers with
the trained completions; the same seed writes the same bytes; one step's factor gradients at TP=2,
at
--dp 2 (ZeRO 1 and 2) and with accumulation equal TP=1's on real gloo ranks; the written adapter
loads in PEFT with the logits the runtime attach gives (fused and Conv1D layouts included) and
merges;
`ster tune evaluate` equals a direct Transformers + PEFT loss; every refusal comes before a weight
is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# DeepSpeed JIT-builds ops under TORCH_EXTENSIONS_DIR; keep any build inside the workspace (set
# before the
# ranks are spawned, so they inherit it). Training marks its one CPU op unneeded, so nothing should
# build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))

from ster_dist.adapters.attach import attach
from ster_dist.adapters.format import open_adapter
from ster_dist.adapters.targets import sites_for
from ster_dist.cli import main
from ster_dist.load import load_model
from ster_dist.resolve import resolve
from ster_dist.tune.lora import Attached, LoraFactors
from ster_dist.tune.parallel import TrainCtx
from ster_dist.tune.prepare import prepare
from ster_dist.tune.spec import TrainSettings
from ster_dist.tune.train import train
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.spawn import SpawnGroup
from tests.tiny_models import make_tiny
from tests.tiny_tokenizer import build_tiny_tokenizer

MEMORISE = [
    {"prompt": "What is the capital of France?", "completion": "Paris is the capital."},
    {"prompt": "Say hello", "completion": "hello, world"},
]
VARIED = [
    {"prompt": f"question {i} about the weather", "completion": f"answer {i * 7} is sunny"}
    for i in range(4)
]
ALL = ("query", "key", "value", "output", "gate", "up", "down")
IDS = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))
SHM = Path("/dev/shm")
# adapter_config.json carries Ster's sidecar fields, which PEFT ignores with this warning
pytestmark = pytest.mark.filterwarnings("ignore:Unexpected keyword arguments:UserWarning")


def _shm() -> set[str]:
    return {p.name for p in SHM.glob("deepspeed_*")} if SHM.is_dir() else set()


@pytest.fixture(scope="module", autouse=True)
def no_shared_memory_left():
    """DeepSpeed's CPU all-reduce op would leave ~66 MB per rank in /dev/shm: training never builds
    it."""
    before = _shm()
    yield
    left = _shm() - before
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    assert not left, f"training left {sorted(left)} in /dev/shm"


def _examples(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"examples": rows}))
    return path


def _cli(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, (json.loads(captured.out) if code == 0 else None), captured.err


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tune")
    make_tiny("llama", root / "base")
    _examples(root / "memorise.json", MEMORISE)
    _examples(root / "varied.json", VARIED)
    return root


@pytest.fixture(scope="module")
def trained(llama):
    """`ster tune sft` on the memorisation set, in this process (one rank): (adapter directory,
    report, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(
            [
                "tune",
                "sft",
                "--model",
                str(llama / "base"),
                "--examples",
                str(llama / "memorise.json"),
                "--output",
                str(llama / "adapter"),
                "--learning-rate",
                "1e-2",
                "--epochs",
                "60",
                "--seed",
                "0",
                "--targets",
                "q,k,v,o,gate,up,down",
                "--batch-size",
                "2",
            ]
        )
    assert code == 0, err.getvalue()
    return llama / "adapter", json.loads(out.getvalue()), err.getvalue()


# ---- examples ----------------------------------------------------------------------------------


def test_examples_are_encoded_as_generation_encodes_prompts(llama):
    from ster_dist.errors import Refusal
    from ster_dist.tokenizer import Tokenizer
    from ster_dist.tune.data import IGNORE, collate, encode_examples

    tokenizer = Tokenizer.from_directory(llama / "base")
    examples, truncated = encode_examples(tokenizer, MEMORISE, "auto", None, (2,), 128)
    assert truncated == 0
    for row, example in zip(MEMORISE, examples):
        # what `ster generate` feeds the model
        prompt = tokenizer.prompt_ids(row["prompt"], None, "auto")
        completion = tokenizer.encode(row["completion"], add_special_tokens=False)
        assert example.ids == tuple(prompt + completion + [tokenizer.eos_token_id])
        assert example.prompt_tokens == len(prompt)
    inputs, valid, targets = collate(examples, 0)
    for row, example in enumerate(examples):
        n, p = len(example.ids) - 1, example.prompt_tokens
        assert inputs[row, :n].tolist() == list(example.ids[:-1]) and valid[row].sum() == n
        assert (targets[row, : p - 1] == IGNORE).all() and (targets[row, n:] == IGNORE).all()
        # only completion tokens carry loss
        assert targets[row, p - 1 : n].tolist() == list(example.ids[p:])
    plain, _ = encode_examples(tokenizer, MEMORISE[:1], "off", None, (2,), 128)
    assert plain[0].ids[: plain[0].prompt_tokens] == tuple(tokenizer.encode(MEMORISE[0]["prompt"]))
    short = len(examples[0].ids) - 2
    cut, truncated = encode_examples(tokenizer, MEMORISE[:1], "auto", None, (2,), short)
    assert truncated == 1 and cut[0].ids == examples[0].ids[:short]
    with pytest.raises(Refusal, match="leaving no completion token within --max-sequence"):
        encode_examples(tokenizer, MEMORISE[:1], "auto", None, (2,), examples[0].prompt_tokens)
    with pytest.raises(Refusal, match="needs a chat template"):
        encode_examples(tokenizer, MEMORISE[:1], "off", "be brief", (2,), 128)


# ---- training, generation, determinism ---------------------------------------------------------


def test_loss_falls_and_generation_reproduces_the_completions(llama, trained, capsys):
    adapter, report, err = trained
    for key in (
        "model",
        "model_revision",
        "rank",
        "alpha",
        "targets",
        "layers",
        "examples",
        "steps",
        "final_loss",
        "precision",
        "chat_template",
    ):
        assert key in report
    assert (
        report["targets"] == list(ALL) and report["layers"] == [0, 1, 2] and report["steps"] == 60
    )
    assert (
        report["chat_template"] == "applied"
        and report["precision"] == "f32"
        and report["examples"] == 2
    )
    assert report["final_loss"] < report["first_loss"] - 0.5
    assert (
        report["epoch_losses"][-1]
        < report["epoch_losses"][len(report["epoch_losses"]) // 2]
        < report["epoch_losses"][0]
    )
    assert '"loss"' in err and "training [" in err  # the progress bar with the loss, on stderr
    for row in MEMORISE:
        common = [
            "generate",
            "--model",
            str(llama / "base"),
            "--prompt",
            row["prompt"],
            "--max-new-tokens",
            "16",
        ]
        code, tuned, _ = _cli(capsys, *common, "--adapter", str(adapter))
        assert code == 0 and tuned["text"] == row["completion"] and tuned["finish_reason"] == "stop"
        code, plain, _ = _cli(capsys, *common)
        assert code == 0 and plain["text"] != row["completion"]


def test_the_same_seed_writes_the_same_adapter(llama, capsys):
    def run(name: str, seed: int) -> bytes:
        code, report, err = _cli(
            capsys,
            "tune",
            "sft",
            "--model",
            str(llama / "base"),
            "--examples",
            str(llama / "varied.json"),
            "--output",
            str(llama / name),
            "--learning-rate",
            "5e-2",
            "--epochs",
            "2",
            "--seed",
            str(seed),
            "--batch-size",
            "2",
            "--rank",
            "4",
        )
        assert code == 0 and report["steps"] == 4 and report["seed"] == seed, err
        return (llama / name / "adapter_model.safetensors").read_bytes()

    first, again, other = run("seed0-a", 0), run("seed0-b", 0), run("seed1", 1)
    assert first == again
    assert first != other


def test_bf16_under_zero_1_trains_and_writes_f32_factors(llama):
    settings = TrainSettings(
        rank=4,
        alpha=8,
        targets=("query", "value"),
        layers=(),
        epochs=2,
        learning_rate=5e-2,
        seed=0,
        batch_size=2,
        precision="bf16",
        zero_stage=1,
    )
    plan, header = prepare(str(llama / "base"), str(llama / "varied.json"), settings)
    assert header["precision"] == "bf16" and header["zero_stage"] == 1
    out = train(LocalGroup(), plan)
    assert out["losses"][-1] < out["losses"][0]
    assert all(torch.isfinite(torch.tensor(out["losses"])))
    assert all(
        t.dtype == torch.float32 and torch.isfinite(t).all() for t in out["factors"].values()
    )
    assert any(t.abs().max() > 0 for name, t in out["factors"].items() if name.startswith("b."))


# ---- gradients across ranks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    with SpawnGroup(2) as group:
        yield group


def _gradients(base: Path, examples: Path, group, **settings) -> dict:
    s = TrainSettings(
        rank=4,
        alpha=8,
        targets=ALL,
        layers=(),
        epochs=1,
        learning_rate=1e-2,
        seed=0,
        b_init_std=0.1,
        **settings,
    )
    plan, _ = prepare(str(base), str(examples), s)
    return train(group, plan, gradients_at=0)


def _close(got: dict, want: dict, tolerance: float) -> float:
    scale = max(t.abs().max() for t in want.values())
    worst = max((got[k] - want[k]).abs().max() for k in want) / scale
    assert worst < tolerance, worst
    return worst


def test_factor_gradients_at_tp2_and_dp2_equal_tp1(llama, pair):
    base, examples = llama / "base", llama / "varied.json"
    reference = _gradients(base, examples, LocalGroup(), batch_size=4)
    # A's too: B starts non-zero
    assert all(reference["gradients"][k].abs().max() > 0 for k in reference["gradients"])
    runs = {
        "tp2": _gradients(base, examples, pair, tp=2, batch_size=4),
        "dp2 zero1": _gradients(base, examples, pair, dp=2, batch_size=2, zero_stage=1),
        "dp2 zero2 accumulation": _gradients(
            base, examples, pair, dp=2, batch_size=1, accumulation=2
        ),
        "accumulation": _gradients(base, examples, LocalGroup(), batch_size=2, accumulation=2),
    }
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-6), name
        _close(run["gradients"], reference["gradients"], 1e-5)
        _close(run["factors"], reference["factors"], 1e-4)  # one AdamW step from the same gradients
    tp2 = runs["tp2"]["ranks"]
    assert all(torch.equal(tp2[0][k], tp2[1][k]) for k in tp2[0])  # the replicas never drift apart


# ---- the written adapter -----------------------------------------------------------------------


def test_the_adapter_loads_in_peft_with_the_attached_logits_and_merges(llama, trained, tmp_path):
    import transformers
    from peft import PeftModel

    from ster_dist.adapters.merge import merge

    adapter, report, _ = trained
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and config["layers_to_transform"] is None
    assert config["target_modules"] == sorted(
        f"{p}_proj"
        for p in (
            "mlp.down",
            "mlp.gate",
            "mlp.up",
            "self_attn.k",
            "self_attn.o",
            "self_attn.q",
            "self_attn.v",
        )
    )
    assert (
        config["kind"] == "adapter"
        and config["model"] == str(llama / "base")
        and config["hidden_size"] == 48
    )
    assert config["train"]["final_loss"] == report["final_loss"]
    peft_model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama / "base"), adapter
    )
    with torch.no_grad():
        expected = peft_model.eval()(IDS).logits
    loaded = load_model(resolve(str(llama / "base")))
    opened = open_adapter(adapter)
    assert opened.format == "peft" and opened.scale == 2.0
    with torch.no_grad():
        detach = attach(loaded.model, sites_for(opened, loaded.cfg, str(llama / "base")))
        attached = loaded.model(IDS)
        detach()
        base = loaded.model(IDS)
    assert _rel(attached, expected) < 1e-5 and _rel(base, expected) > 1e-2
    merge(str(llama / "base"), str(adapter), tmp_path / "merged")
    with torch.no_grad():
        merged = load_model(resolve(str(tmp_path / "merged"))).model(IDS)
    assert _rel(merged, expected) < 1e-5


@pytest.mark.parametrize(
    "family,targets",
    [
        # parts of fused qkv_proj / gate_up_proj
        ("phi3", ("query", "value", "up")),
        # Conv1D c_attn; up/down on a plain MLP
        ("gpt2", ("query", "key", "value", "output", "up", "down")),
    ],
)
def test_fused_and_conv1d_modules_hold_what_was_trained(tmp_path, family, targets):
    import transformers
    from peft import PeftModel

    from ster_dist.tune.writer import write_adapter

    make_tiny(family, tmp_path / "base")
    _examples(tmp_path / "ex.json", VARIED[:2])
    settings = TrainSettings(
        rank=4,
        alpha=8,
        targets=targets,
        layers=(),
        epochs=2,
        learning_rate=5e-2,
        seed=0,
        b_init_std=0.1,
    )
    plan, header = prepare(
        str(tmp_path / "base"), str(tmp_path / "ex.json"), settings, layers="0,2"
    )
    out = train(LocalGroup(), plan)
    write_adapter(
        tmp_path / "adapter",
        plan.sites,
        out["factors"],
        {**header, "final_loss": out["losses"][-1]},
        header["num_layers"],
    )
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["layers_to_transform"] == [0, 2] and config["fan_in_fan_out"] == (
        family == "gpt2"
    )
    loaded = load_model(plan.checkpoint)
    factors = LoraFactors(plan.sites, 4, 0)
    factors.load_state_dict(out["factors"])
    trained_on = Attached(loaded.model, factors, plan.sites, settings.scale, TrainCtx())
    with torch.no_grad():
        trained_on.refresh()
        ours = loaded.model(IDS)
    peft_model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    )
    with torch.no_grad():
        expected = peft_model.eval()(IDS).logits
    assert _rel(ours, expected) < 1e-5


# ---- evaluate ----------------------------------------------------------------------------------


def _reference_losses(base: Path, adapter: Path | None, rows: list[dict]) -> tuple[float, float]:
    """(token-weighted, per-example mean) completion loss computed by Transformers (and PEFT)
    directly."""
    import transformers
    from peft import PeftModel

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    sums, counts = [], []
    for row in rows:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        completion = tokenizer.encode(row["completion"], add_special_tokens=False) + [
            tokenizer.eos_token_id
        ]
        ids = torch.tensor([prompt + completion])
        labels = ids.clone()
        labels[0, : len(prompt)] = -100
        with torch.no_grad():
            loss = model.eval()(input_ids=ids, labels=labels).loss.item()
        sums.append(loss * len(completion))
        counts.append(len(completion))
    return sum(sums) / sum(counts), sum(s / c for s, c in zip(sums, counts)) / len(rows)


def test_evaluate_equals_transformers_and_peft(llama, trained, capsys):
    import math

    adapter, _, _ = trained
    rows = MEMORISE + VARIED
    _examples(llama / "all.json", rows)
    for with_adapter in (True, False):
        extra = ["--adapter", str(adapter)] if with_adapter else []
        code, out, err = _cli(
            capsys,
            "tune",
            "evaluate",
            "--model",
            str(llama / "base"),
            "--examples",
            str(llama / "all.json"),
            "--batch-size",
            "4",
            *extra,
        )
        assert code == 0, err
        token_loss, example_loss = _reference_losses(
            llama / "base", adapter if with_adapter else None, rows
        )
        assert out["loss"] == pytest.approx(token_loss, rel=1e-5)
        assert out["per_example_loss"] == pytest.approx(example_loss, rel=1e-5)
        assert out["perplexity"] == pytest.approx(math.exp(token_loss), rel=1e-5)
        assert out["examples"] == len(rows) and out["adapter"] == (
            str(adapter) if with_adapter else None
        )
    assert not list(llama.glob("*.tmp"))


# ---- refusals ----------------------------------------------------------------------------------


def _garbage_weights(directory: Path) -> None:
    """Weights that cannot be read: a refusal that still names its own problem came before any
    read."""
    for path in directory.glob("*.safetensors"):
        path.write_bytes(b"not a safetensors file")


def _config_only(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    build_tiny_tokenizer(directory)
    (directory / "model.safetensors").write_bytes(b"never read")
    return directory


def _sft(model: Path, examples: Path, output: Path, *extra) -> list[str]:
    argv = [
        "tune",
        "sft",
        "--model",
        str(model),
        "--examples",
        str(examples),
        "--output",
        str(output),
    ]
    numbers = {"--learning-rate": "1e-3", "--epochs": "1", "--seed": "0"}
    for flag in extra:
        if flag.startswith("-no"):
            numbers.pop(flag[3:])
    argv += [x for kv in numbers.items() for x in kv] + [
        x for x in extra if not x.startswith("-no")
    ]
    return argv


@pytest.fixture(scope="module")
def refused_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("refused")
    out = {}
    for family in ("phi", "gpt2", "gpt_neox", "starcoder2", "mixtral", "qwen3_moe"):
        make_tiny(family, root / family)
        _garbage_weights(root / family)
        out[family] = root / family
    for family in (
        "mamba",
        "jamba",
        "falcon_h1",
        "qwen3_next",
        "nanbeige",
        "nemotron-nas",
        "lfm2",
        "hrm_text",
        "deepseek_v4",
        "gemma4_text",
    ):
        out[family] = _config_only(
            root / family, {"model_type": family, "hidden_size": 48, "num_hidden_layers": 2}
        )
    return out


@pytest.mark.parametrize("family", ["phi", "gpt2", "gpt_neox", "starcoder2"])
def test_gate_is_refused_on_plain_feed_forwards(llama, refused_models, tmp_path, capsys, family):
    argv = _sft(
        refused_models[family], llama / "varied.json", tmp_path / "a", "--targets", "q,v,gate,up"
    )
    code, _, err = _cli(capsys, *argv)
    assert (
        code == 2
        and f"the {family} feed-forward is plain (no gate)" in err
        and "Traceback" not in err
    )
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("target", ["gate", "up", "down"])
def test_feed_forward_targets_are_refused_on_experts_families(
    llama, refused_models, tmp_path, capsys, family, target
):
    argv = _sft(
        refused_models[family], llama / "varied.json", tmp_path / "a", "--targets", f"q,{target}"
    )
    code, _, err = _cli(capsys, *argv)
    assert (
        code == 2
        and f"adapters on {family} sit on attention only" in err
        and f"the {target} target" in err
    )


@pytest.mark.parametrize(
    "family,reason",
    [
        ("mamba", "state-space layers"),
        ("jamba", "state-space layers"),
        ("falcon_h1", "state-space layers"),
        ("lfm2", "state-space layers"),
        ("qwen3_next", "linear-attention layers"),
        ("nanbeige", "looped model"),
        ("nemotron-nas", "one shape on every layer"),
        ("hrm_text", "several passes"),
        ("deepseek_v4", "hyper-connections"),
    ],
)
def test_refused_families_are_named(llama, refused_models, tmp_path, capsys, family, reason):
    code, _, err = _cli(
        capsys, *_sft(refused_models[family], llama / "varied.json", tmp_path / "a")
    )
    assert (
        code == 2
        and f"adapters on {family} are refused" in err
        and reason in err
        and "Traceback" not in err
    )


def test_attention_targets_are_refused_where_seeds_say(llama, refused_models, tmp_path, capsys):
    model = refused_models["gemma4_text"]
    code, _, err = _cli(
        capsys, *_sft(model, llama / "varied.json", tmp_path / "a", "--targets", "q,gate")
    )
    assert code == 2 and "the query target is refused on gemma4_text" in err


@pytest.mark.parametrize("missing", ["--learning-rate", "--epochs", "--seed"])
def test_numbers_without_defaults_are_named_when_missing(llama, tmp_path, capsys, missing):
    code, _, err = _cli(
        capsys, *_sft(llama / "base", llama / "varied.json", tmp_path / "a", f"-no{missing}")
    )
    others = {"--learning-rate", "--epochs", "--seed"} - {missing}
    assert code == 2 and f"{missing} is required and has no default" in err
    assert not any(other in err for other in others)


@pytest.mark.parametrize(
    "extra,message",
    [
        (("--targets", "q,banana"), "unknown adapter target 'banana'"),
        (("--precision", "f16"), "--precision f16 is not trainable here"),
        (("--zero", "3"), "--zero 3"),
        (("--adapter-layers", "7"), "layer 7 is outside the model's 0..2 range"),
        (("--max-sequence", "4096"), "--max-sequence 4096 is past the model's 128 positions"),
        (("--rank", "0"), "--rank must be a whole number of at least 1"),
    ],
)
def test_bad_settings_are_refused(llama, tmp_path, capsys, extra, message):
    code, _, err = _cli(
        capsys, *_sft(llama / "base", llama / "varied.json", tmp_path / "a", *extra)
    )
    assert code == 2 and message in err and "Traceback" not in err


def test_an_existing_output_is_refused_before_training(llama, tmp_path, capsys):
    (tmp_path / "a").mkdir()
    code, _, err = _cli(capsys, *_sft(llama / "base", llama / "varied.json", tmp_path / "a"))
    assert code == 2 and "already exists" in err and "training [" not in err


# ---- slow: more ranks and families, Ray ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmo2", "qwen3_moe", "llama_linear", "gemma2", "gpt2"])
def test_gradients_at_tp2_equal_tp1_across_families(tmp_path, pair, family):
    """Norms over a projection split across ranks, experts, key-value heads replicated over ranks,
    soft-capping, learned positions: every collective's backward."""
    make_tiny(family, tmp_path / "base")
    examples = _examples(tmp_path / "ex.json", VARIED)
    targets = (
        ("query", "key", "value", "output")
        if family == "qwen3_moe"
        else tuple(t for t in ALL if not (family == "gpt2" and t == "gate"))
    )
    s = {
        "rank": 4,
        "alpha": 8,
        "targets": targets,
        "layers": (),
        "epochs": 1,
        "learning_rate": 1e-2,
        "seed": 0,
        "b_init_std": 0.1,
    }
    runs = []
    for group, extra in (
        (LocalGroup(), {"batch_size": 4}),
        (pair, {"tp": 2, "batch_size": 4}),
        (pair, {"dp": 2, "batch_size": 2}),
    ):
        plan, _ = prepare(str(tmp_path / "base"), str(examples), TrainSettings(**s, **extra))
        runs.append(train(group, plan, gradients_at=0))
    for run in runs[1:]:
        _close(run["gradients"], runs[0]["gradients"], 1e-5)


@pytest.mark.slow
def test_dp2_by_tp2_on_four_ranks_equals_one(llama):
    reference = _gradients(llama / "base", llama / "varied.json", LocalGroup(), batch_size=4)
    with SpawnGroup(4) as group:
        run = _gradients(llama / "base", llama / "varied.json", group, dp=2, tp=2, batch_size=2)
    _close(run["gradients"], reference["gradients"], 1e-5)


@pytest.mark.slow
def test_cli_on_ray_with_dp2_and_on_spawned_ranks_with_tp2(llama, capsys):
    def run(name, *extra):
        code, report, err = _cli(
            capsys,
            "tune",
            "sft",
            "--model",
            str(llama / "base"),
            "--examples",
            str(llama / "varied.json"),
            "--output",
            str(llama / name),
            "--learning-rate",
            "1e-2",
            "--epochs",
            "2",
            "--seed",
            "0",
            "--rank",
            "4",
            *extra,
        )
        assert code == 0, err
        return report, open_adapter(llama / name).read_factors()

    one, factors = run("one", "--batch-size", "2")
    for name, extra in (
        ("ray-dp2", ("--dp", "2", "--batch-size", "1")),
        ("spawn-tp2", ("--tp", "2", "--batch-size", "2", "--launcher", "spawn")),
    ):
        report, got = run(name, *extra)
        assert report["final_loss"] == pytest.approx(one["final_loss"], rel=1e-5)
        # Adam divides each gradient by its running RMS: a TP split's other order of sums, ~1e-7 in
        # a small
        # gradient, reaches ~2e-5 in the factors after two epochs (measured at TP=2); the loss above
        # agrees to 1e-5
        for key, (a, b) in factors.items():
            assert torch.allclose(got[key][0], a, atol=1e-4) and torch.allclose(
                got[key][1], b, atol=1e-4
            )

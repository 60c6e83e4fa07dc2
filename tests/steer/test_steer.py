"""Steering vectors: caa / pca / logistic recover a planted direction; Ster's artifact round-trips
and every refusal fires; a steered forward equals Transformers with a forward hook adding the same
vector after the same layer, strength 0 equals unsteered, TP=2 equals TP=1 on a real gloo group;
and the CLI end to end (train -> inspect -> generate --vector, optimize, evaluate)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.steer.artifact import (
    Direction,
    SteeringArtifact,
    check_for_run,
    is_steering_artifact,
    load_artifact,
    provenance_warnings,
)
from ster_dist.steer.attach import add_steering, attach
from ster_dist.steer.fit import METHODS, evaluate_direction, train_direction
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.steer.test_capture import hf_layers
from tests.tiny_models import make_tiny

PAIRS = {
    "trait_name": "calm",
    "pairs": [
        {
            "positive": "the sea is calm and quiet tonight .",
            "negative": "the storm waves crash loud against the rocks .",
        },
        {
            "positive": "the water lies still in the harbor .",
            "negative": "the wind howls hard over the dark hills .",
        },
        {
            "positive": "a gentle breeze drifts over the lake .",
            "negative": "thunder rolls loud over the harbor tonight .",
        },
        {
            "positive": "the boat rests at anchor on still water .",
            "negative": "the waves churn white foam on the boat .",
        },
        {
            "positive": "the evening air is soft and warm .",
            "negative": "the cold rain falls hard and fast .",
        },
    ],
}


# -- fitting ------------------------------------------------------------------------------------
def planted(pairs: int = 48, width: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(width, generator=g)
    direction /= direction.norm()
    # what both sides of a pair share:
    content = torch.randn(pairs, width, generator=g) * 2.0
    # topic, orthogonal to the trait
    content -= (content @ direction)[:, None] * direction
    # how much of the trait, per pair
    strength = 1.0 + 2.0 * torch.rand(pairs, 1, generator=g)
    positive = content + strength / 2 * direction + 0.05 * torch.randn(pairs, width, generator=g)
    negative = content - strength / 2 * direction + 0.05 * torch.randn(pairs, width, generator=g)
    return positive, negative, direction


@pytest.mark.parametrize("method", METHODS)
def test_each_method_recovers_a_planted_direction(method):
    positive, negative, truth = planted()
    found = train_direction(positive, negative, method)
    assert found.dtype == torch.float32 and abs(float(found.double().norm()) - 1) < 1e-6
    assert float(found @ truth) > 0.97, method
    accuracy, margin = evaluate_direction(positive, negative, found)
    assert accuracy == 1.0 and margin > 1.0
    # the sign convention: swapping the columns negates the direction
    assert torch.allclose(train_direction(negative, positive, method), -found, atol=1e-4)


def test_pca_follows_the_axis_of_variance_where_caa_follows_the_mean():
    g = torch.Generator().manual_seed(1)
    width = 16
    mean_axis, spread_axis = torch.eye(width)[0], torch.eye(width)[1]
    spread = torch.randn(40, 1, generator=g) * 3
    spread -= spread.mean()  # the spread axis carries variance and no mean
    differences = mean_axis * 1.0 + spread * spread_axis + 0.3 * mean_axis * torch.sign(spread)
    negative = torch.randn(40, width, generator=g)
    positive = negative + differences
    assert float(train_direction(positive, negative, "caa") @ mean_axis) > 0.99
    pca = train_direction(positive, negative, "pca")
    assert abs(float(pca @ spread_axis)) > 0.98 and float(pca @ (positive - negative).mean(0)) > 0


def test_fitting_refusals():
    rows = torch.randn(3, 4)
    with pytest.raises(Refusal, match="the same non-zero number of positive and negative examples"):
        train_direction(rows, rows[:2], "caa")
    with pytest.raises(Refusal, match="one finite, consistent width"):
        train_direction(rows, torch.full((3, 4), math.nan), "caa")
    with pytest.raises(Refusal, match="training produced a zero or non-finite direction"):
        train_direction(rows, rows.clone(), "caa")
    with pytest.raises(
        Refusal, match='unknown training method "ridge"; expected caa, pca, or logistic'
    ):
        train_direction(rows, rows + 1, "ridge")
    with pytest.raises(Refusal, match="direction width 3 does not match activation width 4"):
        evaluate_direction(rows, rows + 1, torch.ones(3))


# -- the artifact -------------------------------------------------------------------------------
def _artifact(model="toy", width=8, layers=(1, 2)) -> SteeringArtifact:
    g = torch.Generator().manual_seed(0)
    vectors = []
    for layer in layers:
        v = torch.randn(width, generator=g)
        vectors.append(Direction(layer, v / v.norm(), 0.875, 0.5))
    return SteeringArtifact(
        model=model,
        model_revision=None,
        trait_name="calm",
        method="caa",
        hidden_size=width,
        vectors=vectors,
        precision="f32",
        chat_template="applied",
    )


def test_artifact_round_trips_as_compact_json(tmp_path):
    artifact = _artifact()
    path = tmp_path / "sub" / "v.json"
    artifact.save(path)
    text = path.read_text()
    assert "\n" not in text and [p.name for p in path.parent.iterdir()] == ["v.json"]
    raw = json.loads(text)
    assert {k for k in raw} == {
        "schema_version",
        "product",
        "model",
        "model_revision",
        "precision",
        "chat_template",
        "trait_name",
        "method",
        "hidden_size",
        "vectors",
        "metadata",
    }
    assert list(raw["vectors"][0]) == ["layer", "values", "train_margin", "train_accuracy"]
    back = load_artifact(str(path))
    assert back.to_json() == artifact.to_json()
    for a, b in zip(back.vectors, artifact.vectors):
        assert torch.equal(a.values, b.values)
    summary = back.summary()
    assert "values" not in json.dumps(summary) and summary["layers"][0]["width"] == 8
    assert abs(summary["layers"][0]["norm"] - 1) < 1e-6
    # a Ster file written before precision and chat_template existed still reads
    for key in ("precision", "chat_template"):
        raw.pop(key)
    path.write_text(json.dumps(raw))
    old = load_artifact(str(path))
    assert old.precision is None and provenance_warnings(old, "bf16", "off", "it steers") == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d.update(schema_version=2),
            "artifact schema 2 is unsupported; this Ster build reads schema 1",
        ),
        (lambda d: d.update(product="other"), 'artifact belongs to product "other", not Ster'),
        (lambda d: d.update(vectors=[]), "artifact has no steering vectors"),
        (
            lambda d: d["vectors"][0].update(values=[0.5] * 3),
            "layer 1 has vector width 3, expected 8",
        ),
        (
            lambda d: d["vectors"][1]["values"].__setitem__(2, math.nan),
            "layer 2 contains a non-finite value",
        ),
        (
            lambda d: d.pop("hidden_size"),
            "invalid steering artifact JSON in .*missing field hidden_size",
        ),
    ],
)
def test_artifact_refusals(tmp_path, edit, message):
    data = _artifact().to_json()
    edit(data)
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    with pytest.raises(Refusal, match=message):
        load_artifact(str(path))


def test_artifact_against_a_run_refuses_another_model_width_or_depth():
    artifact = _artifact(layers=(1, 3))
    check_for_run(artifact, "toy", 8, 4)
    with pytest.raises(
        Refusal, match='artifact was trained for model "toy", current model is "other"'
    ):
        check_for_run(artifact, "other", 8, 4)
    with pytest.raises(Refusal, match='artifact model "toy" does not match runtime model "other"'):
        check_for_run(artifact, "other", 8, 4, verb="evaluate")
    with pytest.raises(Refusal, match="artifact width 8 does not match model width 16"):
        check_for_run(artifact, "toy", 16, 4)
    with pytest.raises(Refusal, match="layer 3 is outside the model's 0..2 range"):
        check_for_run(artifact, "toy", 8, 3)
    warnings = provenance_warnings(artifact, "bf16", "off", "it steers")
    assert warnings == [
        (
            "warning: this direction was trained with chat template applied and this run encodes off, so it steers a "
            "format it was not trained in"
        ),
        (
            "warning: this direction was trained at precision f32 and this run maps the base weights at bf16, so it is "
            "being read in a different space than it was fitted in"
        ),
    ]
    assert provenance_warnings(artifact, "f32", "applied", "it steers") == []


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    reference = make_tiny("llama", directory)
    return directory, reference


def test_a_lora_adapter_is_refused_as_a_vector_and_a_vector_is_recognised(llama, tmp_path):
    from peft import LoraConfig, get_peft_model

    _, reference = llama
    adapter_dir = tmp_path / "adapter"
    wrapped = get_peft_model(reference, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    wrapped.save_pretrained(adapter_dir)
    wrapped.unload()  # leave the module-scoped reference as it was
    files = sorted(p.name for p in adapter_dir.iterdir())
    assert "adapter_config.json" in files
    for target in (
        adapter_dir,
        adapter_dir / "adapter_config.json",
        adapter_dir / "adapter_model.safetensors",
    ):
        with pytest.raises(
            Refusal,
            match=r"is a LoRA adapter \(.*\), not a steering artifact: pass it as --adapter",
        ):
            load_artifact(str(target))
    sidecar = tmp_path / "sidecar.json"
    sidecar.write_text(json.dumps({"rank": 8, "targets": ["q_proj"], "layers": [0]}))
    with pytest.raises(Refusal, match="Ster adapter sidecar"):
        load_artifact(str(sidecar))
    vector = tmp_path / "v.json"
    _artifact().save(vector)
    assert is_steering_artifact(str(vector)) and not is_steering_artifact(
        str(adapter_dir / "adapter_config.json")
    )


# -- steered forward against Transformers -------------------------------------------------------
@pytest.mark.parametrize(
    "variant, layer", [("llama", 1), ("llama", 2), ("gpt2", 0), ("gemma2", 1), ("qwen3_moe", 1)]
)
def test_steered_forward_equals_transformers_with_a_forward_hook(tmp_path, variant, layer):
    reference = make_tiny(variant, tmp_path)
    ours = load_model(resolve(str(tmp_path))).model
    width = ours.cfg.hidden_size
    vector = torch.randn(width, generator=torch.Generator().manual_seed(layer))
    vector /= vector.norm()
    strength = 3.0
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))

    def shift(module, args, out):
        if isinstance(out, tuple):
            return (out[0] + strength * vector,) + out[1:]
        return out + strength * vector

    with torch.no_grad():
        plain_theirs = reference(ids).logits
        handle = hf_layers(reference)[layer].register_forward_hook(shift)
        try:
            theirs = reference(ids).logits
        finally:
            handle.remove()
        plain = ours(ids)
        removers = add_steering(ours, [(layer, vector)], strength)
        steered = ours(ids)
        for remove in removers:
            remove()
        zero = add_steering(ours, [(layer, vector)], 0.0)
        at_zero = ours(ids)
        for remove in zero:
            remove()
        after = ours(ids)
    assert compare(plain, plain_theirs)["max_relative_error"] < 1e-4
    assert compare(steered, theirs)["max_relative_error"] < 1e-4
    assert (steered - plain).abs().max() > 1e-2  # the vector did something
    assert torch.equal(at_zero, plain) and torch.equal(after, plain)


def test_steering_at_tp2_equals_tp1_for_logits_and_generation(llama):
    directory, _ = llama
    checkpoint = resolve(str(directory))
    loaded = load_model(checkpoint)
    single = loaded.model
    artifact = _artifact(model=str(directory), width=single.cfg.hidden_size, layers=(0, 2))
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    removers = add_steering(single, [(v.layer, v.values) for v in artifact.vectors], 2.5)
    with torch.no_grad():
        want_logits = single(ids)
    want_tokens = engine_tokens(loaded, prompts, 8)
    for remove in removers:
        remove()
    plain_tokens = engine_tokens(loaded, prompts, 8)
    with SpawnGroup(2) as group:
        group.call("load", checkpoint, "f32", "cpu")
        detach = attach(group, artifact, 2.5)
        logits = group.call("logits", ids)[0]
        tokens = engine_tokens(group, prompts, 8, (), checkpoint)
        detach()
        unsteered = engine_tokens(group, prompts, 8, (), checkpoint)
    assert compare(logits, want_logits)["max_relative_error"] < 1e-5
    assert tokens == want_tokens and unsteered == plain_tokens


def test_steering_a_mixture_of_experts_at_ep2_equals_one_rank(tmp_path):
    make_tiny("mixtral", tmp_path)
    checkpoint = resolve(str(tmp_path))
    single = load_model(checkpoint).model
    artifact = _artifact(model=str(tmp_path), width=single.cfg.hidden_size, layers=(1,))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(2))
    removers = add_steering(single, [(1, artifact.vectors[0].values)], -3.0)
    with torch.no_grad():
        want = single(ids)
    for remove in removers:
        remove()
    with SpawnGroup(2, ep=2) as group:
        group.call("load", checkpoint, "f32", "cpu")
        detach = attach(group, artifact, -3.0)
        got = group.call("logits", ids)[0]
        detach()
    assert compare(got, want)["max_relative_error"] < 1e-5


# -- the CLI end to end -------------------------------------------------------------------------
def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.json"
    path.write_text(json.dumps(PAIRS))
    return path


def test_train_inspect_and_generate_with_the_vector(llama, pairs_file, tmp_path, capsys):
    directory, _ = llama
    vector = tmp_path / "calm.json"
    code, out, err = run(
        capsys,
        "steer",
        "train",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--output",
        vector,
        "--layers",
        "1,2",
        "--method",
        "pca",
    )
    assert code == 0, err
    assert out["method"] == "pca" and [row["layer"] for row in out["layers"]] == [1, 2]
    assert (
        out["chat_template"] == "applied"
        and out["precision"] == "f32"
        and out["trait_name"] == "calm"
    )
    code, inspected, _ = run(capsys, "steer", "inspect", vector)
    assert code == 0 and inspected == {k: v for k, v in out.items() if k != "output"}

    artifact = load_artifact(str(vector))
    loaded = load_model(resolve(str(directory)))
    tokenizer = Tokenizer.from_directory(directory)
    ids = tokenizer.prompt_ids("hello there", None, "auto")
    removers = add_steering(loaded.model, [(v.layer, v.values) for v in artifact.vectors], 6.0)
    want = engine_tokens(loaded, [ids], 8, loaded.cfg.eos_token_ids)[0]
    for remove in removers:
        remove()
    plain = engine_tokens(loaded, [ids], 8, loaded.cfg.eos_token_ids)[0]
    assert want != plain
    code, steered, err = run(
        capsys,
        "generate",
        "--model",
        directory,
        "--prompt",
        "hello there",
        "--max-new-tokens",
        8,
        "--vector",
        vector,
        "--strength",
        6,
    )
    assert code == 0, err
    finished = bool(want) and want[-1] in loaded.cfg.eos_token_ids
    assert steered["text"] == tokenizer.decode(want[:-1] if finished else want)
    assert "warning" not in err  # fitted and read in the same format and precision

    code, _, err = run(
        capsys,
        "generate",
        "--model",
        directory,
        "--prompt",
        "hi",
        "--vector",
        vector,
        "--chat-template",
        "off",
        "--strength=-1",
    )
    assert code == 0 and "trained with chat template applied and this run encodes off" in err


def test_generate_refuses_a_vector_without_strength_or_for_another_model(
    llama, pairs_file, tmp_path, capsys
):
    directory, _ = llama
    vector = tmp_path / "calm.json"
    assert (
        main(
            [
                "steer",
                "train",
                "--model",
                str(directory),
                "--pairs",
                str(pairs_file),
                "--output",
                str(vector),
                "--layers",
                "0",
            ]
        )
        == 0
    )
    capsys.readouterr()
    code, _, err = run(
        capsys, "generate", "--model", directory, "--prompt", "hi", "--vector", vector
    )
    assert code == 2 and "--vector needs --strength" in err
    other = tmp_path / "other"
    make_tiny("qwen3", other)
    code, _, err = run(
        capsys, "generate", "--model", other, "--prompt", "hi", "--vector", vector, "--strength", 1
    )
    assert (
        code == 2
        and f'artifact was trained for model "{directory}", current model is "{other}"' in err
    )
    code, _, err = run(
        capsys,
        "steer",
        "train",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--output",
        vector,
        "--method",
        "ridge",
    )
    assert code == 2 and 'unknown training method "ridge"' in err


def test_optimize_publishes_the_ranking_and_refits_the_winner(llama, pairs_file, tmp_path, capsys):
    directory, _ = llama
    best = tmp_path / "best.json"
    code, out, err = run(
        capsys,
        "steer",
        "optimize",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--output",
        best,
        "--holdout",
        0.4,
        "--layers",
        "0..2",
    )
    assert code == 0, err
    assert "fitting each candidate on 3 pairs and ranking on a 2-pair holdout" in err
    rows = out["selection"]["candidates"]
    assert [(r["layer"], r["method"]) for r in rows] == [(l, m) for l in (0, 1) for m in METHODS]
    assert sum(r["selected"] for r in rows) == 1
    chosen = next(r for r in rows if r["selected"])
    assert all(
        (r["holdout_accuracy"], r["holdout_margin"])
        <= (chosen["holdout_accuracy"], chosen["holdout_margin"])
        for r in rows
    )
    assert out["selection"]["holdout"] == {"fraction": 0.4, "fit_pairs": 3, "holdout_pairs": 2}
    assert (
        out["metadata"]["selection"]
        == "chosen over 6 candidates on a 2-pair holdout, then refitted on all 5 pairs"
    )
    artifact = load_artifact(str(best))
    assert artifact.layers == [chosen["layer"]] and artifact.method == chosen["method"]
    for fraction, message in [
        (
            0.05,
            (
                "a held-out fraction of 0.05 over 5 contrastive pairs leaves 5 pairs to fit "
                "and 0 to rank on; both need at least one"
            ),
        ),
        (1.5, "the held-out fraction must be above zero and below one"),
    ]:
        code, _, err = run(
            capsys,
            "steer",
            "optimize",
            "--model",
            directory,
            "--pairs",
            pairs_file,
            "--output",
            tmp_path / "x.json",
            "--holdout",
            fraction,
        )
        assert code == 2 and message in err
    assert not (tmp_path / "x.json").exists()


def test_evaluate_scores_layers_and_strengths(llama, pairs_file, tmp_path, capsys):
    directory, _ = llama
    vector = tmp_path / "calm.json"
    code, trained, _ = run(
        capsys,
        "steer",
        "train",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--output",
        vector,
        "--layers",
        "1",
    )
    assert code == 0
    code, out, err = run(
        capsys,
        "steer",
        "evaluate",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--vector",
        vector,
        "--strengths=0,2,-2",
        "--batch-size",
        2,
        "--max-sequence",
        80,
    )
    assert code == 0, err
    assert out["layers"][0]["accuracy"] == trained["layers"][0]["train_accuracy"]
    # the same residuals read again, possibly in other batches: equal up to f32 summation order
    assert out["layers"][0]["margin"] == pytest.approx(
        trained["layers"][0]["train_margin"], rel=1e-5
    )
    report = out["strength"]
    assert report["scored_pairs"] == 5 and report["skipped_long"] == 0 and report["layers"] == [1]
    zero, plus, minus = report["candidates"]
    assert zero["ordered"] == 0.0 and zero["mean_shift"] == 0.0  # strength 0 moves nothing
    # opposite pushes
    assert plus["mean_shift"] != 0.0 and plus["mean_shift"] * minus["mean_shift"] < 0
    assert sum(c["selected"] for c in report["candidates"]) == 1
    code, _, err = run(
        capsys,
        "steer",
        "evaluate",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--vector",
        vector,
        "--strengths=1",
        "--max-sequence",
        80,
    )
    assert code == 2 and "--strengths needs --batch-size; Ster assumes none" in err
    code, _, err = run(
        capsys,
        "steer",
        "evaluate",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--vector",
        vector,
        "--strengths=1,inf",
        "--batch-size",
        2,
        "--max-sequence",
        80,
    )
    assert code == 2 and "strength selection needs finite strengths, not inf" in err
    code, out, err = run(
        capsys,
        "steer",
        "evaluate",
        "--model",
        directory,
        "--pairs",
        pairs_file,
        "--vector",
        vector,
        "--strengths=1",
        "--batch-size",
        1,
        "--max-sequence",
        12,
    )
    assert code == 2 and "every pair is longer than the 12-token sequence limit" in err

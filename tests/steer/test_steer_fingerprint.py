"""A steering vector is matched to a model by its weights fingerprint (shard/fingerprint.py, issue
60), not by the text of the path it was trained with: the same weights under another directory,
split into other files, with a rewritten config's cosmetic keys, take it; a model whose config
differs is refused by its fingerprint; a vector without a fingerprint is matched by its path as
before."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from ster_dist import ops
from ster_dist.cli import parse
from ster_dist.errors import Refusal
from ster_dist.session import Session
from ster_dist.steer.artifact import FINGERPRINT, load_artifact
from tests.cli_run import cli_generate, make_toy
from tests.steer.test_steer import PAIRS

FLAGS = (
    "--prompt",
    "the sea",
    "--max-new-tokens",
    "6",
    "--chat-template",
    "off",
    "--strength",
    "4",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    toy = make_toy(tmp_path_factory)
    root = tmp_path_factory.mktemp("fingerprint")
    (root / "pairs.json").write_text(json.dumps(PAIRS))
    vector = root / "calm.json"
    request = parse(
        [
            "steer",
            "train",
            f"--model={toy}",
            f"--pairs={root / 'pairs.json'}",
            f"--output={vector}",
            "--layers=1",
        ]
    )
    with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
        ops.steer_train(session, request)
    return toy, root, vector


def exported(toy: str, target, **config_changes):
    """The toy's weights written again as two safetensors files, its config rewritten (another
    _name_or_path and transformers_version, plus `config_changes`), its tokenizer files copied."""
    shutil.copytree(toy, target, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(f"{toy}/model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file(
        {n: tensors[n] for n in names[:half]}, str(target / "model-00001-of-00002.safetensors")
    )
    save_file(
        {n: tensors[n] for n in names[half:]}, str(target / "model-00002-of-00002.safetensors")
    )
    config = json.loads((target / "config.json").read_text())
    config.update({"_name_or_path": "exported", "transformers_version": "0.0.0", **config_changes})
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def test_a_vector_follows_its_weights_not_its_path(trained, tmp_path):
    toy, _, vector = trained
    assert load_artifact(str(vector)).metadata[FINGERPRINT].startswith("sha256:")
    want = cli_generate("--model", toy, "--vector", str(vector), *FLAGS)
    export = exported(toy, tmp_path / "export")
    assert (
        cli_generate("--model", str(export), "--vector", str(vector), *FLAGS)["text"]
        == want["text"]
    )

    other = exported(toy, tmp_path / "other", rms_norm_eps=0.5)
    refusal = r'artifact was trained for model ".*", current model is ".*other" \(weights sha256:.*, not the sha256:'
    with pytest.raises(Refusal, match=refusal):
        cli_generate("--model", str(other), "--vector", str(vector), *FLAGS)


def test_a_vector_without_a_fingerprint_is_matched_by_its_path(trained, tmp_path):
    toy, root, vector = trained
    data = json.loads(vector.read_text())
    data["metadata"] = {}
    old = root / "old.json"
    old.write_text(json.dumps(data))
    assert cli_generate("--model", f"{toy}/.", "--vector", str(old), *FLAGS)["text"]
    with pytest.raises(Refusal, match="artifact was trained for model"):
        cli_generate(
            "--model", str(exported(toy, tmp_path / "export")), "--vector", str(old), *FLAGS
        )

"""ster plan over the other things a newcomer points it at: a directory `ster gguf-import` made (its
.gguf's header read under Transformers names, each tensor at its block type's bytes as stored), and
a directory holding a published config.json alone (planned from the config, marked as an estimate).
The expected figures are computed here from the gguf package's own reader and from test_plan's
statement of the split rules, not by the plan's code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader
from gguf import GGMLQuantizationType as Q

from ster_dist.cli import main
from ster_dist.gguf import import_gguf
from tests.gguf_fixtures import write_llama
from tests.load.test_plan import (
    deepseek_tensors,
    expected_bytes,
    published,
    qwen3_moe_tensors,
    tensors_of,
)

HERE = Path(__file__).parents[1]  # tests/
CONFIGS = sorted(
    [*(HERE / "data" / "configs").glob("*.json"), *(HERE / "fixtures" / "configs").glob("*.json")]
)


def run(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, Path]:
    """(the .gguf, the directory gguf-import made of it): SmolLM2's shape of attention (9 query
    heads, 3 key-value heads) in Q4_1, as the main job's file is stored."""
    where = tmp_path_factory.mktemp("gguf")
    path = where / "smol.gguf"
    write_llama(path, hidden=288, heads=9, kv_heads=3, inter=96, layers=4, qtype=Q.Q4_1)
    import_gguf(path, where / "model")
    return path, where / "model"


def test_an_imported_gguf_is_planned_from_its_header_at_the_bytes_stored(imported, capsys):
    path, model = imported
    stored = GGUFReader(path, "r").tensors
    code, out, err = run(capsys, "plan", "--model", str(model), "--gpu-memory", "80")
    assert code == 0, err
    assert out["file_bytes"] == sum(int(t.n_bytes) for t in stored)
    types: dict[str, int] = {}
    for t in stored:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    assert out["stored_types"] == types == {"Q4_1": 4 * 7 + 1, "F32": 4 * 2 + 1}
    # one rank reads every tensor once (the head is tied to the embedding), in its blocks as stored
    assert out["ranks"][0]["read_bytes"] == out["file_bytes"]
    # and allocates every value at bf16 (the Q4_1 blocks dequantized), more than twice the stored
    # bytes
    assert out["ranks"][0]["parameter_bytes"] == 2 * sum(int(t.n_elements) for t in stored)


def test_three_key_value_heads_over_tp2_report_each_rank_and_the_largest_on_top(imported, capsys):
    _, model = imported
    code, out, err = run(capsys, "plan", "--model", str(model), "--tp", "2", "--gpu-memory", "80")
    assert code == 0, err
    head = 4 * 32 * 2 * 2  # 4 layers x head_dim 32 x (key, value) x bf16
    assert [r["kv_bytes_per_token"] for r in out["ranks"]] == [head, 2 * head]  # one head, then two
    assert out["kv_cache"]["bytes_per_token_per_rank"] == 2 * head
    assert out["kv_cache"]["largest_on_rank"] == 1
    assert out["kv_cache"]["bytes_per_token_by_rank"] == [head, 2 * head]
    # the tokens that fit are the fuller rank's: the same block ids on both ranks
    assert out["kv_tokens"] == min(r["kv_tokens"] for r in out["ranks"])


@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_a_published_config_alone_is_planned_as_an_estimate(config, tmp_path, capsys):
    model = tmp_path / config.stem
    model.mkdir()
    shutil.copy(config, model / "config.json")
    code, out, err = run(capsys, "plan", "--model", str(model), "--tp", "2", "--gpu-memory", "80")
    assert code == 0, err
    assert out["estimated"].startswith("estimated from the config")
    assert out["verdict"].endswith("(estimated from the config)")
    assert "from its config alone" in err
    ranks = out["ranks"]
    assert len(ranks) == 2 and all(r["parameter_bytes"] > 0 and r["read_bytes"] > 0 for r in ranks)
    assert out["kv_cache"]["bytes_per_token_per_rank"] == max(
        r["kv_bytes_per_token"] for r in ranks
    )


@pytest.mark.parametrize(
    "name, tensors_of_config",
    [("deepseek-v3.json", deepseek_tensors), ("qwen3-235b-a22b.json", qwen3_moe_tensors)],
)
def test_the_estimate_allocates_what_the_checkpoint_would_fill(
    name, tensors_of_config, tmp_path, capsys
):
    """Per rank, the config-alone parameter bytes equal those the split rules give over the
    published checkpoint's tensors (test_plan's statement of them), at tp 8."""
    raw = {k: v for k, v in published(name).items() if k != "quantization_config"}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    tensors = tensors_of(*tensors_of_config(raw), fp8=False)
    code, out, err = run(
        capsys, "plan", "--model", str(tmp_path / "m"), "--tp", "8", "--gpu-memory", "141"
    )
    assert code == 0, err
    for rank in out["ranks"][:2]:
        params, _ = expected_bytes(tensors, raw, 8, rank["tp_rank"], 1, 0, 2)
        assert rank["parameter_bytes"] == params, rank["rank"]


def test_fp8_weights_need_the_headers(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    shutil.copy(HERE / "data" / "configs" / "deepseek-v3.json", tmp_path / "m" / "config.json")
    code, out, err = run(
        capsys, "plan", "--model", str(tmp_path / "m"), "--tp", "8", "--weights", "fp8"
    )
    assert code != 0 and out is None
    refusal = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(refusal) == 1 and "--weights dequantize" in refusal[0]

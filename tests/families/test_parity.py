"""Every parity-checked family against Transformers on a tiny random checkpoint built here:
logits (f32 relative error and cosine), greedy generation, decoding from the cache, and
batched generation equal to one prompt at a time.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from ster_dist.families.registry import SPECS
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import engine_tokens
from tests.tiny_models import LINEAGES, TINY, family_of_variant, make_tiny

VARIANTS = sorted(TINY)


def _hand_checked(specs) -> set[str]:
    """Families Transformers lacks, checked against the hand-written reference of the test file they
    name."""
    return {spec.name for spec in specs if (spec.parity_reference or "").startswith("tests/")}


def test_every_parity_checked_family_has_a_tiny_checkpoint():
    """Against Transformers here, or, for a family Transformers lacks, in the test file its spec
    names (which must exist and name the family)."""
    hand = _hand_checked(SPECS.values())
    checked = {name for name, spec in SPECS.items() if spec.parity_reference} - hand
    covered = {family_of_variant(v) for v in VARIANTS}
    assert checked <= covered, f"families marked parity-checked without a test: {checked - covered}"
    root = Path(__file__).resolve().parents[2]
    missing = {name for name in hand if not (root / SPECS[name].parity_reference).is_file()}
    assert not missing, f"families whose reference test file is missing: {missing}"
    unnamed = {
        name
        for name in hand
        if f'"{name}"' not in (root / SPECS[name].parity_reference).read_text()
    }
    assert not unnamed, f"families whose reference test file never names them: {unnamed}"


def test_every_hand_written_reference_names_a_test_file():
    named = {
        spec.parity_reference
        for spec in SPECS.values()
        if (spec.parity_reference or "").startswith("tests/")
    }
    root = Path(__file__).resolve().parents[2]
    assert all((root / path).is_file() for path in named), named


@pytest.mark.parametrize("lineage", sorted(LINEAGES))
def test_each_tiny_module_holds_its_family_modules_families(lineage):
    """tests/tiny/<lineage>.py checks the families of ster_dist/families/<lineage>.py, all of
    them."""
    specs = getattr(
        importlib.import_module(f"ster_dist.families.{lineage}"), f"{lineage.upper()}_FAMILIES"
    )
    specified = {spec.name for spec in specs} - _hand_checked(specs)
    assert {family_of_variant(v) for v in LINEAGES[lineage].TINY} == specified


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = make_tiny(request.param, directory)
    loaded = load_model(resolve(str(directory)), "f32")
    return request.param, reference, loaded


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_match_transformers(pair):
    variant, reference, loaded = pair
    ids = _ids(2, 40)  # longer than every tiny sliding window and the longrope switch point
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = reference(ids).logits
    result = compare(ours, theirs)
    assert result["max_relative_error"] < 1e-4, (variant, result)
    assert result["mean_cosine"] > 0.9999, (variant, result)


def test_greedy_generation_matches_transformers(pair):
    variant, reference, loaded = pair
    prompt = _ids(1, 7, seed=1)
    with torch.no_grad():
        theirs = reference.generate(prompt, max_new_tokens=12, do_sample=False)[
            0, prompt.shape[1] :
        ].tolist()
    ours = engine_tokens(loaded, [prompt[0].tolist()], 12, loaded.cfg.eos_token_ids)[0]
    assert ours == theirs, variant


def test_decoding_from_cache_equals_reading_whole(pair):
    variant, _, loaded = pair
    ids = _ids(2, 20, seed=2)
    model = loaded.model
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 20)
        parts = [model(ids[:, :12], cache=cache)]
        for t in range(12, 20):
            parts.append(model(ids[:, t : t + 1], cache=cache))
    stepped = torch.cat(parts, dim=1)
    assert compare(stepped, whole)["max_relative_error"] < 1e-5, variant


def test_batched_generation_equals_one_by_one(pair):
    variant, _, loaded = pair
    prompts = [_ids(1, n, seed=10 + n)[0].tolist() for n in (3, 9, 6)]
    eos = loaded.cfg.eos_token_ids
    batched = engine_tokens(loaded, prompts, 8, eos)
    single = [engine_tokens(loaded, [p], 8, eos)[0] for p in prompts]
    assert batched == single, variant

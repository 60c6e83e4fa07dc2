"""LongCat-Flash-Lite (longcat_flash_ngram), which Transformers lacks: the reference is a
plain-torch n-gram embedding written here from seeds/000's paragraph (with the table width and
numbering vLLM's and mlx-lm's implementations build), feeding Transformers' LongcatFlashForCausalLM
its inputs_embeds for the rest. Logits and greedy tokens equal it, runs restarting after each eos;
decoding from the static cache and from the paged cache equals the whole read (the last tokens
carried across steps, an eos inside a prompt and inside a decode); batches equal one at a time; TP=2
equals TP=1; the token engine answers as `ster generate`; a config without model_type is read by its
architectures; what the config cannot state is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.errors import Refusal
from ster_dist.families.registry import family_table
from ster_dist.load import load_model
from ster_dist.model.paged import PagedCache
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import check_engine_answers_as_generate, engine_tokens
from tests.paged_steps import BLOCK, Driver, run_step
from tests.remote_checks import (
    check_cache_and_batches,
    check_tp2_equals_tp1,
    greedy_by_rereading,
    random_ids,
)
from tests.tiny_models import make_tiny

NEIGHBORS, SPLITS, RATIO, EOS = 3, 2, 0.37, 2


def _reference_embedding(model, tables, projections, ids: torch.Tensor) -> torch.Tensor:
    """seeds/000 literally: for order n in 2..NEIGHBORS and table j, table (n - 2) * SPLITS + j
    hashes the token and the n - 1 before it (zero before its run, which restarts after each eos) to
    (token + sum previous_d * (vocab^d mod rows)) mod rows; each row through its projection; all
    averaged with the token embedding."""
    vocab = model.config.vocab_size
    out = model.get_input_embeddings()(ids)
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        for t in range(len(row)):
            start = max([p + 1 for p in range(t) if row[p] == EOS], default=0)
            previous = [row[t - d] if t - d >= start else 0 for d in range(1, NEIGHBORS)]
            for n in range(2, NEIGHBORS + 1):
                for j in range(SPLITS):
                    index = (n - 2) * SPLITS + j
                    rows = tables[index].shape[0]
                    key = (
                        row[t] + sum(previous[d - 1] * (vocab**d % rows) for d in range(1, n))
                    ) % rows
                    out[b, t] = out[b, t] + projections[index] @ tables[index][key]
    return out / (1 + SPLITS * (NEIGHBORS - 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, reference forward over ids -> logits, our loaded model)."""
    directory = tmp_path_factory.mktemp("longcat_flash_ngram")
    reference = make_tiny("longcat_flash", directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("model_type")
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    config.update(
        architectures=["LongcatFlashNgramForCausalLM"],
        emb_neighbor_num=NEIGHBORS,
        emb_split_num=SPLITS,
        ngram_vocab_size_ratio=RATIO,
        eos_token_id=EOS,
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    count = SPLITS * (NEIGHBORS - 1)
    gen = torch.Generator().manual_seed(7)
    tables = [
        torch.randn(int(RATIO * vocab + 2 * i + 1), hidden // count, generator=gen)
        for i in range(count)
    ]
    projections = [torch.randn(hidden, hidden // count, generator=gen) * 0.3 for i in range(count)]
    (file,) = directory.glob("*.safetensors")
    tensors = load_file(file)
    for i in range(count):
        tensors[f"model.ngram_embeddings.embedders.{i}.weight"] = tables[i]
        tensors[f"model.ngram_embeddings.post_projs.{i}.weight"] = projections[i]
    save_file(tensors, file, metadata={"format": "pt"})

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return reference(
                inputs_embeds=_reference_embedding(reference, tables, projections, ids)
            ).logits

    return directory, forward, load_model(resolve(str(directory)), "f32")


def _with_eos(ids: torch.Tensor, *at: int) -> torch.Tensor:
    ids = ids.clone()
    ids[..., list(at)] = EOS
    return ids


def test_logits_and_greedy_tokens_equal_the_reference(tiny):
    _, forward, loaded = tiny
    assert loaded.cfg.family == "longcat_flash_ngram" and loaded.cfg.ngram.breaks == (EOS,)
    # runs restart after each eos, two in a row among them
    ids = _with_eos(random_ids(2, 14), 5, 6, 11)
    with torch.no_grad():
        result = compare(loaded.model(ids), forward(ids))
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.9999, result
    prompt = _with_eos(random_ids(1, 7, seed=1)[0], 3).tolist()
    got = engine_tokens(loaded, [prompt], 8, loaded.cfg.eos_token_ids)[0]
    assert got == greedy_by_rereading(forward, prompt, 8, EOS)


def test_the_token_embedding_may_be_named_inside_the_ngram_module(tiny, tmp_path):
    directory, _, loaded = tiny
    for file in directory.iterdir():
        if file.is_file():
            (tmp_path / file.name).write_bytes(file.read_bytes())
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.ngram_embeddings.word_embeddings.weight"] = tensors.pop(
        "model.embed_tokens.weight"
    )
    save_file(tensors, file, metadata={"format": "pt"})
    ids = random_ids(1, 9)
    with torch.no_grad():
        assert torch.equal(load_model(resolve(str(tmp_path)), "f32").model(ids), loaded.model(ids))


def test_decoding_from_the_cache_equals_the_whole_read_and_batches_equal_one_by_one(tiny):
    loaded = tiny[2]
    check_cache_and_batches(loaded)
    model = loaded.model
    # an eos in the prompt and one read as a decode step
    ids = _with_eos(random_ids(2, 16, seed=3), 4, 13)
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 16)
        parts = [model(ids[:, :9], cache=cache)] + [
            model(ids[:, t : t + 1], cache=cache) for t in range(9, 16)
        ]
    assert compare(torch.cat(parts, dim=1), whole)["max_relative_error"] < 1e-5


# prefills and decodes of three sequences together, one of them alone at the last steps
SCHEDULE = [
    [("A", 11), ("B", 4)],
    [("B", 5), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 3,
    [("C", 7), ("A", 1)],
    [("B", 1)],
    [("B", 1)],
]


def test_decodes_from_the_paged_cache_equal_the_whole_read(tiny):
    model = tiny[2].model
    gen = torch.Generator().manual_seed(3)
    tokens = {name: torch.randint(3, 300, (30,), generator=gen) for name in "ABC"}
    tokens["A"][[2, 12]] = EOS  # inside A's prompt, and as a decode step
    tokens["C"][[3, 4]] = EOS  # the last of C's first chunk and the first of its next
    with torch.no_grad():
        whole = {name: model(t[None])[0] for name, t in tokens.items()}
    driver = Driver(PagedCache(model, 40, BLOCK, state_slots=3))
    for step in SCHEDULE:
        chunks, logits = run_step(model, driver, tokens, step)
        for row, ((name, _), c) in enumerate(zip(step, chunks)):
            assert (
                compare(logits[row], whole[name][c.start + c.length - 1])["max_relative_error"]
                < 1e-5
            ), step


def test_tp2_equals_tp1(tiny):
    directory, _, loaded = tiny
    check_tp2_equals_tp1({"longcat_flash_ngram": (directory, loaded)})


def test_the_token_engine_answers_as_ster_generate(tiny):
    directory = tiny[0]
    prompts = ["a prompt of a few words", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 8, 12)


def test_ster_families_lists_it_as_parity_checked_against_this_file():
    rows = {row["family"]: row for row in family_table()}
    row = rows["longcat_flash_ngram"]
    assert (
        row["status"] == "parity-checked"
        and row["reference"] == "tests/families/test_longcat_ngram.py"
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"emb_neighbor_num": None}, "emb_neighbor_num is None"),
        ({"emb_split_num": 0}, "emb_split_num is 0"),
        ({"emb_neighbor_num": 1}, "emb_neighbor_num at least 2"),
        ({"emb_split_num": 5}, "do not split hidden_size"),
    ],
)
def test_what_the_config_cannot_state_is_refused_before_any_weight(tiny, tmp_path, change, message):
    directory = tiny[0]
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    for file in directory.glob("tokenizer*"):
        (tmp_path / file.name).write_bytes(file.read_bytes())
    with pytest.raises(Refusal) as refused:
        load_model(resolve(str(tmp_path)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_carried_tokens_survive_a_bf16_cache():
    from ster_dist.model.ngram_embedding import _decode, _encode

    values = torch.tensor([0, 1, 255, 256, 131073, 2**24 - 1])
    assert torch.equal(_decode(_encode(values, torch.bfloat16)), values)

"""GLM-5-Next (glm5_next_text, ster_dist/families/hyper.py) beyond the parity checks every family
takes (tests/tiny/hyper.py: logits, greedy, static cache, batching against Transformers; TP=2 and
EP=2 in their own files): the pooled indexer's choice bites, decodes continued from the paged cache
and the token engine equal the whole read, Transformers' in-memory spellings read as the release's,
the release's linear_attn_config, and the refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.adapters.targets import refuse_family
from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, random_sequences
from tests.tiny_models import load_tiny, random_ids, with_config


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """(directory, Transformers model, our model) of the tiny GLM-5-Next (its image-text
    wrapper)."""
    return load_tiny("glm5_next", tmp_path_factory)


def test_the_pooled_choice_narrows_attention(glm5, tmp_path):
    """With pools enough for every key the layers attend densely; the tiny's two pools a query
    differ from that (and match Transformers: tests/families/test_parity.py), so the choice is what
    the parity checks see."""
    directory, reference, ours = glm5
    dense = load_model(
        resolve(str(with_config(directory, tmp_path / "dense", {"index_topk": 64}, text=True))),
        "f32",
    ).model
    with torch.no_grad():
        ids = random_ids(40)
        assert compare(ours(ids), reference(ids).logits)["max_relative_error"] < 1e-4
        assert compare(dense(ids), ours(ids))["max_relative_error"] > 1e-3


SCHEDULE = [
    [("A", 14), ("B", 5)],
    [("B", 6), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 4,
    [("C", 9), ("A", 1)],
    [("B", 1), ("C", 1)],
]


def test_decodes_from_the_paged_cache_equal_the_whole_read(glm5):
    """Pools close mid-chunk and mid-decode; each step rebuilds them from the keys and gates the
    cache keeps."""
    _, _, model = glm5
    # a delta-attention state each
    check_paged_equals_whole(model, random_sequences(3), SCHEDULE, state_slots=3)


def test_the_token_engine_answers_as_ster_generate(glm5):
    directory, _, _ = glm5
    prompts = ["a prompt longer than the indexer keeps", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


def _in_memory_names(
    name: str, tensor: torch.Tensor, fused: dict
) -> list[tuple[str, torch.Tensor]]:
    """Transformers' in-memory module names for a release tensor (forget_gate.*, one conv1d,
    attn_hc.*)."""
    for part in ("f_a_proj.weight", "f_b_proj.weight", "A_log", "dt_bias"):
        if name.endswith(f"self_attn.{part}"):
            return [(name.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}"), tensor)]
    for part in "qkv":
        if name.endswith(f"self_attn.{part}_conv1d.weight"):
            fused.setdefault(name.replace(f"{part}_conv1d", "conv1d"), {})[part] = tensor
            return []
    for release, own in (("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc.")):
        if f".{release}" in name:
            return [(name.replace(f".{release}", f".{own}"), tensor)]
    return [(name, tensor)]


def test_transformers_in_memory_names_read_as_the_release(glm5, tmp_path):
    directory, _, ours = glm5
    own = tmp_path / "in_memory"
    shutil.copytree(directory, own)
    for file in own.glob("*.safetensors"):
        fused: dict = {}
        tensors = dict(
            pair for name, t in load_file(file).items() for pair in _in_memory_names(name, t, fused)
        )
        tensors.update(
            {name: torch.cat([parts[p] for p in "qkv"]) for name, parts in fused.items()}
        )
        save_file(tensors, file, metadata={"format": "pt"})
    renamed = load_model(resolve(str(own)), "f32").model
    with torch.no_grad():
        assert compare(renamed(random_ids(24)), ours(random_ids(24)))["max_relative_error"] < 1e-6


_TEXT = {
    "model_type": "glm5_next_text",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 300,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "head_dim": 0,
    "qk_rope_head_dim": 0,
}


def test_the_release_config_reads_linear_attn_config_and_the_defaults():
    cfg = from_hf(
        {
            **_TEXT,
            "linear_attn_config": {
                "num_heads": 2,
                "head_dim": 8,
                "short_conv_kernel_size": 3,
                "safe_gate": True,
                "gate_lower_bound": None,
            },
        }
    )
    raw = cfg.raw
    assert (raw["linear_num_heads"], raw["linear_head_dim"], raw["linear_conv_kernel_dim"]) == (
        2,
        8,
        3,
    )
    assert raw["kda_safe_gate"] and raw["kda_lower_bound"] == -5.0
    # Glm5NextTextConfig's defaults: every fourth layer latent attention, three dense layers first
    assert cfg.mixers == ("kimi_delta", "kimi_delta", "kimi_delta", "latent_attention")
    assert cfg.feed_forwards == ("dense", "dense", "dense", "moe")
    assert (raw["hyper_streams"], raw["hyper_head"], raw["index_kpool"]) == (4, "mean", 16)


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"indexer_types": ["full", "shared", "full", "full"]},
            "cross-layer top-k sharing is not supported",
        ),
        ({"qk_rope_head_dim": 8}, "rotates nothing: state 0"),
        ({"hc_mult": 0}, "hc_mult is 0"),
    ],
)
def test_refusals(change, words):
    with pytest.raises(Refusal, match=words):
        from_hf({**_TEXT, **change})


def test_adapters_are_refused():
    with pytest.raises(Refusal, match="adapters on glm5_next_text are refused"):
        refuse_family("glm5_next_text")

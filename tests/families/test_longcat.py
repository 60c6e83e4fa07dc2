"""LongCat-Flash (longcat_flash) beyond the parity checks every family takes
(tests/families/test_parity.py at TP=1, tests/parallel/test_tensor_parallel.py at TP=2,
tests/model/test_moe.py at EP=2): each stored layer runs as two decoder layers, so layer indices,
hook sites and the cache count halves; decodes continued from the paged cache equal the whole read
on one rank and on two expert-parallel ranks (identity experts never dispatched, a rank's token
share empty at some steps); the token engine answers as `ster generate`; the config's refusals and
switches."""

from __future__ import annotations

import pytest
import torch

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.families.registry import status
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one
from tests.tiny_models import TINY, make_tiny

STORED_LAYERS = TINY["longcat_flash"][2]["num_layers"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, Transformers model, our loaded model)."""
    directory = tmp_path_factory.mktemp("longcat_flash")
    reference = make_tiny("longcat_flash", directory)
    return directory, reference, load_model(resolve(str(directory)), "f32")


def test_each_stored_layer_is_two_decoder_layers_with_a_cache_each(tiny):
    _, reference, loaded = tiny
    model = loaded.model
    assert loaded.cfg.num_layers == 2 * STORED_LAYERS == reference.config.num_hidden_layers
    assert [block.shortcut is not None for block in model.layers] == [True, False] * STORED_LAYERS
    assert len(model.new_cache(1, 8).keys) == 2 * STORED_LAYERS
    model.add_hook(2 * STORED_LAYERS - 1, lambda h: None)()  # the last half's site exists
    with pytest.raises(IndexError):
        model.add_hook(2 * STORED_LAYERS, lambda h: None)
    # the hook after decoder layer 2k + 1 is Transformers' stored layer k's output
    seen: list[torch.Tensor] = []
    remove = model.add_hook(1, lambda h: seen.append(h.clone()))
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids)
        out = reference(ids, output_hidden_states=True).hidden_states[1]
    remove()
    assert compare(seen[0], out)["max_relative_error"] < 1e-4


# prefills and decodes of three sequences together, one of them alone at the last steps
SCHEDULE = [
    [("A", 11), ("B", 4)],
    [("B", 5), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 3,
    [("C", 7), ("A", 1)],
    [("B", 1)],
    [("B", 1)],
]


def _tokens() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randint(3, 300, (30,), generator=gen) for name in "ABC"}


def test_decodes_from_the_paged_cache_equal_the_whole_read(tiny):
    model = tiny[2].model
    tokens = _tokens()
    check_paged_equals_whole(model, tokens, SCHEDULE)


def test_two_expert_parallel_ranks_over_paged_caches_equal_one(tiny, ep2):
    directory, _, loaded = tiny
    tokens = _tokens()
    check_ranks_equal_one(ep2, directory, loaded.model, tokens, SCHEDULE)


def test_the_token_engine_answers_as_ster_generate(tiny):
    directory = tiny[0]
    prompts = ["a prompt of a few words", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 8, 12)


_CONFIG = {
    "model_type": "longcat_flash",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_layers": 2,
    "vocab_size": 256,
    "ffn_hidden_size": 96,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "n_routed_experts": 6,
    "zero_expert_num": 2,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 16,
}


def test_the_config_reads_as_transformers_and_vllm_read_it():
    cfg = from_hf(_CONFIG)
    assert cfg.num_layers == 4 and cfg.intermediate_size == 96 and cfg.moe.intermediate_size == 16
    assert (cfg.moe.num_experts, cfg.moe.identity_experts, cfg.moe.top_k) == (6, 2, 2)
    # LongcatFlashConfig's default factor
    assert cfg.moe.scaling_factor == 6.0 and not cfg.moe.renormalize
    # Transformers always scales the bottlenecks; a release states the switches, and one stated off
    # is honoured
    assert cfg.raw["mla_scale_q_lora"] and cfg.raw["mla_scale_kv_lora"]
    off = from_hf({**_CONFIG, "mla_scale_q_lora": False, "mla_scale_kv_lora": False})
    assert not off.raw["mla_scale_q_lora"] and not off.raw["mla_scale_kv_lora"]
    assert status("longcat_flash") == "parity-checked"


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"zero_expert_type": "zero"}, "only identity zero experts"),
        ({"router_bias": True}, "router_bias is true"),
        ({"num_layers": 0}, "num_layers is 0"),
    ],
)
def test_unreadable_configs_are_refused(keys, message):
    with pytest.raises(Refusal, match=message):
        from_hf({**_CONFIG, **keys})


def test_identity_experts_beside_what_they_do_not_combine_with_are_refused():
    with pytest.raises(Refusal, match="zero_expert_num 2 identity experts are supported only"):
        from_hf(
            {
                "model_type": "deepseek_v3",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "intermediate_size": 96,
                "kv_lora_rank": 16,
                "q_lora_rank": 24,
                "qk_nope_head_dim": 8,
                "qk_rope_head_dim": 4,
                "v_head_dim": 12,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "n_group": 4,
                "topk_group": 2,
                "zero_expert_num": 2,
            }
        )

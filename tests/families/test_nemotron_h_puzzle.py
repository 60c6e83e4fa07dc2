"""Nemotron Puzzle (nemotron_h_puzzle), which Transformers lacks, against a reference built from
Transformers' own Nemotron-H modules: a tiny Nemotron-H whose expert layers are rebuilt, each from
its block's settings (expert count, experts per token, widths, a latent width in one), saved as
Puzzle stores it (below
`model`,
block_configs). Logits, greedy generation, a long prompt read in chunks, TP=2 and EP=2 equal to one
rank, and the refusal of a per-block key it does not build."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.tiny_models import BASE_CONFIG, perturb_norms, read_config

GLOBAL = dict(
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=12,
    ssm_state_size=16,
    n_groups=2,
    chunk_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=24,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
# two expert layers unlike each other and the model-wide settings, each stating its experts'
# settings (Puzzle
# states them only per block)
BLOCKS = [
    {"block_type": "mamba"},
    {
        "block_type": "moe",
        "n_routed_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 20,
        "moe_shared_expert_intermediate_size": 28,
        "n_group": 1,
        "topk_group": 1,
    },
    {"block_type": "attention"},
    {"block_type": "mlp"},
    {
        "block_type": "moe",
        "n_routed_experts": 4,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24,
        "moe_latent_size": 24,
        "n_group": 2,
        "topk_group": 2,
    },
]


def _reference(seed: int = 0):
    """Transformers' Nemotron-H with each expert layer rebuilt from its block's settings."""
    import transformers
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    base = {k: v for k, v in BASE_CONFIG.items() if k != "num_hidden_layers"}
    config = transformers.NemotronHConfig(
        **base,
        **GLOBAL,
        layers_block_type=[
            b["block_type"]
            .replace("mamba", "linear_attention")
            .replace("attention", "full_attention")
            .replace("linear_full_attention", "linear_attention")
            for b in BLOCKS
        ],
    )
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 3)
    for i, block in enumerate(BLOCKS):
        if block["block_type"] != "moe":
            continue
        own = copy.deepcopy(config)
        for key, value in block.items():
            if key != "block_type":
                setattr(own, key, value)
        moe = nh.NemotronHMoE(own, layer_idx=i)
        with torch.no_grad():
            for name, p in list(moe.named_parameters()) + list(moe.named_buffers()):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "bias" in name else 0.1))
        model.model.layers[i].mixer = moe
    perturb_norms(model, seed)
    return model.eval()


def _save_as_puzzle(model, directory) -> None:
    """Transformers saves Nemotron-H below backbone with per-expert tensors; Puzzle keeps those
    below model."""
    model.save_pretrained(directory, safe_serialization=True)
    tensors = load_file(directory / "model.safetensors")
    save_file(
        {name.replace("backbone.", "model.", 1): t.contiguous() for name, t in tensors.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = read_config(directory)
    for key in (
        "layers_block_type",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "moe_latent_size",
    ):
        config.pop(key, None)
    config.update(
        model_type="nemotron_h_puzzle",
        architectures=["NemotronHPuzzleForCausalLM"],
        block_configs=BLOCKS,
    )
    (directory / "config.json").write_text(json.dumps(config))
    from tests.tiny_tokenizer import build_tiny_tokenizer

    build_tiny_tokenizer(directory)


@pytest.fixture(scope="module")
def puzzle(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron_h_puzzle")
    reference = _reference()
    _save_as_puzzle(reference, directory)
    return directory, reference, load_model(resolve(str(directory)), "f32")


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_each_expert_layer_has_its_blocks_experts(puzzle):
    cfg = from_hf(read_config(puzzle[0]))
    assert cfg.mixers == ("mamba2", "none", "attention", "none", "none")
    assert cfg.feed_forwards == ("none", "moe", "none", "dense", "moe")
    first, last = cfg.moe_of(1), cfg.moe_of(4)
    assert (
        first.num_experts,
        first.top_k,
        first.intermediate_size,
        first.shared_intermediate_size,
    ) == (6, 3, 20, 28)
    assert (last.num_experts, last.top_k, last.latent_size, last.n_group, last.topk_group) == (
        4,
        1,
        24,
        2,
        2,
    )


def test_logits_greedy_and_chunked_prefill_equal_the_reference(puzzle):
    _, reference, loaded = puzzle
    model = loaded.model
    ids = _ids(2, 40, seed=1)
    with torch.no_grad():
        ours, theirs = model(ids), reference(ids).logits
        cache = model.new_cache(2, 48)
        parts = [
            model(ids[:, a:b], cache=cache) for a, b in ((0, 17), (17, 18), (18, 39), (39, 40))
        ]
    stats = compare(ours, theirs)
    assert stats["max_relative_error"] < 1e-4 and stats["mean_cosine"] > 0.9999
    assert compare(torch.cat(parts, dim=1), ours)["max_relative_error"] < 1e-4
    prompt = ids[0, :9].tolist()
    with torch.no_grad():
        expected = reference.generate(ids[:1, :9], max_new_tokens=8, do_sample=False)[
            0, 9:
        ].tolist()
    assert engine_tokens(loaded, [prompt], 8)[0] == expected


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_tp2_and_ep2_equal_one_rank(puzzle, tp, ep):
    directory, _, loaded = puzzle
    ids = _ids(2, 24, seed=2)
    with SpawnGroup(tp * ep, ep=ep) as group:
        group.call("load", resolve(str(directory)), "f32", "cpu")
        logits = group.call("logits", ids)[0]
    with torch.no_grad():
        assert compare(logits, loaded.model(ids))["max_relative_error"] < 1e-5


def test_a_per_block_key_it_does_not_build_is_refused(puzzle):
    config = read_config(puzzle[0])
    config["block_configs"][2] = {"block_type": "attention", "sliding_window": 8}
    with pytest.raises(Refusal, match=r"block_configs\[2\] \(attention\) states sliding_window"):
        from_hf(config)

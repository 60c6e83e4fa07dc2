"""Hyper-connected families (ster_dist/families/hyper.py) beyond the parity checks every family
takes (tests/tiny/hyper.py: logits, greedy, static cache, batching; TP=2 and EP=2 in their own
files): capture and steering on the streams against Transformers' own streams, both spellings of the
tensors, decodes continued from the paged cache and the token engine equal to the whole read, the
logit cap, the configs' defaults and refusals; TP=2 over paged caches under -m slow."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ster_dist.config import from_hf
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.steer.attach import add_steering
from tests.engine_checks import check_engine_answers_as_generate
from tests.paged_steps import check_paged_equals_whole, check_ranks_equal_one, random_sequences
from tests.tiny.hyper import as_rotated_by_halves
from tests.tiny_models import load_tiny, random_ids, with_config


@pytest.fixture(scope="module")
def hy_v4(tmp_path_factory):
    """(directory, Transformers model, our model) of the tiny HY V4."""
    return load_tiny("hy_v4", tmp_path_factory)


def test_capture_reads_the_streams_mean_and_steering_shifts_every_stream(hy_v4):
    """Against Transformers' streams: the residual a hook reads after layer 1 is the mean of its
    streams, and a vector steered in there is added to each of them."""
    _, reference, ours = hy_v4
    ids, layer = random_ids(16), 1
    vector = torch.randn(ours.cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * 0.5
    seen: dict[str, torch.Tensor] = {}

    def shift_streams(module, args, output):
        streams = output[0] if isinstance(output, tuple) else output
        seen["streams"] = streams.clone()
        shifted = streams + vector
        return (shifted, *output[1:]) if isinstance(output, tuple) else shifted

    handle = reference.model.layers[layer].register_forward_hook(shift_streams)
    captured: list[torch.Tensor] = []
    remove = ours.add_hook(layer, lambda h: captured.append(h.clone()))
    removers = add_steering(ours, [(layer, vector)], 1.0)
    try:
        with torch.no_grad():
            theirs, logits = reference(ids).logits, ours(ids)
    finally:
        handle.remove()
        remove()
        for r in removers:
            r()
    assert compare(captured[0], seen["streams"].mean(dim=-2))["max_relative_error"] < 1e-5
    assert compare(logits, theirs)["max_relative_error"] < 1e-4


def _release_name(name: str) -> str:
    """Transformers' writer's spelling -> the release's (tests/tiny saves the writer's)."""
    for own in ("hc_attn_layer", "hc_mlp_layer"):
        name = name.replace(f"hc_pre.{own}.hc_", f"{own}.hc_pre.hc_")
    return name.replace("model.hc_pre.hc_head.", "model.hc_head.").replace(
        "mlp.linear_gate.", "mlp.gate_proj."
    )


def test_the_release_spelling_reads_as_transformers_writer_spelling(hy_v4, tmp_path):
    directory, _, ours = hy_v4
    release = tmp_path / "release"
    shutil.copytree(directory, release)
    for file in release.glob("*.safetensors"):
        tensors = {_release_name(k): v for k, v in load_file(file).items()}
        assert (
            any(".hc_attn_layer.hc_pre.hc_fn" in k for k in tensors)
            and "model.hc_head.hc_head_fn" in tensors
        )
        save_file(tensors, file, metadata={"format": "pt"})
    other = load_model(resolve(str(release)), "f32").model
    with torch.no_grad():
        assert torch.equal(other(random_ids(20)), ours(random_ids(20)))


# prefills longer and shorter than index_topk (12), decodes that cross it, sequences decoding
# together
SCHEDULE = [
    [("A", 14), ("B", 5)],
    [("B", 6), ("C", 3)],
    *[[("A", 1), ("B", 1), ("C", 1)]] * 4,
    [("C", 9), ("A", 1)],
    [("B", 1), ("C", 1)],
]


def test_decodes_from_the_paged_cache_equal_the_whole_read(hy_v4):
    _, _, model = hy_v4
    check_paged_equals_whole(model, random_sequences(3), SCHEDULE)


def test_the_token_engine_answers_as_ster_generate(hy_v4):
    directory, _, _ = hy_v4
    prompts = ["a prompt longer than the indexer keeps", "short", "another, somewhat longer prompt"]
    check_engine_answers_as_generate(directory, prompts, 10, 16)


def test_soft_logits_capping_caps_the_logits(hy_v4, tmp_path):
    """Transformers' class ignores it; vLLM, whose reading the family follows, caps
    (families/hyper.py)."""
    directory, _, ours = hy_v4
    capped = load_model(
        resolve(
            str(
                with_config(
                    directory,
                    tmp_path / "capped",
                    {"soft_logits_capping": True, "soft_logits_capping_logits": 0.05},
                )
            )
        ),
        "f32",
    ).model
    with torch.no_grad():
        plain, got = ours(random_ids(10)), capped(random_ids(10))
    assert compare(got, torch.tanh(plain / 0.05) * 0.05)["max_relative_error"] < 1e-5


_CONFIG = {
    "model_type": "hy_v4",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 6,
    "vocab_size": 256,
    "intermediate_size": 128,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "index_head_dim": 16,
}


def test_unstated_keys_read_as_the_config_class_defaults():
    from transformers import HYV4Config

    theirs = HYV4Config(**{k: v for k, v in _CONFIG.items() if k != "model_type"})
    ours = from_hf(_CONFIG)
    assert ours.raw["indexer_types"] == theirs.indexer_types
    assert ours.moe_layers == tuple(kind == "sparse" for kind in theirs.mlp_layer_types)
    assert (
        ours.hyper_streams == theirs.hc_mult and ours.raw["hyper_post_scale"] == theirs.hc_magnitude
    )
    assert ours.moe.swiglu_limit == theirs.swiglu_limit and ours.moe.shared_intermediate_size == 16
    assert ours.sinks(0) and ours.raw["mla_output_gate"]
    plain = from_hf({**_CONFIG, "enable_ihc": False, "learnable_sink": False, "gated_mla": False})
    assert plain.hyper_streams == 0 and not plain.sinks(0) and not plain.raw["mla_output_gate"]


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"gating_type": "headwise"}, "gating_type 'headwise' is not supported"),
        ({"hc_mult": 0}, "hc_mult is 0"),
        ({"q_lora_rank": None}, "q_lora_rank is null"),
    ],
)
def test_unreadable_configs_are_refused(keys, message):
    with pytest.raises(Refusal, match=message):
        from_hf({**_CONFIG, **keys})


@pytest.mark.parametrize(
    "module",
    [
        "glm5_next.modeling_glm5_next.Glm5NextTextHyperConnection",
        "deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperConnection",
    ],
)
def test_the_mixing_form_equals_transformers_hyper_connection(module):
    """The form with comb (Sinkhorn-Knopp), which GLM-5-Next and DeepSeek-V4 use, on one module's
    weights:
    the collapse, and the outgoing streams as their decoder layers join them."""
    import importlib
    from dataclasses import replace
    from types import SimpleNamespace

    from ster_dist.model.hyper_connection import HyperConnection

    path, name = module.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.models.{path}"), name)
    n, hidden, eps = 3, 64, 1e-5
    theirs = cls(
        SimpleNamespace(
            hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=eps, hidden_size=hidden
        )
    )
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    cfg = from_hf(_CONFIG)
    cfg = replace(
        cfg,
        norm_eps=eps,
        raw={
            **cfg.raw,
            "hyper_mixing": True,
            "hyper_sinkhorn_iters": 20,
            "hyper_post_scale": 2.0,
            "hyper_post_eps": 0.0,
            "hyper_eps": 1e-6,
        },
    )
    ours = HyperConnection(replace(cfg, hyper_streams=n))
    ours.load_state_dict({k: v.clone() for k, v in theirs.state_dict().items()})
    streams, out = (
        torch.randn(2, 5, n, hidden, generator=gen),
        torch.randn(2, 5, hidden, generator=gen),
    )
    with torch.no_grad():
        post, comb, collapsed = theirs(streams)
        joined = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), streams
        )
        our_collapsed, weights = ours(streams)
        assert compare(our_collapsed, collapsed)["max_relative_error"] < 1e-5
        assert compare(ours.join(streams, out, weights), joined)["max_relative_error"] < 1e-5


# TP=2 logits are tests/parallel/test_tensor_parallel.py's; this adds the paged steps (~1 min)
@pytest.mark.slow
def test_tensor_parallel_ranks_over_paged_caches_equal_one_rank(hy_v4, tp2):
    """Heads, sinks and the output gate split across two ranks, the streams and their weights whole
    on each: two ranks' paged steps equal one rank's."""

    directory, _, model = hy_v4
    check_ranks_equal_one(tp2, directory, model, random_sequences(4), SCHEDULE)


def test_the_rotated_rows_are_read_in_pair_order(hy_v4, tmp_path):
    """The seed's convention: the release's rotated rows are in pair order, which vLLM (and
    Transformers since 5.25) rotate by adjacent pairs. The same weights with those rows by halves
    read differently here, so the match with Transformers is not one that any row order would
    pass."""
    directory, reference, ours = hy_v4
    halves_dir = tmp_path / "by_halves"
    shutil.copytree(directory, halves_dir)
    as_rotated_by_halves(halves_dir)
    halves = load_model(resolve(str(halves_dir)), "f32").model
    ids = random_ids(16)
    with torch.no_grad():
        theirs = reference(ids).logits
        assert compare(ours(ids), theirs)["max_relative_error"] < 1e-4
        assert compare(halves(ids), theirs)["max_relative_error"] > 1e-3


def test_the_mean_head_equals_glm5_next_hyper_head():
    from dataclasses import replace

    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperHead

    from ster_dist.model.hyper_connection import HyperHead

    cfg = from_hf(_CONFIG)
    ours = HyperHead(replace(cfg, hyper_streams=3, raw={**cfg.raw, "hyper_head": "mean"}))
    streams = torch.randn(2, 5, 3, 64, generator=torch.Generator().manual_seed(7))
    assert not list(ours.parameters())
    assert compare(ours(streams), Glm5NextTextHyperHead()(streams))["max_relative_error"] < 1e-6

"""A decode step reads nothing back from the device (issue 18's fifth item, model/host.py): every
decision a step takes (masks, kernels, how far the rotary tables reach, which pairs go to which
expert) comes from what the host built, and only the sampled tokens come back.

No GPU runs here, so the model runs on the meta device: tensors with shapes and no data, on which
any read of a value (`int(t)`, `bool(t.all())`, `t.tolist()`, `nonzero`) raises, where on CUDA it
would wait for every queued kernel. Host tensors handed to a meta model where the device was meant
raise too ("not on the expected device"), as on CUDA. A step that completes on meta with logits of
the right shape on meta is a step that never read the device and kept its inputs where its layers
are. The static cache's path (a left-padded prompt, then decodes whose ids are the sampled tokens,
on the device) and the paged one (the token engine's: prefill chunks, then mixed and all-decode
steps, ids from the host) are both stepped. Mixtures of experts run in bf16, the one dtype of CUDA's
grouped products.
"""

from __future__ import annotations

import pytest
import torch

from ster_dist.load import load_model
from ster_dist.model.paged import PagedCache
from ster_dist.moe.layer import MoE
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from tests.paged_steps import Driver, random_sequences, run_step
from tests.tiny_models import TINY, make_tiny

# one per kind of step state a layer reads: grouped heads and llama3 rope, sliding windows and
# soft-capping,
# sinks with experts, latent attention with grouped routing, experts after dense layers, a recurrent
# kind
# (state slots, scans), ALiBi, learned positions, chunked attention with weighed inputs, AltUp with
# per-layer
# inputs and shared keys, gated delta nets beside attention, a Mamba 2 hybrid, and the two layers
# sized by the
# keys' reach (block-sparse attention, compressed windows), identity experts
FAST = [
    "llama",
    "gemma2",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_moe",
    "lfm2",
    "bloom",
    "opt",
    "llama4_text",
    "gemma3n_text",
    "qwen3_next",
    "falcon_h1",
    "minimax_m3_vl_text",
    "deepseek_v4",
    "longcat_flash",
]


def _on_meta(variant: str, tmp_path_factory):
    directory = tmp_path_factory.mktemp(variant)
    make_tiny(variant, directory)
    model = load_model(resolve(str(directory))).model
    return model.to("meta", torch.bfloat16)


@torch.inference_mode()
def _static_steps(model) -> torch.Tensor:
    """A left-padded prompt of two rows, then two decode steps fed the (device) tokens, as a static
    loop runs them."""
    cache = model.new_cache(2, 16)
    positions = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    valid = torch.tensor([[False, True, True, True, True], [True] * 5])
    logits = model(torch.randint(3, 50, (2, 5)), positions, valid, cache, last_only=True)
    assert logits.device.type == "meta" and logits.shape[:2] == (2, 1)
    nxt = positions[:, -1:] + 1
    for _ in range(2):
        tokens = logits[:, -1].argmax(-1, keepdim=True)  # on the device, as the sampler leaves them
        logits = model(tokens, nxt, torch.ones(nxt.shape, dtype=torch.bool), cache)
        nxt = nxt + 1
    return logits


def _paged_steps(model) -> torch.Tensor:
    """Prefill chunks, a mixed step, then every sequence decoding, as the token engine packs
    them."""
    tokens = random_sequences(0)
    driver = Driver(PagedCache(model, 40, 4, state_slots=3))
    for step in (
        [("A", 5), ("B", 3)],
        [("A", 1), ("C", 4), ("B", 1)],
        [("A", 1), ("B", 1), ("C", 1)],
    ):
        logits = run_step(model, driver, tokens, step)[1]
    return logits


def _check(model) -> None:
    static = _static_steps(model)
    assert (
        static.device.type == "meta" and tuple(static.shape[:2]) == (2, 1) and static.shape[2] > 1
    )
    # logits as wide as the static path's (Inkling's head is narrower than its vocab)
    paged = _paged_steps(model)
    assert paged.device.type == "meta" and tuple(paged.shape) == (3, static.shape[2])


@pytest.mark.parametrize("variant", FAST)
def test_a_step_reads_nothing_from_the_device(variant, tmp_path_factory):
    _check(_on_meta(variant, tmp_path_factory))


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in TINY if v not in FAST])
def test_every_family_steps_without_reading_the_device(variant, tmp_path_factory):
    _check(_on_meta(variant, tmp_path_factory))


def test_identity_experts_run_every_pair_off_the_cpu_as_they_pick_pairs_on_it(
    monkeypatch, tmp_path
):
    """LongCat's identity experts off the CPU send every pair through the routed experts, an
    identity pair at weight zero (MoE.every_pair: picking the routed pairs out would read the
    device); on the CPU, where the pick is free, the same layer with that path forced gives the
    picked path's logits."""
    make_tiny("longcat_flash", tmp_path)
    model = load_model(resolve(str(tmp_path))).model
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.identity_experts]
    # a CPU tensor: the picked path
    assert layers and all(not m.every_pair(torch.empty(1)) for m in layers)
    identity_pairs = []
    run_every_pair = MoE._every_pair

    def counted(self, share, weights, ids, routed):
        identity_pairs.append(int((~routed).sum()))
        return run_every_pair(self, share, weights, ids, routed)

    with torch.no_grad():
        picked = model(ids)
        monkeypatch.setattr(MoE, "every_pair", lambda self, share: True)
        monkeypatch.setattr(MoE, "_every_pair", counted)
        every = model(ids)
    # some pairs chose an identity expert
    assert len(identity_pairs) == len(layers) and sum(identity_pairs) > 0
    assert compare(every, picked)["max_relative_error"] < 1e-5

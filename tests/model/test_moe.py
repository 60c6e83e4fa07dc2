"""Expert parallelism on real gloo groups: token dispatch with all_to_all_single (uneven splits,
ranks that send or receive nothing, uneven expert blocks), every MoE family at EP=2 equal to EP=1
and to Transformers, TP=2 x EP=2 on four ranks, each rank reading only its experts' bytes from
per-expert and stacked layouts, the refusals, and `ster generate --ep 2` through Ray."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ster_dist.config import MoEConfig
from ster_dist.config.file import text_weight_names
from ster_dist.errors import Refusal
from ster_dist.families.registry import SPECS
from ster_dist.load import load_model
from ster_dist.moe.dispatch import combine, dispatch
from ster_dist.moe.experts import Experts
from ster_dist.moe.router import Router
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.shard.safetensors_header import read_header
from ster_dist.workers.extension import RankExtension
from ster_dist.workers.spawn import SpawnGroup
from tests.engine_checks import engine_tokens
from tests.moe_probe import DispatchProbe
from tests.tiny_models import STARVED, TINY, family_of_variant, make_tiny

# a family of experts whose checkpoint has none (Granite 4.0 with num_local_experts 0) is a dense
# model here
# nor is one whose mlp_layer_types routes no layer (Inkling's dense variant), nor Gemma 4 without
# enable_moe_block
MOE_VARIANTS = sorted(
    v
    for v in TINY
    if SPECS[family_of_variant(v)].moe is not None
    and TINY[v][2].get("num_local_experts") != 0
    and {"sparse", "moe"} & set(TINY[v][2].get("mlp_layer_types", ["sparse"]))
    and TINY[v][2].get("enable_moe_block", True)
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built: dict = {}

    def get(variant):
        if variant not in built:
            directory = tmp_path_factory.mktemp(variant)
            built[variant] = (directory, make_tiny(variant, directory))
        return built[variant]

    return get


def _ids(batch=2, length=40, seed=0):
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


# -- dispatch --------------------------------------------------------------------------------------

HIDDEN, INNER = 12, 10


def _global_experts(num: int, seed: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(num, INNER, HIDDEN, generator=gen),
        "up": torch.randn(num, INNER, HIDDEN, generator=gen),
        "down": torch.randn(num, HIDDEN, INNER, generator=gen),
    }


class DispatchOnRank(RankExtension):
    """Runs dispatch, this rank's experts and combine on its share of x, with no model loaded."""

    def run(self, x: torch.Tensor, ids: torch.Tensor, num: int) -> dict:
        ctx = self.rank.ctx()
        moe = MoEConfig(num_experts=num, top_k=ids.shape[1], intermediate_size=INNER)
        experts = Experts(moe, HIDDEN, "silu", ctx)
        first, last = ctx.experts(num)
        with torch.no_grad():
            for name, weight in _global_experts(num).items():
                getattr(experts, name).copy_(weight[first:last])
        start, stop = ctx.token_share(x.shape[0])
        rows, local_ids, handle = dispatch(x[start:stop], ids[start:stop], num, ctx)
        back = combine(experts(rows, local_ids), handle)
        return {
            "share": (start, stop),
            "received": rows.shape[0],
            "sent": handle.sent,
            "back": back,
        }


def _expected(x: torch.Tensor, ids: torch.Tensor, num: int) -> torch.Tensor:
    w = _global_experts(num)
    out = []
    for token, e in ((t, int(e)) for t in range(ids.shape[0]) for e in ids[t]):
        h = F.silu(w["gate"][e] @ x[token]) * (w["up"][e] @ x[token])
        out.append(w["down"][e] @ h)
    return torch.stack(out) if out else x.new_empty(0, HIDDEN)


@pytest.mark.parametrize("case", ["uneven", "all_to_rank_0", "fewer_tokens_than_ranks"])
def test_dispatch_and_combine_over_two_ranks(ep2, case):
    num, gen = 8, torch.Generator().manual_seed(6)
    tokens = {"uneven": 9, "all_to_rank_0": 7, "fewer_tokens_than_ranks": 1}[case]
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(num, generator=gen)[:3] for _ in range(tokens)])
    if case == "all_to_rank_0":
        # experts 0-3 live on rank 0: rank 1 receives nothing
        ids = torch.stack(
            [
                torch.tensor([0, 1, 2, 3])[torch.randperm(4, generator=gen)[:3]]
                for _ in range(tokens)
            ]
        )
    results = ep2.on(DispatchOnRank).run(x, ids, num)
    if case == "all_to_rank_0":
        assert results[1]["received"] == 0 and results[0]["received"] == 3 * tokens
    if case == "fewer_tokens_than_ranks":
        # rank 0 sends nothing
        assert results[0]["share"] == (0, 0) and results[0]["sent"] == [0, 0]
    for result in results:
        start, stop = result["share"]
        expected = _expected(x[start:stop], ids[start:stop], num)
        assert torch.allclose(result["back"], expected, atol=1e-5)


def test_dispatch_over_three_ranks_with_uneven_expert_blocks():
    num, tokens = 5, 11  # blocks of 1, 2 and 2 experts; shares of 3, 4 and 4 tokens
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(num, generator=gen)[:2] for _ in range(tokens)])
    ids[:, 0] = torch.where(ids[:, 1] == 4, 3, 4)  # the last rank's experts take most rows
    with SpawnGroup(3, ep=3) as group:
        results = group.on(DispatchOnRank).run(x, ids, num)
    assert [r["share"] for r in results] == [(0, 3), (3, 7), (7, 11)]
    assert sum(r["received"] for r in results) == 2 * tokens
    for result in results:
        start, stop = result["share"]
        assert torch.allclose(
            result["back"], _expected(x[start:stop], ids[start:stop], num), atol=1e-5
        )


# -- every family at EP=2 --------------------------------------------------------------------------

# (a shared expert's stacked projections, Inkling's as Transformers saves them, are every rank's:
# not matched)
_STACKED = re.compile(
    r"((?<!shared_)experts\.(gate_up_proj|down_proj)(_bias)?|block_sparse_moe\.(input|output)_linear\.weight"
    r"|experts\.mlp\.(w1|v1|w2)|mlp\.experts\.(w13|w2)_weight)$"
)
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expected_bytes(
    directory, num_experts: int, ep: int, ignored: tuple[str, ...] = (), wrapper: str | None = None
) -> list[int]:
    """What each expert-parallel rank (tp 1) must read: every dense tensor whole but those the
    family ignores (`ignored`: its spec's patterns, such as MiniMax's saved decay buffers) and a
    wrapper's towers, and only its experts."""
    skip = [re.compile(pattern) for pattern in ignored]
    out = []
    for rank in range(ep):
        first, last = ParallelCtx(ep_rank=rank, ep_size=ep).experts(num_experts)
        total = 0
        for path in sorted(directory.glob("*.safetensors")):
            for name, info in read_header(path).tensors.items():
                if any(pattern.match(name) for pattern in skip) or (
                    wrapper and not text_weight_names(wrapper, name)
                ):
                    continue
                size = info["data_offsets"][1] - info["data_offsets"][0]
                per_expert = _PER_EXPERT.search(name)
                if per_expert:
                    total += size if first <= int(per_expert.group(1)) < last else 0
                elif _STACKED.search(name):
                    total += size * (last - first) // num_experts
                else:
                    total += size
        out.append(total)
    return out


def _dispatched_pairs(model, ids: torch.Tensor) -> list[int]:
    """Per MoE layer, in order, the (token, expert) pairs one forward dispatches: every pair but
    those choosing an identity expert (LongCat-Flash's), which never travel."""
    counts: list[int] = []
    hooks = [
        module.register_forward_hook(
            lambda m, _, out: counts.append(int((out[1] < m.moe.num_experts).sum()))
        )
        for module in model.modules()
        if isinstance(module, Router)
    ]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return counts


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_ep2_equals_ep1_and_transformers(ep2, tiny, variant):
    directory, reference = tiny(variant)
    checkpoint = resolve(str(directory))
    single = load_model(checkpoint, "f32")
    stats = ep2.call("load", checkpoint, "f32", "cpu")
    ids = _ids()
    ep2.on(DispatchProbe).reset()  # counts from here: the one forward below, per MoE layer
    logits = ep2.call("logits", ids)[0]
    with torch.no_grad():
        one = single.model(ids)
        theirs = reference(ids).logits
    assert compare(logits, one)["max_relative_error"] < 1e-5
    assert compare(logits, theirs)["max_relative_error"] < 1e-4
    received = ep2.on(DispatchProbe).received_rows()
    routed = _dispatched_pairs(single.model, ids)
    # every pair went somewhere once
    assert [a + b for a, b in zip(*received, strict=True)] == routed
    # the tiny checkpoint's last layer routes nothing to the upper half of the experts
    if variant in STARVED:
        assert received[1][-1] == 0 and received[0][-1] == routed[-1]
    # decoding one token per step: with one prompt, rank 1's token share is empty at every step; the
    # steps dispatch,
    # then skip the dispatch (MoE.replicated: every rank routes every token, one sum of the ranks'
    # partial sums)
    eos = single.cfg.eos_token_ids
    batches = ([ids[0, :7].tolist(), ids[1, :4].tolist()], [ids[0, :5].tolist()])
    wants = [engine_tokens(single, prompts, 8, eos) for prompts in batches]
    for replicated in (False, True):
        ep2.on(DispatchProbe).replicate(replicated)
        for prompts, want in zip(batches, wants):
            assert engine_tokens(ep2, prompts, 8, eos, checkpoint) == want
    # the prompt again, replicated
    assert compare(ep2.call("logits", ids)[0], one)["max_relative_error"] < 1e-5
    ep2.on(DispatchProbe).replicate(False)
    assert [s["bytes_read"] for s in stats] == expected_bytes(
        directory, single.cfg.moe.num_experts, 2, single.cfg.spec.ignore, single.cfg.wrapper
    )


@pytest.fixture(scope="module")
def tp2_ep2():
    with SpawnGroup(4, ep=2) as group:
        yield group


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe", "nemotron_h", "llama4_text"])
def test_tp2_x_ep2_on_four_ranks(tp2_ep2, tiny, variant):
    directory, reference = tiny(variant)
    checkpoint = resolve(str(directory))
    single = load_model(checkpoint, "f32")
    stats = tp2_ep2.call("load", checkpoint, "f32", "cpu")
    ids = _ids(seed=1)
    logits = tp2_ep2.call("logits", ids)[0]
    with torch.no_grad():
        assert compare(logits, single.model(ids))["max_relative_error"] < 1e-5
        assert compare(logits, reference(ids).logits)["max_relative_error"] < 1e-4
    prompts = [ids[0, :6].tolist(), ids[1, :3].tolist()]
    eos = single.cfg.eos_token_ids
    assert engine_tokens(tp2_ep2, prompts, 8, eos, checkpoint) == engine_tokens(
        single, prompts, 8, eos
    )
    # every tensor is read by some rank, and no rank reads half the checkpoint
    total = expected_bytes(directory, single.cfg.moe.num_experts, 1)[0]
    assert sum(s["bytes_read"] for s in stats) >= total
    assert all(s["bytes_read"] < total / 2 for s in stats)


def _stacked_copy(reference, source_dir, directory):
    """The checkpoint as Transformers 5 holds it in memory: experts stacked in gate_up_proj /
    down_proj."""
    directory.mkdir()
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    save_file(state, str(directory / "model.safetensors"))
    for path in source_dir.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy(path, directory / path.name)
    return directory


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral", "granitemoe"])
def test_transformers_stacked_layout_loads_under_ep_and_tp(tp2_ep2, ep2, tiny, tmp_path, variant):
    directory, reference = tiny(variant)
    stacked = _stacked_copy(reference, directory, tmp_path / "stacked")
    names = read_header(stacked / "model.safetensors").tensors
    assert any(n.endswith("experts.gate_up_proj") for n in names) and not any(
        _PER_EXPERT.search(n) for n in names
    )
    checkpoint = resolve(str(stacked))
    single = load_model(checkpoint, "f32")
    ids = _ids(seed=2)
    with torch.no_grad():
        assert compare(single.model(ids), reference(ids).logits)["max_relative_error"] < 1e-4
        expected = single.model(ids)
    stats = ep2.call("load", checkpoint, "f32", "cpu")
    assert compare(ep2.call("logits", ids)[0], expected)["max_relative_error"] < 1e-5
    assert [s["bytes_read"] for s in stats] == expected_bytes(
        stacked, single.cfg.moe.num_experts, 2
    )
    tp2_ep2.call("load", checkpoint, "f32", "cpu")  # windows inside each stacked expert
    assert compare(tp2_ep2.call("logits", ids)[0], expected)["max_relative_error"] < 1e-5


# -- refusals --------------------------------------------------------------------------------------


def test_ep_is_refused_for_a_dense_model_and_beyond_the_expert_count(tiny):
    directory, _ = tiny("llama")
    with pytest.raises(Refusal, match="llama is not a mixture-of-experts model; use --tp"):
        load_model(resolve(str(directory)), ctx=ParallelCtx(ep_rank=0, ep_size=2))
    directory, _ = tiny("granitemoe")
    with pytest.raises(Refusal, match="--ep 8 is more than the model's 6 experts"):
        load_model(resolve(str(directory)), ctx=ParallelCtx(ep_rank=0, ep_size=8))


def _rewrite(directory, target, drop=(), config=None):
    shutil.copytree(directory, target)
    path = target / "model.safetensors"
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(str(path)).items() if k not in drop}
    save_file(tensors, str(path))
    if config:
        raw = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**raw, **config}))
    return target


def test_a_missing_expert_and_a_wrong_expert_width_are_refused(tiny, tmp_path):
    directory, _ = tiny("qwen3_moe")
    missing = _rewrite(
        directory, tmp_path / "missing", drop=("model.layers.2.mlp.experts.7.up_proj.weight",)
    )
    with pytest.raises(
        Refusal, match=r"layers\.2\.mlp\.experts\.up has 8 stacked rows but the checkpoint fills 7"
    ):
        load_model(resolve(str(missing)))
    # the rank holding experts 0-3 never reads (so never misses) expert 7
    assert (
        load_model(resolve(str(missing)), ctx=ParallelCtx(ep_rank=0, ep_size=2)).model is not None
    )
    wide = _rewrite(directory, tmp_path / "wide", config={"moe_intermediate_size": 32})
    with pytest.raises(
        Refusal, match=r"experts\.0\.down_proj\.weight has shape \[48, 24\].*config and the weights"
    ):
        load_model(resolve(str(wide)))


# -- the CLI through Ray ---------------------------------------------------------------------------


def test_the_toy_deepseek_v3_checkpoint_is_read_alike_by_transformers(tmp_path):
    import transformers

    from ster_dist.load.toy import make_toy_model

    make_toy_model(tmp_path / "dsv3", family="deepseek_v3", layers=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "dsv3"), dtype=torch.float32
    )
    loaded = load_model(resolve(str(tmp_path / "dsv3")))
    ids = _ids(seed=3)
    with torch.no_grad():
        assert compare(loaded.model(ids), reference.eval()(ids).logits)["max_relative_error"] < 1e-4
    assert loaded.cfg.moe.topk_method == "noaux_tc" and loaded.cfg.mla is not None


@pytest.mark.slow  # 20-80 s on 2 cores (issue 57: the default suite's budget)
def test_cli_generate_with_ep2_through_ray_equals_one_process(tmp_path):
    """The README's flow: a toy DeepSeek-V3 checkpoint, then `ster generate --ep 2` on a local Ray
    cluster."""
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    directory = tmp_path / "dsv3"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "toy-model",
            str(directory),
            "--family",
            "deepseek_v3",
            "--layers",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert made.returncode == 0, made.stderr
    args = [
        "generate",
        "--model",
        str(directory),
        "--prompt",
        "the capital of France",
        "--max-new-tokens",
        "8",
        "--chat-template",
        "off",
    ]
    runs = [
        subprocess.run(
            [sys.executable, "-m", "ster_dist.cli", *args, *extra],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        for extra in ([], ["--ep", "2"])
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    one, two = (json.loads(run.stdout) for run in runs)
    assert one["text"] == two["text"] and one["completion_tokens"] == two["completion_tokens"] == 8
    assert "in 2 ranks" not in runs[0].stderr and "in 2 ranks" in runs[1].stderr

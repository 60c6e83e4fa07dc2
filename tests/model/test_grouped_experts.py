"""The grouped experts (ster_dist/moe/experts.py) against a plain per-expert reference written here:
random routing that leaves experts empty, one row, many rows, f32 and bf16, GPT-OSS's biases and
clamped SwiGLU, TP rank 0 (adds the down bias) and rank 1 (does not), on every branch of the size
rule: the gathered bmm, grouped_mm where its 16-byte stride rule holds, the per-expert loop where it
does not. Each branch is reached at every row count by setting the module's gather threshold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.moe.experts import Experts
from ster_dist.parallel.ctx import ParallelCtx
from tests.native_kernels import built

ALIGNED = (64, 48)  # hidden, expert width: every stride a multiple of 16 bytes in f32 and bf16
# 21 values are 84 (f32) or 42 (bf16) bytes: grouped_mm refuses, the loop runs
MISALIGNED = (36, 21)


def _experts(hidden, inner, num, dtype, biased, clamped, tp_rank=0, seed=0, gated=True) -> Experts:
    moe = MoEConfig(
        num_experts=num,
        top_k=2,
        intermediate_size=inner,
        expert_bias=biased,
        activation="clamped_swiglu" if clamped else "glu" if gated else "ungated",
        swiglu_limit=1.5,
    )
    experts = Experts(moe, hidden, "silu", ParallelCtx(tp_rank=tp_rank))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts.to(dtype)


def _reference(experts: Experts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row by row, in f32: gate/up, the activation, down, the biases where the module has them."""
    out = []
    for row, e in zip(x.float(), ids.tolist()):
        if experts.gate is None:  # Nemotron-H's: act(up) alone
            out.append(experts.down[e].float() @ experts.act(experts.up[e].float() @ row))
            continue
        gate, up = experts.gate[e].float() @ row, experts.up[e].float() @ row
        if experts.gate_bias is not None:
            gate, up = gate + experts.gate_bias[e].float(), up + experts.up_bias[e].float()
        if experts.clamped:
            gate = gate.clamp(max=experts.limit)
            h = (
                (up.clamp(-experts.limit, experts.limit) + 1)
                * gate
                * torch.sigmoid(experts.alpha * gate)
            )
        else:
            h = F.silu(gate) * up
        y = experts.down[e].float() @ h
        if experts.down_bias is not None and experts.add_down_bias:
            y = y + experts.down_bias[e].float()
        out.append(y)
    return torch.stack(out) if out else x.new_zeros((0, experts.down.shape[1])).float()


# branch -> (hidden, expert width, gather threshold per local expert, rows a CPU runs expert by
# expert)
BRANCHES = {
    "gathered": (*ALIGNED, 1 << 30, 0),
    "grouped": (*ALIGNED, 0, 0),
    "per_expert": (*MISALIGNED, 0, 0),
    "gathered_misaligned": (*MISALIGNED, 1 << 30, 0),
    "per_expert_few": (*ALIGNED, 0, 1 << 30),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("branch", sorted(BRANCHES))
@pytest.mark.parametrize("rows", [0, 1, 3, 200])
@pytest.mark.parametrize("kind", ["glu", "gpt_oss_rank0", "gpt_oss_rank1", "ungated"])
def test_each_branch_equals_per_expert_reference(dtype, branch, rows, kind):
    hidden, inner, gather_bytes, few_rows = BRANCHES[branch]
    num = 8
    biased = clamped = kind.startswith("gpt_oss")
    experts = _experts(
        hidden,
        inner,
        num,
        dtype,
        biased,
        clamped,
        tp_rank=1 if kind == "gpt_oss_rank1" else 0,
        gated=kind != "ungated",
    )
    experts.gather_bytes, experts.few_rows = gather_bytes, few_rows
    experts.kernel_rows = 0  # the eager branches (the experts kernel has a test of its own below)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(dtype)
    # routing over 5 of the 8 experts (three stay empty), shuffled as dispatch from several ranks
    # leaves it
    ids = torch.randint(1, 6, (rows,), generator=torch.Generator().manual_seed(rows + 1))
    if rows:
        assert experts.branch(x) == branch.removesuffix("_misaligned").removesuffix("_few")
    with torch.inference_mode():
        got = experts(x, ids)
    want = _reference(experts, x, ids)
    assert got.shape == (rows, hidden) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = max(1.0, float(want.abs().max())) if rows else 1.0
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale)


def test_the_size_rule_gathers_few_rows_of_small_experts_only():
    """The default thresholds of the eager branches (the experts kernel, where it takes the experts,
    comes before them): one row of 64-wide experts gathers; a CPU decode step of 512 x 512 experts
    (the bench's) runs expert by expert through dense, and prefill rows are grouped."""
    small = _experts(*ALIGNED, 8, torch.float32, biased=False, clamped=False)
    wide = _experts(512, 512, 4, torch.float32, biased=False, clamped=False)
    assert small.branch(torch.zeros(1, ALIGNED[0])) == "gathered"
    assert small.branch(torch.zeros(200, ALIGNED[0])) == "grouped"
    assert wide.branch(torch.zeros(1, 512)) == "per_expert"
    assert wide.branch(torch.zeros(200, 512)) == "grouped"


def test_every_expert_empty_but_one_and_all_experts_busy():
    experts = _experts(*ALIGNED, 4, torch.float32, biased=True, clamped=False)
    experts.gather_bytes = 0
    x = torch.randn(64, ALIGNED[0], generator=torch.Generator().manual_seed(5))
    for ids in (torch.full((64,), 3), torch.arange(64) % 4):
        with torch.inference_mode():
            torch.testing.assert_close(
                experts(x, ids), _reference(experts, x, ids), rtol=1e-4, atol=1e-4
            )


def test_a_strided_weight_view_is_judged_by_its_strides():
    """A gate that is a view into a wider tensor (a fused gate/up, say) is grouped when its strides
    allow, and falls back when they do not."""
    experts = _experts(*ALIGNED, 4, torch.float32, biased=False, clamped=False)
    experts.gather_bytes = experts.few_rows = experts.kernel_rows = 0
    x = torch.randn(5, ALIGNED[0])
    ids = torch.tensor([0, 2, 2, 3, 0])
    want = _reference(experts, x, ids)
    for pad in (4, 1):  # 4 f32 columns keep 16-byte strides, 1 does not
        wide = torch.zeros(4, ALIGNED[1], ALIGNED[0] + pad)
        wide[..., : ALIGNED[0]] = experts.gate.data
        experts.gate.data = wide[..., : ALIGNED[0]]
        assert experts.branch(x) == ("grouped" if pad == 4 else "per_expert")
        with torch.inference_mode():
            torch.testing.assert_close(experts(x, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 40])
def test_few_rows_of_swiglu_experts_run_in_the_kernel_as_the_python_loop_does(
    dtype, rows, monkeypatch
):
    """Rows to plain SwiGLU experts go to kernels/experts.cpp in one call: the per-expert loop's
    result (each product, the activation and the gating rounded to the dtype as the loop rounds
    them), rows sharing an expert or not, an expert's rows eight at a time (40 rows give expert 5
    fifteen); a biased or clamped kind keeps the loop."""
    built("swiglu_experts", "the loop runs")
    experts = _experts(*ALIGNED, 8, dtype, biased=False, clamped=False, seed=rows)
    experts.gather_bytes = 0  # past the gather: the CPU's few-row branch
    x = torch.randn(rows, ALIGNED[0], generator=torch.Generator().manual_seed(rows)).to(dtype)
    ids = torch.tensor([3, 5, 3, 0, 7, 5, 5, 1] * 5)[:rows]
    assert experts.branch(x) == "per_expert" and experts.fused(x)
    with torch.inference_mode():
        got = experts(x, ids)
        # the Python loop, through dense's products
        monkeypatch.setattr(Experts, "fused", lambda self, x: False)
        want = experts(x, ids)
    # the loop's products of nine rows or more take another kernel, which sums in another order
    if rows > 8:
        torch.testing.assert_close(
            got.float(),
            want.float(),
            **(
                {"rtol": 1e-5, "atol": 1e-5}
                if dtype == torch.float32
                else {"rtol": 1e-2, "atol": 1e-2}
            ),
        )
    elif dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # exp may differ from torch's in its last f32 bit, which bf16 rounding almost always hides
    else:
        assert (got != want).float().mean() < 0.02
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    monkeypatch.undo()
    assert not _experts(*ALIGNED, 8, dtype, biased=True, clamped=True).fused(x)


def test_the_experts_kernel_takes_f32_rows_up_to_its_limit_and_bf16_rows_where_the_cpu_widens_them():
    """Past KERNEL_ROWS_MAX f32 rows grouped_mm's blocked products are ahead; bf16 rows go to the
    kernel at any count on a CPU without bf16 products (grouped_mm widens every matrix on every call
    there), the limit elsewhere."""
    from ster_dist.moe.experts import KERNEL_ROWS_MAX
    from ster_dist.parallel.linear import NATIVE_HALF_PRODUCTS

    built("swiglu_experts", "the eager branches run")
    for dtype in (torch.float32, torch.bfloat16):
        experts = _experts(*ALIGNED, 8, dtype, biased=False, clamped=False)
        most = (
            KERNEL_ROWS_MAX
            if dtype == torch.float32 or NATIVE_HALF_PRODUCTS
            else 4 * KERNEL_ROWS_MAX
        )
        assert experts.fused(torch.zeros(most, ALIGNED[0], dtype=dtype))
        assert experts.fused(torch.zeros(most + 1, ALIGNED[0], dtype=dtype)) == (
            most > KERNEL_ROWS_MAX
        )
        assert not experts.fused(torch.zeros(0, ALIGNED[0], dtype=dtype))
        x = torch.randn(most + 1, ALIGNED[0], generator=torch.Generator().manual_seed(3)).to(dtype)
        ids = torch.randint(0, 8, (most + 1,), generator=torch.Generator().manual_seed(4))
        with torch.inference_mode():
            got = experts(x, ids)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        want = _reference(experts, x, ids)
        torch.testing.assert_close(
            got.float(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()))
        )

"""This rank's experts, stacked: gate and up [local experts, intermediate share, hidden], down
[local experts, hidden, intermediate share] (no gate for Nemotron-H's ungated experts), and
GPT-OSS's biases; and the one grouped computation that runs every row through its expert.

Experts are split in contiguous blocks over the expert-parallel group; within
each expert the matrices are split over the tensor-parallel group like a dense
feed-forward (gate/up by output rows, down by input columns), so the output is
a partial sum the MoE layer all-reduces once, together with the shared experts.

Rows are sorted by expert and each projection is one `grouped_mm` over the
stacked weights with the running row counts as offsets: no per-expert Python
loop and no host sync (the offsets stay a tensor). The size rule, measured with
`bench/moe.py --ab-only` (the loop, grouped and gathered variants interleaved):
- grouped_mm by default, at decode's handful of rows and prefill's hundreds
  alike: it reads each selected expert's weights once, as the per-expert loop
  did, without the loop's Python overhead per expert or its host sync. At
  16 experts of 512 x 512 (f32, one thread) it ran the experts 1.1-1.2x as
  fast as the loop from 8 rows up, 1.05-1.1x at prefill, about even at 4 rows
  and 0.8-0.95x at 2: torch's CPU grouped_mm walks every group (a slice, an
  offset read and an mm each, empty or not), which costs more than the loop's
  Python for one or two busy experts. Kept there for the missing host sync.
- Gathering each row's expert weights into one bmm per projection, while the
  rows are few and the experts small: rows x one expert's three matrices at
  most GATHER_BYTES x local experts. grouped_mm's CPU kernel spends about
  1.5 us on every group, empty or not, per projection, which tiny experts at
  decode feel (64 local experts of 128 x 64 at 8 rows: gathered 0.7x the time);
  the gather copies what it reads, so once the copy outweighs the empty groups
  it loses, 3-5x at 16 experts of 512 x 512 for 2-16 rows.
- On a CPU, a decode's few rows (at most SPLIT_ROWS_MAX) run the per-expert
  loop through `dense`, whose row-block batched product streams each busy
  expert's f32 weights on every thread (parallel/linear.py): grouped_mm's CPU
  kernel runs one mm per group, and reading the counts costs nothing where
  there is no device to wait for.
- grouped_mm refuses strides that are not multiples of 16 bytes (an odd
  hidden size or intermediate share: tiny test models, uneven TP shares);
  past the gather's size those layouts run the per-expert loop, which takes
  any shape.
- Before that rule: where the rows (on a CPU, at most KERNEL_ROWS_MAX in f32, any number in bf16
  without bf16 products) go to plain SwiGLU experts of f32 or bf16 and the package's kernels are
  built, the whole feed-forward is one call of `swiglu_experts` (kernels/experts.cpp): each busy
  expert's rows together, eight at a time, through gate, up, silu and down in C++, with no sort,
  loop or scatter in Python (KERNEL_ROWS_MAX's comment has the measurements). Its output's shape
  follows from x's whatever the routing, so a compiled step traces it (model/compiled.py); every
  other branch reaches a compiled step as one opaque operator, `ster_dist::routed_experts` (end of
  this module), and runs eagerly inside it.
- Experts kept in FP8 (`--weights fp8`) always run the per-expert loop: each
  busy expert's matrices go through `dense` as FP8 with their block scales,
  so only the experts a step uses are dequantized (or multiplied in FP8),
  one matrix at a time, and the stack is never widened.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ster_dist import kernels
from ster_dist.config import MoEConfig
from ster_dist.kernels import select
from ster_dist.layers.activation import activation
from ster_dist.moe.triton_experts import triton_experts
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.fp8 import Fp8Weight
from ster_dist.parallel.linear import NATIVE_HALF_PRODUCTS, SPLIT_ROWS_MAX, ShardedModule, dense

# rows [m, in] and a stacked weight [experts, out, in] -> each row times its expert's weight, [m,
# out]
# (a kept FP8 stack runs the per-expert projection only)
Project = Callable[[torch.Tensor, torch.Tensor | Fp8Weight], torch.Tensor]

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUPED_ALIGN = 16  # bytes: grouped_mm's rule for every non-unit stride of its operands and output
# the gather copies rows x an expert's three matrices; grouped_mm pays ~3 x 1.5 us per local expert:
# at a
# few GB/s the two cross near 10-20 KiB of copy per local expert (the module docstring's
# measurements)
GATHER_BYTES = 16 * 1024
# the experts kernel against grouped_mm on a CPU (bench/moe.py's experts: 16 of 512 x 512, 6 layers,
# 2 threads,
# AVX2): f32 3.0x as fast at 64 rows, 2.1x at 128, even at 512, 0.79x at 2048; bf16 2.7-2.9x from 64
# to 2048 rows
# where the CPU has no bf16 products (grouped_mm widens every group's matrices on every call there)
KERNEL_ROWS_MAX = 512


def kernel_rows(dtype: torch.dtype) -> int:
    """The most rows the experts kernel takes where it takes the experts (the measurements
    above)."""
    return 1 << 62 if dtype == torch.bfloat16 and not NATIVE_HALF_PRODUCTS else KERNEL_ROWS_MAX


class Experts(ShardedModule):
    fp8_params = ("gate", "up", "down")

    def __init__(
        self, moe: MoEConfig, hidden: int, hidden_act: str, ctx: ParallelCtx, glu_limit: float = 0.0
    ):
        """glu_limit: min(act(gate), L) * clamp(up, +-L) when not 0 (Step 3.5's clamped layers)."""
        super().__init__()
        self.glu_limit = glu_limit
        num, inner = moe.num_experts, moe.intermediate_size
        self.first, last = ctx.experts(num)
        self.local = last - self.first
        rows = (ctx.split(inner),)
        block = (self.first, last)
        if moe.activation == "ungated":  # Nemotron-H's experts: act(up x), no gate
            self.gate = None
        else:
            self._param("gate", Shard((num, inner, hidden), 1, rows, experts=block))
        self._param("up", Shard((num, inner, hidden), 1, rows, experts=block))
        self._param("down", Shard((num, hidden, inner), 2, rows, experts=block))
        if moe.expert_bias:
            self._param("gate_bias", Shard((num, inner), 1, rows, experts=block))
            self._param("up_bias", Shard((num, inner), 1, rows, experts=block))
            self._param("down_bias", Shard((num, hidden), experts=block))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.clamped = moe.activation == "clamped_swiglu"
        self.limited = moe.activation == "limited_swiglu" and moe.swiglu_limit > 0
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.act = activation(hidden_act)
        self.add_down_bias = ctx.tp_rank == 0  # the partial sums are all-reduced: add the bias once
        self.gather_bytes = GATHER_BYTES  # per local expert: the size rule's threshold
        # on a CPU, at most this many rows run expert by expert through dense
        self.few_rows = SPLIT_ROWS_MAX
        # the most rows for the experts kernel (None: kernel_rows(dtype))
        self.kernel_rows: int | None = None

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each row of x [rows, hidden] through its expert (local_ids [rows], 0-based on this
        rank)."""
        if select.chosen() == "triton" and (y := triton_experts(self, x, local_ids)) is not None:
            return y  # moe/triton_experts.py
        # traced into a compiled step as it is: one operator, whatever the routing
        if self.fused(x):
            return torch.ops.ster_kernels.swiglu_experts(
                x, local_ids.long(), self.gate, self.up, self.down
            )
        # every other branch reads the routing: opaque to the trace
        if torch.compiler.is_compiling():
            return torch.ops.ster_dist.routed_experts(x, local_ids, self.up)
        return self._routed(x, local_ids)

    # never traced: which rows go to which expert changes every step, and a trace would specialise
    # on it; torch's
    # fake grouped_mm also takes bf16 alone on a CPU. A compiled step reaches it through
    # routed_experts (below).
    @torch.compiler.disable
    def _routed(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.down.shape[1]))
        branch = self.branch(x)
        if branch == "gathered":
            return self._mlp(x, local_ids, self._gathered(local_ids))
        order = torch.argsort(local_ids, stable=True)
        ids = local_ids[order]
        # expert e's rows are [ends[e-1], ends[e]); searchsorted, unlike bincount, sizes its output
        # without reading the ids on the host (bincount on CUDA syncs for their maximum)
        experts = torch.arange(self.local, device=ids.device, dtype=ids.dtype)
        ends = torch.searchsorted(ids, experts, right=True, out_int32=True)
        project = self._grouped(ends) if branch == "grouped" else self._per_expert(ends)
        y = self._mlp(x[order], ids, project)
        out = torch.empty_like(y)
        out[order] = y
        return out

    def branch(self, x: torch.Tensor) -> str:
        """The size rule (module docstring): "gathered", "grouped" or "per_expert" for these
        rows."""
        if self.fp8:
            return "per_expert"
        matrices = self._weights()
        expert_bytes = sum(w[0].numel() for w in matrices) * x.element_size()
        if x.shape[0] * expert_bytes <= self.local * self.gather_bytes:
            return "gathered"
        if x.device.type == "cpu" and x.shape[0] <= self.few_rows:
            return "per_expert"
        return "grouped" if self.groupable(x) else "per_expert"

    def fused(self, x: torch.Tensor) -> bool:
        """Whether these rows run in one call of the experts kernel (kernels/experts.cpp): 1 to
        `kernel_rows` rows of
        the weights' dtype, to experts of the kind it takes (`kernel_takes`)."""
        most = self.kernel_rows if self.kernel_rows is not None else kernel_rows(x.dtype)
        return 0 < x.shape[0] <= most and self.kernel_takes() and x.dtype == self.up.dtype

    def kernel_takes(self) -> bool:
        """Whether the experts kernel takes these experts: plain SwiGLU (silu, no biases or clamps,
        not kept in FP8), contiguous weights of one dtype, f32 or bf16, on a CPU, with the package's
        kernels built."""
        if self.fp8 or self.gate is None or self.gate_bias is not None or self.act is not F.silu:
            return False
        if self.clamped or self.limited or self.glu_limit:
            return False
        weights = self._weights()
        dtype = weights[0].dtype
        return (
            weights[0].device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and all(w.dtype == dtype and w.is_contiguous() for w in weights)
            and kernels.ready()
        )

    def groupable(self, x: torch.Tensor) -> bool:
        """Whether grouped_mm takes this layout: its devices and dtypes, and every non-unit stride
        of its operands and outputs a multiple of 16 bytes (the rows and outputs are contiguous
        [rows, hidden or inner share]; each weight is read transposed, so its two outer strides
        count)."""
        # meta: shapes only, as a CUDA device would run them
        if x.device.type not in ("cpu", "cuda", "meta"):
            return False
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
            return False  # grouped_mm's CUDA kernels start at SM80
        weights = self._weights()
        if x.dtype not in GROUPED_DTYPES or any(
            w.dtype != x.dtype or w.stride(-1) != 1 for w in weights
        ):
            return False
        # the CUDA kernels' one dtype (torch's meta checks)
        if x.device.type != "cpu" and x.dtype != torch.bfloat16:
            return False
        strides = [
            self.up.shape[1],
            self.down.shape[1],
            *(s for w in weights for s in w.stride()[:2]),
        ]
        return all(s * x.element_size() % GROUPED_ALIGN == 0 for s in strides)

    def _mlp(self, x: torch.Tensor, ids: torch.Tensor, project: Project) -> torch.Tensor:
        """The experts' feed-forward on rows (ids [rows]: each row's expert, in the order project
        wants)."""
        if self.gate is None:  # ungated: act(up) alone
            return self._down(project, self.act(project(x, self.matrix("up"))), ids)
        gate, up = project(x, self.matrix("gate")), project(x, self.matrix("up"))
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias[ids], up + self.up_bias[ids]
        # GPT-OSS: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
        if self.clamped:
            gate = gate.clamp(max=self.limit)
            h = (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))
        elif self.limited:  # HY V4: act(min(gate, limit)) * clamp(up, +-limit)
            h = self.act(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)
        elif self.glu_limit:
            h = self.act(gate).clamp(max=self.glu_limit) * up.clamp(-self.glu_limit, self.glu_limit)
        else:
            h = self.act(gate) * up
        return self._down(project, h, ids)

    def _down(self, project: Project, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        y = project(h, self.matrix("down"))
        if self.down_bias is not None and self.add_down_bias:
            y = y + self.down_bias[ids]
        return y

    def _weights(self) -> tuple[torch.Tensor, ...]:
        return tuple(w for w in (self.gate, self.up, self.down) if w is not None)

    @staticmethod
    def _gathered(ids: torch.Tensor) -> Project:
        return lambda rows, weight: torch.bmm(weight[ids], rows.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def _grouped(ends: torch.Tensor) -> Project:
        return lambda rows, weight: F.grouped_mm(rows, weight.transpose(1, 2), offs=ends)

    @staticmethod
    def _per_expert(ends: torch.Tensor) -> Project:
        # a host sync where there is a device: on the layouts grouped_mm refuses only
        bounds = ends.tolist()

        def project(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            out = rows.new_empty((rows.shape[0], weight.shape[1]))
            start = 0
            for e, stop in enumerate(bounds):
                if stop > start:
                    out[start:stop] = dense(rows[start:stop], weight[e])
                start = stop
            return out

        return project


# -- inside a compiled step
# -----------------------------------------------------------------------------------
# The branches a compiled step cannot trace run behind one custom operator, as attention does
# (model/compiled.py):
# its output's shape is its input's, so the layer's graph does not split around the experts (a split
# had made
# compiled decode slower than eager, and a split graph's guards stop at the split). The operator
# finds its
# Experts by the data of their `up` stack, which a compiled model registers before it traces
# (`trace_experts`).

_TRACED: "weakref.WeakValueDictionary[int, Experts]" = weakref.WeakValueDictionary()

_LIBRARY = torch.library.Library("ster_dist", "FRAGMENT")
_LIBRARY.define("routed_experts(Tensor x, Tensor ids, Tensor up) -> Tensor")


def trace_experts(model: torch.nn.Module) -> None:
    """Register every Experts in `model` for routed_experts."""
    for experts in model.modules():
        if isinstance(experts, Experts):
            _TRACED[experts.up.data_ptr()] = experts


def traced(registry: weakref.WeakValueDictionary, up: torch.Tensor, experts_of=lambda found: found):
    """The module registered in `registry` under the data of `up` (its Experts' stack:
    `experts_of(module)`),
    refused when none is, or when the one found holds another stack now (its weights were replaced
    since)."""
    found = registry.get(up.data_ptr())
    if found is None or experts_of(found).up.data_ptr() != up.data_ptr():
        raise RuntimeError(
            "these experts were not registered for compiled steps "
            "(model/compiled.py registers a model's before it traces)"
        )
    return found


def _routed_experts(x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return traced(_TRACED, up)._routed(x, ids)


_LIBRARY.impl("routed_experts", _routed_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("ster_dist::routed_experts")
def _(x: torch.Tensor, ids: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # the experts work in x's width: down is [experts, width, inner share]
    return x.new_empty(x.shape)

"""Tensor-parallel layers. Each takes global sizes and a ParallelCtx and records,
per parameter, the Shard of the global tensor it holds; the loader reads exactly that.

Column- and row-parallel projections also carry the low-rank adapters attached to them at run
time (adapters/attach.py), each already cut to this rank's share: a column-parallel projection
holds A whole and its own rows of B, a row-parallel one its own columns of A and B whole.

A module names the parameters it can hold as FP8 (`fp8_params`); under `--weights fp8` the loader
keeps those in FP8 beside their block scales (parallel/fp8.py) and `matrix(name)` hands `dense` the
pair. Those it names in `ggml_params` may be kept in a .gguf's own blocks (parallel/ggml.py):
`matrix(name)` then hands over a BlockWeight, which `dense` multiplies through and the embedding
looks rows up in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ster_dist.events import progress
from ster_dist import kernels
from ster_dist.parallel import packed
from ster_dist.parallel.ctx import ParallelCtx, Shard
from ster_dist.parallel.fp8 import Fp8Weight, blockwise_ok, scaled_product
from ster_dist.parallel.ggml import BlockWeight, block_product
from ster_dist.parallel.triton_fp8 import triton_product


class ShardedModule(nn.Module):
    """A module whose parameters carry Shards (global shape and this rank's ranges)."""

    # parameters whose every use goes through matrix(): FP8 may be kept
    fp8_params: tuple[str, ...] = ()
    # parameters whose every use goes through matrix(): GGML blocks may be kept
    ggml_params: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.shards: dict[str, Shard] = {}
        # kept FP8 parameters: name -> (row group sizes, col group sizes, compute dtype); the scales
        # are the
        # buffers `<name>_scale`, so they follow the module to its device and count among its
        # tensors
        self.fp8: dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        # kept GGML blocks: name -> (kind, columns, compute dtype); the parameter holds the stored
        # bytes
        self.ggml: dict[str, tuple[str, int, torch.dtype]] = {}

    def _param(self, name: str, shard: Shard, dtype: torch.dtype | None = None) -> None:
        self.shards[name] = shard
        self.register_parameter(
            name, nn.Parameter(torch.empty(shard.local_shape(), dtype=dtype), requires_grad=False)
        )

    def keep_fp8(
        self,
        name: str,
        scale: torch.Tensor,
        rows: tuple[int, ...],
        cols: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        """Parameter `name` (already FP8) is kept: `scale` [..., len(rows), len(cols)] scales its
        groups."""
        self.register_buffer(f"{name}_scale", scale, persistent=False)
        self.fp8[name] = (rows, cols, dtype)

    def keep_blocks(self, name: str, kind: str, cols: int, dtype: torch.dtype) -> None:
        """Parameter `name` (already uint8, a .gguf's stored bytes) is kept in GGML blocks of
        `kind`."""
        self.ggml[name] = (kind, cols, dtype)

    def matrix(self, name: str = "weight") -> torch.Tensor | Fp8Weight | BlockWeight:
        """What `dense` multiplies by: the parameter, or the kept FP8 matrix with its scales, or the
        kept blocks."""
        if name in self.ggml:
            return BlockWeight(getattr(self, name), *self.ggml[name])
        if name not in self.fp8:
            return getattr(self, name)
        rows, cols, dtype = self.fp8[name]
        return Fp8Weight(getattr(self, name), getattr(self, f"{name}_scale"), rows, cols, dtype)

    def plain(self, name: str = "weight") -> torch.Tensor:
        """The parameter as a tensor of its compute dtype (a kept FP8 one dequantized: for uses
        other than a product, such as MLA's absorbed key and value halves)."""
        held = self.matrix(name)
        return held.dequantize() if isinstance(held, (Fp8Weight, BlockWeight)) else held

    def dtype_of(self, name: str = "weight") -> torch.dtype:
        """The dtype the parameter computes in (an adapter beside a kept FP8 weight is made in
        it)."""
        if name in self.ggml:
            return self.ggml[name][2]
        return self.fp8[name][2] if name in self.fp8 else getattr(self, name).dtype


def fused_runs(root: nn.Module) -> list[list[nn.Parameter]]:
    """Every run of parameters a FusedColumns joins (FusedColumns.runs), for the loader to lay out
    together."""
    return [
        run
        for module in root.modules()
        if isinstance(module, FusedColumns)
        for run in module.runs()
    ]


def module_shards(root: nn.Module) -> dict[str, Shard]:
    """Every parameter's name (as root.named_parameters() names it) and Shard, over root's
    ShardedModules. A parameter tied to another (tie_parameters) is listed once, under its first
    name, as named_parameters lists it."""
    out: dict[str, Shard] = {}
    seen: set[int] = set()
    for prefix, module in root.named_modules():
        if isinstance(module, ShardedModule):
            for name, shard in module.shards.items():
                param = module._parameters.get(name)
                if param is not None:
                    if id(param) in seen:
                        continue
                    seen.add(id(param))
                out[f"{prefix}.{name}" if prefix else name] = shard
    return out


def tie_parameters(module: nn.Module, owner: nn.Module) -> None:
    """Make every parameter of `module` the very tensor of the same name in `owner`, a module built
    alike (Zamba2's shared transformer block, one set of weights used by several layers): read once,
    held once."""
    mine, theirs = dict(module.named_modules()), dict(owner.named_modules())
    for name, sub in mine.items():
        if isinstance(sub, ShardedModule):
            for param in sub.shards:
                sub._parameters[param] = theirs[name]._parameters[param]


def tied_parameters(root: nn.Module) -> list[tuple[nn.Module, str, str, str]]:
    """(module, attribute, its own name, the name it is first listed under) of every tied copy of a
    parameter, so a loader can drop the copies before allocating and put the filled tensor back
    after."""
    first: dict[int, str] = {}
    copies = []
    for prefix, module in root.named_modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if id(param) in first:
                copies.append((module, name, full, first[id(param)]))
            else:
                first[id(param)] = full
    return copies


class LowRank:
    """An attached adapter: (x @ a^T) @ b^T * scale added to a projection's output, this rank's
    share."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        self.a, self.b, self.scale = a, b, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x -> rank -> outputs, as PEFT computes it: the dense outputs x inputs product is never
        # built
        return F.linear(F.linear(x, self.a), self.b) * self.scale


def low_rank_share(
    a: torch.Tensor, b: torch.Tensor, shard: Shard
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's adapter factors for a projection holding `shard` of its weight."""
    if shard.dim == 0:  # output rows split: B's rows follow them, A is whole
        b = torch.cat([b[s:e] for s, e in shard.ranges])
    elif shard.dim == 1:  # input columns split: A's columns follow them, B is whole
        a = torch.cat([a[:, s:e] for s, e in shard.ranges], dim=1)
    return a.contiguous(), b.contiguous()


# A product of few rows (decode) with an f32 weight on a CPU runs as one batched product over as
# many row
# blocks of the weight as there are threads: MKL's matrix-vector kernel on a non-Intel AVX2 CPU
# streams the
# weight at about half the bandwidth the same product reaches split into a batch whose items run on
# separate
# cores (bench/decode.py measures it; bf16 weights already reach oneDNN's kernel and are left to
# F.linear).
# Where oneDNN is built in, products of ONEDNN_ROWS_MIN rows or more go to it first (below).
SPLIT_ROWS_MAX = 64


# f32 products of 8 rows or more on a CPU go to oneDNN's matmul, which takes the weight as it is
# stored: on an
# AMD AVX-512 CPU it ran 1.6x MKL's at 8 rows and 1.4x at 256 (SmolLM2's shapes, bench/decode.py);
# F.linear
# reaches MKL there, whose kernels for non-Intel CPUs are slower.
ONEDNN_ROWS_MIN = 8
ONEDNN_F32 = torch.backends.mkldnn.is_available()


@torch.library.custom_op("ster_dist::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # an operator of our own, so a compiled step calls the kernels as they are: inductor lowers
    # mkldnn's op only
    # for weights frozen into the graph, and a layer's weights are the graph's inputs
    # (model/compiled.py).
    # Its body runs on the real weight in either case, so it finds the weight's packed copy
    # (parallel/packed.py).
    held = packed.lookup(weight)
    if held is not None and held.panels:
        return torch.ops.ster_kernels.panel_product(x, held.tensor, bias, weight.shape[0])
    # bf16 on a CPU without bf16 products: in f32 over the f32 copy
    if held is not None and held.widened:
        wide = torch.ops.mkldnn._linear_pointwise(
            x.float(), held.tensor, None if bias is None else bias.float(), "none", [], ""
        )
        return wide.to(x.dtype)
    if held is None and x.dtype != torch.float32 and not NATIVE_HALF_PRODUCTS:
        # a weight not packed (the body is eager: its product is dense()'s)
        return _upcast(x, weight, bias)
    if (
        held is None
        and x.numel() <= kernels.FEW_ROWS_MAX * x.shape[-1]
        and _few_rows_fit(x, weight, bias)
    ):
        # a weight not packed: as dense() would
        return torch.ops.ster_kernels.few_rows(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(
        x, weight if held is None else held.tensor, bias, "none", [], ""
    )


@cpu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _keep_for_backward(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _onednn_backward(ctx, grad: torch.Tensor):
    # F.linear's gradients: a product with gradients takes the same forward kernel as one without
    x, weight = ctx.saved_tensors
    rows = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if ctx.needs_input_grad[0] else None
    grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


cpu_linear.register_autograd(_onednn_backward, setup_context=_keep_for_backward)


# bf16 / f16 products of many rows (prefill) on a CPU whose instructions lack a native bf16 product
# (AVX2 and
# below: oneDNN's bf16 kernels need AVX-512 or AVX-NE-CONVERT) run in f32 over an upcast copy of the
# weight, a
# block of rows at a time: torch's fallback bf16 kernel there reads a 256-token prompt about 5x
# slower than f32.
# The products are exact in f32 either way; only the rounding of the sums' order differs.
# (9-15 rows through torch's bf16 kernel: 1.7x slower than upcast)
UPCAST_ROWS_MIN = kernels.FEW_ROWS_MAX + 1
UPCAST_BLOCK = 1 << 22  # weight elements upcast at once (16 MiB of f32): the copy stays in cache
NATIVE_HALF_PRODUCTS = packed.NATIVE_HALF_PRODUCTS


# devices whose blockwise scaled_mm refused once: dequantize there after
_blockwise_failed: set[str] = set()


def dense(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight | BlockWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b) through the kernel that streams W fastest for x's shape; a kept FP8 W through
    blockwise scaled_mm where the device has it, else dequantized for this product alone
    (parallel/fp8.py); kept GGML blocks through their own kernel (parallel/ggml.py)."""
    if isinstance(weight, BlockWeight):
        return block_product(x, weight, bias)
    if isinstance(weight, Fp8Weight):
        # --kernels triton (parallel/triton_fp8.py)
        if (y := triton_product(x, weight, bias)) is not None:
            return y
        where = str(x.device)
        if where not in _blockwise_failed and blockwise_ok(x, weight):
            try:
                return scaled_product(x, weight, bias)
            # no such kernel: say so once
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
                _blockwise_failed.add(where)
                progress(
                    f"blockwise FP8 scaled_mm is not available on {where} ({str(error).splitlines()[0]}); "
                    "FP8 weights are dequantized per product there"
                )
        weight = weight.dequantize()  # to its compute dtype, as a dequantizing load holds it
    inner = x.shape[-1]
    rows = x.numel() // inner if inner else 0
    if rows and packed.active() and kernels.panels(weight.dtype) and _few_rows_fit(x, weight, bias):
        # its panels, where the engine made them
        return torch.ops.ster_kernels.packed_product(x, weight, bias)
    if (
        rows >= packed.ROWS_MIN
        and packed.active()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
    ):
        if kernels.ready() and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        ):
            # its packed copy, where the engine made one, found in C++: through cpu_linear's Python
            # body the
            # lookup cost 10% of a 12- or 32-row step's products on an AVX2 CPU (bench/products.py)
            return torch.ops.ster_kernels.packed_product(x, weight, bias)
        return torch.ops.ster_dist.cpu_linear(x, weight, bias)  # the same, with a backward
    if (
        rows >= UPCAST_ROWS_MIN
        and not NATIVE_HALF_PRODUCTS
        and x.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and inner
    ):
        return _upcast(x, weight, bias)
    if 0 < rows <= kernels.FEW_ROWS_MAX and _few_rows_fit(x, weight, bias):
        return torch.ops.ster_kernels.few_rows(x, weight, bias)
    if (
        rows == 1
        and torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
    ):
        return _one_row_widening(x, weight, bias)
    if (
        rows >= ONEDNN_ROWS_MIN
        and ONEDNN_F32
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
    ):
        return torch.ops.ster_dist.cpu_linear(x, weight, bias)
    parts = _threads()
    if (
        0 < rows <= SPLIT_ROWS_MAX
        and parts > 1
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.shape[0] % parts == 0
        and weight.is_contiguous()
    ):
        out = weight.shape[0]
        y = torch.bmm(
            weight.view(parts, out // parts, inner),
            x.reshape(rows, inner).t().expand(parts, inner, rows),
        )
        y = y.view(out, rows).t().reshape(*x.shape[:-1], out)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _few_rows_fit(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
        and not (x.requires_grad or weight.requires_grad)
        and kernels.ready()
    )


@torch._dynamo.assume_constant_result
def _threads() -> int:
    # a constant to a compiled step (model/compiled.py): its graph is built for the thread count it
    # was traced at
    return torch.get_num_threads()


def _one_row_widening(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # A bf16 / f16 product of one row inside a compiled step: traced, this is inductor's own loop
    # over the
    # weight's rows, widening each to f32 as it reads it, fused with the norm before and the
    # activation after.
    # At one row oneDNN repacks the weight on every call (brgemm's copy_b_chunk_in_buffer in a
    # profile) and
    # reads it at 8-11 GB/s on an AVX-512 CPU, against 17-20 GB/s for this loop (a SmolLM2 bf16
    # decode step,
    # its head still through oneDNN: 49-52 -> 25-29 ms). Eagerly it would build the whole widened
    # product, so
    # eager steps keep F.linear.
    y = (weight.float() * x.reshape(1, x.shape[-1]).float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def _upcast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    wide = x.float()
    step = max(1, UPCAST_BLOCK // inner) if (inner := weight.shape[1]) else weight.shape[0]
    parts = [
        dense(
            wide, weight[i : i + step].float(), None if bias is None else bias[i : i + step].float()
        )
        for i in range(0, weight.shape[0], step)
    ]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(x.dtype)


class ColumnLinear(ShardedModule):
    """y = x W^T (+ b) with W's output rows split: this rank holds `rows` (ranges of global
    rows)."""

    fp8_params = ("weight",)
    ggml_params = ("weight",)

    def __init__(
        self, in_features: int, out_features: int, rows: tuple[tuple[int, int], ...], bias: bool
    ):
        super().__init__()
        self._param("weight", Shard((out_features, in_features), 0, rows))
        if bias:
            self._param("bias", Shard((out_features,), 0, rows))
        else:
            self.bias = None
        self.adapters: list[LowRank] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.matrix(), self.bias)
        for adapter in self.adapters:
            y = y + adapter(x)
        return y


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along their first dimension: a view where they already lie back to
    back in one storage (the loader's arena lays fused parts out so), a copy otherwise."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if not (
            t.is_contiguous()
            and t.dtype == first.dtype
            and t.shape[1:] == first.shape[1:]
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and t.storage_offset() == offset
        ):
            return torch.cat(tensors)
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.as_strided(
        shape, torch.empty(shape, device="meta").stride(), first.storage_offset()
    )


class FusedColumns(nn.Module):
    """Column-parallel projections of one input (q, k, v; gate, up) as one product over a weight
    holding their rows one part after another. Each part keeps its own parameters as views of the
    fused ones, so the loader, the name map, adapters and capture still see the parts; before fuse()
    (a model on the meta device, or one being filled) each part runs alone. Parts kept in FP8 stay
    unfused: each runs its own product through its own scales (rows of parts concatenate, but their
    scale groups would line up only where every part's rows are whole blocks)."""

    def __init__(self, *parts: ColumnLinear | None):
        super().__init__()
        self.parts = tuple(parts)  # a tuple: the parts stay registered where their owner put them
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.sizes: list[int] = []
        # the parts' kept blocks: (kind, columns, dtype)
        self.ggml: tuple[str, int, torch.dtype] | None = None

    def runs(self) -> list[list[nn.Parameter]]:
        """The parameters fuse() joins, each list in order: laid out back to back (shard/arena.py),
        they join as a view rather than a copy."""
        parts = [p for p in self.parts if p is not None]
        if len(parts) < 2:
            return []
        return [[p.weight for p in parts]] + (
            [[p.bias for p in parts]] if parts[0].bias is not None else []
        )

    def fuse(self, done: dict | None = None) -> None:
        """Put the parts' weights (and biases) into one tensor and make each part's a view of it.
        `done`
        maps parts already fused elsewhere (a block several layers share, tie_parameters) to their
        fused module, whose tensors this one then shares: tied parts stay one tensor."""
        parts = [p for p in self.parts if p is not None]
        if self.weight is not None or len(parts) < 2 or any(p.weight.is_meta for p in parts):
            return
        if len({p.bias is None for p in parts}) > 1 or len({p.weight.dtype for p in parts}) > 1:
            return
        if any(p.fp8 for p in parts):
            return
        kept = {p.ggml.get("weight") for p in parts}
        # blocks of one kind and width join as rows do; anything else runs part by part
        if len(kept) > 1:
            return
        self.ggml = next(iter(kept))
        key = tuple(id(p.weight) for p in parts)
        if done is not None and key in done:
            donor = done[key]
            self.sizes, self.weight, self.bias, self.ggml = (
                donor.sizes,
                donor.weight,
                donor.bias,
                donor.ggml,
            )
            for part, twin in zip(parts, [p for p in donor.parts if p is not None]):
                part.weight, part.bias = twin.weight, twin.bias
            return
        self.sizes = [p.weight.shape[0] for p in parts]
        self.weight = joined([p.weight.detach() for p in parts])
        for part, view in zip(parts, self.weight.split(self.sizes)):
            part.weight = nn.Parameter(view, requires_grad=False)
        if parts[0].bias is not None:
            self.bias = joined([p.bias.detach() for p in parts])
            for part, view in zip(parts, self.bias.split(self.sizes)):
                part.bias = nn.Parameter(view, requires_grad=False)
        if done is not None:
            done[key] = self

    def forward(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Each part's output (None for a part that is None), as each part alone would give it."""
        if self.weight is None:
            return [p(x) if p is not None else None for p in self.parts]
        weight = self.weight if self.ggml is None else BlockWeight(self.weight, *self.ggml)
        outputs = iter(dense(x, weight, self.bias).split(self.sizes, dim=-1))
        result = []
        for part in self.parts:
            if part is None:
                result.append(None)
                continue
            y = next(outputs)
            for adapter in part.adapters:
                y = y + adapter(x)
            result.append(y)
        return result


class RowLinear(ShardedModule):
    """y = all_reduce(x_local W_local^T) + b with W's input columns split; the bias is added
    once."""

    fp8_params = ("weight",)
    ggml_params = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ctx: ParallelCtx,
        bias: bool,
        cols: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.ctx = ctx
        cols = cols or ctx.split(in_features)
        self._param("weight", Shard((out_features, in_features), 1, (cols,)))
        if bias:
            self._param("bias", Shard((out_features,)))
        else:
            self.bias = None
        self.adapters: list[LowRank] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.matrix())
        for adapter in self.adapters:
            y = y + adapter(x)  # a partial sum over this rank's inputs, reduced with the base's
        y = self.ctx.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(ShardedModule):
    """Embedding rows split over ranks (vocab padded to a multiple of tp); lookups all-reduced. Kept
    in GGML blocks, the rows looked up are dequantized (and no others)."""

    ggml_params = ("weight",)

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelCtx):
        super().__init__()
        self.ctx = ctx
        self.start, self.stop, padded = ctx.vocab(vocab_size)
        self._param(
            "weight", Shard((vocab_size, dim), 0, ((self.start, self.stop),), pad_to=padded)
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix().lookup(ids) if "weight" in self.ggml else F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        out = self.lookup(local.masked_fill(outside, 0))
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.ctx.all_reduce(out)


class VocabHead(ShardedModule):
    """The LM head: rows split like the embedding; logits gathered and the padding cut off.

    With tied embeddings it reads the embedding's weight and owns no parameter.
    """

    ggml_params = ("weight",)

    def __init__(
        self, vocab_size: int, dim: int, ctx: ParallelCtx, bias: bool, tied: VocabEmbedding | None
    ):
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        # a list, so the embedding is not registered twice
        self.tied = [tied] if tied is not None else None
        self.product = dense  # a compiled model's head replaces it (model/compiled.py)
        start, stop, padded = ctx.vocab(vocab_size)
        if tied is None:
            self._param("weight", Shard((vocab_size, dim), 0, ((start, stop),), pad_to=padded))
        if bias:
            self._param("bias", Shard((vocab_size,), 0, ((start, stop),), pad_to=padded))
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self.tied[0] if self.tied else self
        weight = owner.matrix() if "weight" in owner.ggml else owner.weight
        logits = (dense if isinstance(weight, BlockWeight) else self.product)(x, weight, self.bias)
        return self.ctx.all_gather_last(logits)[..., : self.vocab_size]


class Replicated(ShardedModule):
    """A parameter every rank holds whole (norm scales, learned positions)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self._param("weight", Shard(shape))


def product_weights(root: nn.Module) -> list[torch.Tensor]:
    """The weights `dense` multiplies by in root's projections, each once, as dense is handed them:
    a fused group's joined weight (its parts then run no product of their own), every other column-
    or row-parallel weight, the head's (the embedding's, where tied). Kept FP8 weights and GGML
    blocks are not among them."""
    fused = {
        id(p)
        for m in root.modules()
        if isinstance(m, FusedColumns) and m.weight is not None
        for p in m.parts
        if p is not None
    }
    found: dict[int, torch.Tensor] = {}
    for module in root.modules():
        if isinstance(module, FusedColumns) and module.weight is not None:
            weight = module.weight if module.ggml is None else None
        elif isinstance(module, FusedColumns) or id(module) in fused:
            continue
        elif isinstance(module, (ColumnLinear, RowLinear)) and not module.fp8 and not module.ggml:
            weight = module.weight
        elif isinstance(module, VocabHead):
            owner = module.tied[0] if module.tied else module
            weight = None if owner.ggml else owner.weight
        else:
            continue
        if weight is not None and not weight.is_meta:
            found.setdefault(id(weight), weight)
    return list(found.values())

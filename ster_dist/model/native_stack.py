"""A decode step of plain Llama- or Gemma-shaped layers as one call into C++ (kernels/stack.cpp), in
place of the compiled graph's, where every layer of the model is that shape.

Compiled, a one-token step's products read at copy bandwidth, yet between them the graph's Python
wrapper, the dispatcher and allocations took a quarter of a step (bench/README.md): per layer four
generated loops, four product calls, attention and a dozen views. `stack_step` runs the same chain
in C++: the same product and attention functions the graph calls, and the elementwise work as
inductor generates it, so a row's logits are the same bits either way (a request does not read other
logits for having stepped alone rather than beside a prompt's chunk).

Plain means: an RMS norm over a scale (or over an offset from one, Gemma's) before attention and
before the feed-forward, and after both or neither (Gemma 3's and GLM-4's sandwich, no bias or
multiplier before those), or only after both (OLMo 2's); attention with q, k and v fused into one
product, rotated (by halves or pairs, each layer by its own tables) or not (SmolLM3's unrotated
layers), queries and keys normed before the rotation head by head (Qwen3, Gemma 3), over each whole
projection (OLMo 2) or not at all (Llama), no gate, clipping, temperature or shared keys, and the
decode plan covering it (model/compiled.py's `decode_plans`: softmax, soft-capped or not (Gemma 2),
over every earlier key, a sliding window's or a chunk's); a SiLU- or GELU(tanh)-gated feed-forward
with gate and up fused, nothing clamped or scaled inside; each sublayer's output biased or not,
scaled or not (Granite's residual multiplier); f32 or bf16 weights on one rank; inductor's vectors
as wide as this build's. `why_not(model)` says which layer fails and why.

A step takes this way only when the compiled step has a decode plan (every row decodes one token)
covering every layer and no projection carries an adapter; anything else runs through the graphs as
before.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ster_dist import kernels
from ster_dist.layers.activation import gelu_tanh
from ster_dist.layers.mlp import MLP
from ster_dist.model.attention import Attention
from ster_dist.model.norm import Norm

# per layer, what stack_step reads, in its order: (the module's path from the block, the attribute)
_READS = (
    ("attn_norm", "weight"),
    ("attn.qkv", "weight"),
    ("attn.qkv", "bias"),
    ("attn.o", "weight"),
    ("attn.o", "bias"),
    ("mlp_norm", "weight"),
    ("mlp.gate_up", "weight"),
    ("mlp.gate_up", "bias"),
    ("mlp.down", "weight"),
    ("mlp.down", "bias"),
    ("attn.q_norm", "weight"),
    ("attn.k_norm", "weight"),
    ("post_attn_norm", "weight"),
    ("post_mlp_norm", "weight"),
)
_NONE = torch.empty(0)  # an absent bias, as the operator's Tensor[] takes it


def _plain_norm(norm, heads: bool = False, whole: bool = False) -> bool:
    """An RMS norm over a scale in the model's dtype, or over an offset from one (Gemma's): over the
    hidden width, (`heads`) over each head's width with one scale for every head, or (`whole`) over
    a whole projection (on one rank, where it is not split)."""
    return (
        type(norm) is Norm
        and norm.kind == "rms"
        and bool(norm.heads) == heads
        and norm.split == whole
        and norm.groups == 1
        and norm.weight is not None
        and norm.weight.dim() == 1
        and norm.bias is None
        and (bool(norm.offset) or not norm.scale_f32)
    )


def _plain_head_norms(attn) -> bool:
    """No query or key norms, or Qwen3's and Gemma 3's (each head normed before its rotation) or
    OLMo 2's (each whole projection normed before it), the keys' like the queries'."""
    if attn.q_norm is None:
        return True
    q, k, per_head = attn.q_norm, attn.k_norm, attn.per_head_norm
    return (
        not attn.norm_after_rope
        and _plain_norm(q, heads=per_head, whole=not per_head)
        and _plain_norm(k, heads=per_head, whole=not per_head)
        and (q.eps, q.offset) == (k.eps, k.offset)
    )


def _why_not_attention(attn) -> str | None:
    if type(attn) is not Attention:
        return f"its mixer is {type(attn).__name__}"
    if attn.qkv.weight is None or attn.v is None or attn.gate is not None:
        return "its q, k and v are not one fused product without a gate"
    if (
        attn.kv_source is not None
        or attn.keeps_kv
        or attn.value_experts is not None
        or attn.value_from_key
    ):
        return "its keys or values are shared or made otherwise"
    if (
        not _plain_head_norms(attn)
        or attn.v_norm is not None
        or attn.clip is not None
        or attn.value_scale != 1.0
    ):
        return "it norms, clips or scales its queries, keys or values"
    if attn.temperature[0] or attn.alibi_sqrt:
        return "it scales queries by position"
    if attn.kernel_terms(attn._attend_at) is None:
        return "its attention is not softmax, soft-capped or not"
    return None


def _why_not_mlp(mlp) -> str | None:
    if type(mlp) is not MLP or mlp.gate is None or mlp.gate_up.weight is None:
        return "its feed-forward is not a fused gated one"
    if (
        mlp.act not in (F.silu, gelu_tanh)
        or mlp.cutoff_deviations is not None
        or mlp.oai
        or mlp.limit
        or mlp.limit_inside
    ):
        return "its feed-forward is not a plain SiLU or GELU (tanh) gate"
    if mlp.gate_multiplier != 1.0 or mlp.down_multiplier != 1.0 or mlp.scale is not None:
        return "its feed-forward's gate or output is scaled"
    return None


def _why_not_post_norms(block) -> str | None:
    """None where the block norms neither sublayer's output, or both by plain norms of one eps
    (Gemma 3's sandwich) without a bias or multiplier before them."""
    post = (block.post_attn_norm, block.post_mlp_norm)
    if post == (None, None):
        return None
    if None in post or not all(_plain_norm(norm) for norm in post) or post[0].eps != post[1].eps:
        return "its norms after the sublayers are not plain RMS norms after both"
    if (
        block.token_mixer.o.bias is not None
        or block.mlp.down.bias is not None
        or block.residual_multiplier != 1.0
    ):
        return "a sublayer's output is biased or scaled before its norm"
    return None


def _why_not_block(block) -> str | None:
    pre, post = (block.attn_norm, block.mlp_norm), (block.post_attn_norm, block.post_mlp_norm)
    # OLMo 2's: each sublayer's output normed, not its input
    only_after = pre == (None, None) and None not in post
    if not (all(_plain_norm(norm) for norm in pre) or only_after):
        return "its norms are not plain RMS norms before attention and feed-forward, or after both alone"
    extras = (
        block.shortcut,
        block.attn_sconv,
        block.mlp_sconv,
        block.factors,
        block.laurel,
        block.altup,
        block.attn_hc,
        block.per_layer_gate,
        block.layer_scalar,
        block.side_by_side,
    )
    if (
        any(e is not None for e in extras)
        or block.joins_shortcut
        or block.parallel
        or block.residual_fp32
        or block.mlp_reads_residual
    ):
        return "it is not two pre-norm sublayers added to a plain residual"
    return (
        _why_not_attention(block.token_mixer)
        or _why_not_mlp(block.mlp)
        or _why_not_post_norms(block)
    )


def why_not(model) -> str | None:
    """Why `model`'s decode steps cannot run as one native call (None: they can)."""
    if os.environ.get("STER_NATIVE_STACK") == "0":
        return "STER_NATIVE_STACK=0 is set"
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
        dtype = str(model.dtype).removeprefix("torch.")
        return f"the model is {dtype} on {model.device.type}, not float32 or bfloat16 on the CPU"
    if model.ctx.tp_size > 1 or model.ctx.pp_size > 1:
        return "the model is split over ranks"
    if not kernels.ready():
        return "the CPU kernels are not built"
    lanes, ours = _inductor_lanes(), torch.ops.ster_kernels.stack_lanes()
    if lanes != ours:
        return f"inductor's loops here take {lanes} floats a vector, the kernels' {ours}"
    head = model.layers[model.stage[0]]
    first, first_act = head.token_mixer, getattr(head.mlp, "act", None)
    for i in range(*model.stage):
        block = model.layers[i]
        if (reason := _why_not_block(block)) is not None:
            return f"layer {i}: {reason}"
        attn = block.token_mixer
        if (attn.local_heads, attn.local_kv, attn.head_dim, attn.value_dim, block.mlp.act) != (
            first.local_heads,
            first.local_kv,
            first.head_dim,
            first.value_dim,
            first_act,
        ):
            return f"layer {i}'s heads or activation differ from the first layer's"
    return None


def _source(block, path: str, name: str) -> tuple[dict, str] | None:
    """Where the tensor `name` of the module at `path` from the block lives: (its module's parameter
    or buffer dict, name), or None where there is no such module (no q norm) or tensor (no bias)."""
    module = block
    for part in path.split("."):
        module = getattr(module, part, None)
    for held in (getattr(module, "_parameters", {}), getattr(module, "_buffers", {})):
        if held.get(name) is not None:
            return held, name
    return None


def _read(source: tuple[dict, str] | None) -> torch.Tensor:
    # read each step, not kept: a loader or a merge may put a new tensor in a module's place
    # (assigned, it lands in
    # the same dict); from the dict itself, as nn.Module's attribute lookup cost 1.2 us a tensor
    # (0.45 ms a step)
    value = source[0].get(source[1]) if source is not None else None
    return _NONE if value is None else value


def _inductor_lanes() -> int:
    # imported late: inductor is slow to import, and only a model being compiled asks
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return isa.nelements() if isa else 1


def _numbers(block) -> tuple[float, ...]:
    """stack_step's numbers of a layer: eps and offset of its norm before attention, before the
    feed-forward and of the heads'; the multiplier of each sublayer's output; eps of the norms after
    the sublayers and the offset of each (0 where a layer has no such norm)."""
    heads, post = block.token_mixer.q_norm, (block.post_attn_norm, block.post_mlp_norm)
    pre = (block.attn_norm, block.mlp_norm)
    return (
        getattr(pre[0], "eps", 0.0),
        getattr(pre[0], "offset", 0.0),
        getattr(pre[1], "eps", 0.0),
        getattr(pre[1], "offset", 0.0),
        getattr(heads, "eps", 0.0),
        getattr(heads, "offset", 0.0),
        block.residual_multiplier,
        getattr(post[0], "eps", 0.0),
        getattr(post[0], "offset", 0.0),
        getattr(post[1], "offset", 0.0),
    )


class NativeStack:
    """A model's decode steps through kernels/stack.cpp; build it where `why_not(model)` is None."""

    def __init__(self, model):
        self.layers = list(range(*model.stage))
        blocks = [model.layers[i] for i in self.layers]
        self.sources = [_source(block, path, name) for block in blocks for path, name in _READS]
        self.numbers = [number for block in blocks for number in _numbers(block)]
        attn = blocks[0].token_mixer
        self.shape = [
            attn.local_heads,
            attn.local_kv,
            attn.head_dim,
            attn.value_dim,
            int(blocks[0].mlp.act is gelu_tanh),
        ]
        # the layers' distinct rotations, and per layer the index of its own (-1: none) and whether
        # it pairs
        # neighbours (interleaved) or halves
        ropes = [block.token_mixer.rope for block in blocks]
        self.ropes = list(dict.fromkeys(rope for rope in ropes if rope is not None))
        self.rotations = [
            n
            for rope in ropes
            for n in (
                (self.ropes.index(rope), int(rope.interleaved)) if rope is not None else (-1, 0)
            )
        ]
        # each projection's list of attached adapters, which attach and detach change in place
        self.adapters = [
            p.adapters
            for block in blocks
            for p in (
                *block.token_mixer.qkv.parts,
                block.token_mixer.o,
                block.mlp.gate,
                block.mlp.up,
                block.mlp.down,
            )
            if p is not None
        ]

    def takes(self, planned: list[float]) -> bool:
        """Whether this step may run here: its decode plan (push_plan's scales) covers every layer
        and no projection carries an adapter (attached since the stack was built)."""
        return all(planned[i] > 0 for i in self.layers) and not any(self.adapters)

    def run(self, h: torch.Tensor, step) -> torch.Tensor:
        """h [batch, tokens, hidden], every row one decoding token, through every layer (the plan
        pushed)."""
        batch, tokens, width = h.shape
        rows = batch * tokens
        tables = [step.rotary(rope, h.dtype) for rope in self.ropes]
        weights = [_read(source) for source in self.sources]
        out = torch.ops.ster_kernels.stack_step(
            h.reshape(rows, width),
            weights,
            self.layers,
            self.numbers,
            self.shape,
            [cos for cos, _ in tables],
            [sin for _, sin in tables],
            self.rotations,
        )
        return out.view(batch, tokens, width)

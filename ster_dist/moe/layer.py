"""The mixture-of-experts feed-forward: router, dispatch, this rank's experts, combine, shared
experts.

The residual stream is replicated over the expert-parallel group (attention is split over
tensor-parallel ranks only), so each expert-parallel rank takes a contiguous share of the batch's
tokens, routes it, sends each (token, expert) pair to the expert's rank, weighs what comes back,
adds the shared experts, and the shares are gathered again. Under tensor parallelism the routed and
shared outputs are partial sums, all-reduced once on the share before the gather. Nemotron-H's
experts may work in a latent width (moe_latent_size): the share is projected in before dispatch and
the weighed sum projected out after combine. Llama 4 weighs each expert's input instead
(moe_apply_router_weight_on_input): every (token, expert) pair travels as its own row, already
scaled, and what comes back is summed as is. Inkling's shared experts are weighed by the router
(moe/router.py route_with_shared). LongCat-Flash's identity experts (moe.identity_experts) are
chosen like routed ones but never dispatched: each returns its input, times its weight. A small step
(at most REPLICATED_BYTES of hidden states: a decode's) skips the dispatch: every rank routes every
token, runs the pairs its own experts hold and the shared experts of its own share, and one gather
adds the ranks' partial sums (MoE.replicated; 1.6x EP=2 decode at batch 4, 1.9x at batch 1, on
bench/moe.py's model). In a compiled step a layer over expert-parallel ranks or with identity
experts is one opaque operator (`moe_layer`, at the end of this module), run eagerly inside.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch import nn

from ster_dist.config import ModelConfig
from ster_dist.layers.mlp import MLP
from ster_dist.moe.dispatch import combine, dispatch
from ster_dist.moe.experts import Experts, trace_experts, traced
from ster_dist.moe.router import Router
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import ColumnLinear, Replicated, dense

# the most bytes of hidden states (tokens x hidden x element size) a step may have to skip the
# dispatch over
# expert-parallel ranks (MoE.replicated): a decode's few tokens, where the exchange's latency is all
# that counts
REPLICATED_BYTES = 128 * 1024


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelCtx, layer: int):
        super().__init__()
        moe = cfg.moe_of(layer)
        self.ctx, self.num_experts, self.hidden = ctx, moe.num_experts, cfg.hidden_size
        self.router = Router(moe, cfg.hidden_size, cfg.norm_eps)
        # Nemotron-H's latent projection: the routed experts work in a narrower width, projected in
        # and out
        # (both small, whole on every rank); the router and the shared experts read the hidden state
        # itself
        self.width = moe.latent_size or cfg.hidden_size
        if moe.latent_size:
            self.latent_in = ColumnLinear(
                cfg.hidden_size, self.width, ((0, self.width),), cfg.mlp_up_bias
            )
            self.latent_out = ColumnLinear(
                self.width, cfg.hidden_size, ((0, cfg.hidden_size),), cfg.mlp_down_bias
            )
        else:
            self.latent_in = self.latent_out = None
        # Step 3.5's clamped layers
        limits, shared_limits = cfg.layer_glu_limits, cfg.layer_shared_glu_limits
        self.experts = Experts(
            moe, self.width, cfg.hidden_act, ctx, limits[layer] if limits else 0.0
        )
        self.shared = (
            MLP(
                cfg,
                ctx,
                moe.shared_intermediate_size,
                limit=shared_limits[layer] if shared_limits else 0.0,
            )
            if moe.shared_intermediate_size
            else None
        )
        self.shared_gate = Replicated((1, cfg.hidden_size)) if moe.shared_gate else None
        self.shared_average = moe.shared_average
        self.weight_input = moe.weight_input
        # Inkling: shared experts the router weighs too, stacked like the routed ones and whole on
        # every
        # expert-parallel rank (each runs them on its own share of the tokens)
        self.shared_experts = (
            Experts(
                replace(moe, num_experts=moe.shared_routed, expert_bias=False),
                self.width,
                cfg.hidden_act,
                replace(ctx, ep_rank=0, ep_size=1, ep_group=None),
            )
            if moe.shared_routed
            else None
        )
        self.top_k = moe.top_k
        self.identity_experts = moe.identity_experts
        self.hash_routed = bool(moe.hash_vocab)  # DeepSeek-V4's hash layers route by the token's id

    def forward(
        self,
        x: torch.Tensor,
        route_from: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts' output for x; `route_from`: what the router reads where that is not x (Gemma
        4's router reads the residual, its experts a norm of it); token_ids (x's shape less the
        hidden width): what a hash-routed router chooses by."""
        if torch.compiler.is_compiling() and self.opaque():
            return torch.ops.ster_dist.moe_layer(x, route_from, self.experts.up)
        return self._forward(x, route_from, token_ids)

    def opaque(self) -> bool:
        """Whether a compiled step runs this layer as one operator, eagerly inside it (`moe_layer`,
        below): an expert-parallel rank's dispatch reads its split sizes on the host, and a rank
        whose share of a step's tokens is empty would see its all-to-alls cut from its graph (no
        output of theirs is read) and hang its peers; identity experts pick their routed pairs by a
        data-dependent mask."""
        return self.ctx.ep_size > 1 or bool(self.identity_experts)

    def _forward(
        self, x: torch.Tensor, route_from: torch.Tensor | None, token_ids: torch.Tensor | None
    ) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden)
        tokens = flat.shape[0]
        own = self.ctx.token_share(tokens)  # the rows whose shared experts this rank runs
        replicated = self.replicated(tokens, x.element_size())
        start, stop = (0, tokens) if replicated else own
        share = flat[start:stop]
        routed = share if route_from is None else route_from.reshape(-1, self.hidden)[start:stop]
        hashed = token_ids.reshape(-1)[start:stop] if self.hash_routed else None
        weights, ids = self.router(routed, hashed)
        weights, gammas = weights[:, : self.top_k], weights[:, self.top_k :]
        inputs = self.latent_in(share) if self.latent_in is not None else share
        if self.identity_experts:
            return self._with_identity(x, share, weights, ids, tokens)
        # Llama 4: each (token, expert) pair's input scaled by its weight, summed as is
        if self.weight_input:
            inputs = (inputs.unsqueeze(1) * weights.unsqueeze(-1).to(inputs.dtype)).flatten(0, 1)
        if replicated:
            back = self._held_pairs(inputs, ids)
        else:
            rows, local_ids, handle = dispatch(
                inputs, ids, self.num_experts, self.ctx, pairs=self.weight_input
            )
            back = combine(self.experts(rows, local_ids), handle)
        back = back.view(*ids.shape, self.width).float()
        out = (back if self.weight_input else back * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        # a partial sum under TP (and EP, replicated): add the bias once
        if self.latent_out is not None:
            first = self.ctx.tp_rank == 0 and (not replicated or self.ctx.ep_rank == 0)
            out = dense(out, self.latent_out.matrix(), self.latent_out.bias if first else None)
        if self.shared_experts is not None or self.shared is not None:
            # this rank's own rows within those it routed
            mine = slice(own[0] - start, own[1] - start)
            extra = self._shared_parts(flat[own[0] : own[1]], gammas[mine])
            # each rank adds its own rows' share: the sum over ranks adds every row's once
            if replicated:
                out[mine] += extra
            else:
                out = out + extra
            # Cohere 2 MoE: the routed and shared experts' mean
            if self.shared is not None and self.shared_average:
                out = out * 0.5
        # every rank of a tensor-parallel group holds the same share, so all skip together
        if out.shape[0]:
            out = self.ctx.all_reduce(out)
        if replicated:
            return self.ctx.ep_sum(out).view(x.shape)
        return self.ctx.ep_gather_rows(out, tokens).view(x.shape)

    def replicated(self, tokens: int, item_bytes: int) -> bool:
        """Whether a step of `tokens` tokens skips the dispatch over expert-parallel ranks: every
        rank routes every token (the residual is replicated already) and runs the pairs its own
        experts hold, and the ranks' partial sums are added by one collective (ctx.ep_sum) instead
        of the dispatch's three and the gather of the shares (vLLM's all-gather / reduce-scatter
        exchange, less the all-gather: each rank holds every token). The experts' work is the same
        (each pair runs once, on the rank holding its expert); what grows is the bytes of the sum
        (ep x tokens x hidden), so only steps of at most REPLICATED_BYTES a rank take it: a
        decode's."""
        # identity experts: their own path, by shares
        if self.ctx.ep_size == 1 or self.identity_experts:
            return False
        return 0 < tokens * self.hidden * item_bytes <= REPLICATED_BYTES

    def _held_pairs(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every (token, slot) pair's output from this rank's experts [pairs, width], zero where
        another rank holds the pair's expert; inputs: [tokens, width], or a row per pair with
        weight_input."""
        flat = ids.reshape(-1)
        first, last = self.ctx.experts(self.num_experts)
        held = ((flat >= first) & (flat < last)).nonzero(as_tuple=True)[0]
        rows = inputs[held] if self.weight_input else inputs[held // ids.shape[1]]
        back = inputs.new_zeros((flat.shape[0], self.width))
        back[held] = self.experts(rows, flat[held] - first)
        return back

    def _shared_parts(self, rows: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """The shared experts' partial sum for rows: the router-weighed ones (Inkling's) and the
        plain ones."""
        out = self._routed_shared(rows, gammas) if self.shared_experts is not None else None
        if self.shared is not None:
            out = self._shared(rows) if out is None else out + self._shared(rows)
        return out

    def _with_identity(
        self,
        x: torch.Tensor,
        share: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        tokens: int,
    ) -> torch.Tensor:
        """LongCat-Flash's experts: only the pairs choosing a routed expert are dispatched; an
        identity expert returns its input, weighed here, on every rank alike, and joins after the
        routed partial sums are reduced (it is whole on each tensor-parallel rank)."""
        routed = ids < self.num_experts
        if self.every_pair(share):
            out = self._every_pair(share, weights, ids, routed)
        else:
            token_of = routed.nonzero(as_tuple=True)[0]
            rows, local_ids, handle = dispatch(
                share[token_of], ids[routed].unsqueeze(1), self.num_experts, self.ctx
            )
            back = combine(self.experts(rows, local_ids), handle).float() * weights[
                routed
            ].unsqueeze(-1)
            out = torch.zeros(share.shape[0], self.width, dtype=torch.float32, device=share.device)
            out = out.index_add_(0, token_of, back).to(x.dtype)
        if out.shape[0]:
            out = self.ctx.all_reduce(out)
        identity = share.float() * weights.masked_fill(routed, 0.0).sum(1, keepdim=True)
        return self.ctx.ep_gather_rows((out.float() + identity).to(x.dtype), tokens).view(x.shape)

    def every_pair(self, share: torch.Tensor) -> bool:
        """Whether identity experts' steps send every (token, slot) pair through the routed experts,
        an identity pair to the last routed expert at weight zero: off the CPU on one
        expert-parallel rank, where picking the routed pairs out (`nonzero`) would read the device
        every layer (model/host.py). On a CPU the pick is free and saves the identity pairs' work;
        over expert-parallel ranks the dispatch reads its counts anyway."""
        return share.device.type != "cpu" and self.ctx.ep_size == 1

    def _every_pair(
        self, share: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, routed: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighed sum [tokens, width] with every pair run (`every_pair`)."""
        ids = ids.clamp(max=self.num_experts - 1)
        rows, local_ids, handle = dispatch(share, ids, self.num_experts, self.ctx)
        back = combine(self.experts(rows, local_ids), handle).view(*ids.shape, self.width).float()
        return (back * weights.masked_fill(~routed, 0.0).unsqueeze(-1)).sum(1).to(share.dtype)

    def _routed_shared(self, x: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
        """Every token through every shared expert, weighed by the router's gammas [tokens, shared]
        (a partial sum under TP, like the routed experts')."""
        n, s = gammas.shape
        ids = torch.arange(s, device=x.device).repeat(n)  # token t's row for expert j is t * s + j
        y = self.shared_experts(x.repeat_interleave(s, dim=0), ids)
        return (y.view(n, s, y.shape[-1]).float() * gammas.unsqueeze(-1)).sum(1).to(x.dtype)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts' partial sum (its down projection's all-reduce is the layer's)."""
        mlp = self.shared
        h = mlp.hidden(x)
        # added once: the partial sums are all-reduced
        bias = mlp.down.bias if self.ctx.tp_rank == 0 else None
        y = dense(h, mlp.down.matrix(), bias)
        if self.shared_gate is not None:
            y = torch.sigmoid(dense(x, self.shared_gate.weight)) * y
        return y


# -- inside a compiled step
# -----------------------------------------------------------------------------------
# A layer `opaque()` keeps whole reaches a compiled step as one custom operator whose output's shape
# is its input's
# (as attention and routed_experts do): the graph around it traces, and every collective of the
# layer (the
# dispatch's all-to-alls, the tensor-parallel reduce, the gather of the ranks' shares) runs inside
# it, in order,
# on every rank. It finds its layer by its experts' `up` stack, registered by `trace_moe` before a
# model traces.

_LAYERS: "weakref.WeakValueDictionary[int, MoE]" = weakref.WeakValueDictionary()

_LIBRARY = torch.library.Library("ster_dist", "FRAGMENT")
_LIBRARY.define("moe_layer(Tensor x, Tensor? route_from, Tensor up) -> Tensor")


def trace_moe(model: torch.nn.Module) -> None:
    """Register every MoE layer and Experts stack of `model` for the operators its compiled steps
    call."""
    trace_experts(model)
    for layer in model.modules():
        if isinstance(layer, MoE):
            _LAYERS[layer.experts.up.data_ptr()] = layer


def _moe_layer(x: torch.Tensor, route_from: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    return traced(_LAYERS, up, lambda layer: layer.experts)._forward(x, route_from, None)


_LIBRARY.impl("moe_layer", _moe_layer, "CompositeExplicitAutograd")


@torch.library.register_fake("ster_dist::moe_layer")
def _(x: torch.Tensor, route_from: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)

"""The router: which experts each token goes to, and with what weight.

Every rank runs it, in f32, on the tokens it dispatches. One function covers
every routing seeds/000 names: softmax or sigmoid scores; greedy top-k,
DeepSeek-V2's group_limited_greedy (the topk_group best of n_group groups,
ranked by their best expert) and DeepSeek-V3's noaux_tc (groups ranked by the
sum of their best two, with e_score_correction_bias added only to choose);
renormalisation of the chosen weights; routed_scaling_factor; Inkling's
shared experts scored by the router beside the routed ones (route_with_shared); and LongCat-Flash's
identity experts, scored and chosen like the routed ones (ids from num_experts on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.parallel.ctx import Shard
from ster_dist.parallel.linear import ShardedModule


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":  # DeepSeek-V4's
        return F.softplus(logits).sqrt()
    return torch.softmax(logits, dim=-1)


def route(
    logits: torch.Tensor,
    moe: MoEConfig,
    correction: torch.Tensor | None = None,
    hashed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, top_k] f32, expert ids [tokens, top_k]) from router logits [tokens,
    experts]; `hashed`: the experts already chosen (DeepSeek-V4's hash layers), which the scores
    only weigh."""
    logits = logits.float()
    if moe.sparsemixer_eps is not None:
        return _sparsemixer(logits, moe.sparsemixer_eps)
    scores = _scores(logits, moe.scoring)
    choice = scores + correction.float() if correction is not None else scores
    if moe.topk_method != "greedy":
        grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
        # the config check guarantees the kept groups hold at least top_k experts
        choice = choice.masked_fill(
            ~keep.repeat_interleave(moe.num_experts // moe.n_group, dim=1), float("-inf")
        )
    ids = choice.topk(moe.top_k, dim=-1).indices if hashed is None else hashed
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.scaling_factor != 1.0:
        weights = weights * moe.scaling_factor
    return weights, ids


def route_with_shared(
    logits: torch.Tensor, moe: MoEConfig, correction: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inkling's routing, for logits [tokens, experts + shared] whose last columns score the shared
    experts:
    the top_k routed experts by sigmoid + correction, then every chosen and shared expert weighed by
    its sigmoid over the sum of theirs, times scaling_factor. (weights [tokens, top_k + shared] f32,
    the chosen experts first; expert ids [tokens, top_k])."""
    logits = logits.float()
    routed, shared = logits[:, : moe.num_experts], logits[:, moe.num_experts :]
    scores = torch.sigmoid(routed)
    ids = (
        (scores + correction.float() if correction is not None else scores)
        .topk(moe.top_k, dim=-1)
        .indices
    )
    # sigmoid / sum of sigmoids, through log-sigmoids as Inkling computes it
    chosen = F.logsigmoid(torch.cat([routed.gather(1, ids), shared], dim=-1))
    weights = torch.exp(chosen - torch.logsumexp(chosen, dim=-1, keepdim=True))
    return weights * moe.scaling_factor, ids


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's SparseMixer outside training: two rounds, each choosing the best logit not yet
    chosen and weighing it by its softmax over the experts whose logit lies within 2 * eps of that
    best, relative to max(|logit|, best)."""
    weights, ids = [], []
    remaining = logits
    for _ in range(2):
        best, index = remaining.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=best)
        masked = remaining.masked_fill((best - logits) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(masked, dim=-1).gather(1, index))
        ids.append(index)
        remaining = remaining.scatter(1, index, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


class Router(ShardedModule):
    """The router's weights, whole on every rank: weight [experts, hidden], optional logit bias and
    selection bias (`correction`)."""

    def __init__(self, moe: MoEConfig, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.moe, self.eps = moe, eps
        # identity experts are scored after the routed ones
        scored = moe.num_experts + moe.identity_experts
        self._param("weight", Shard((scored + moe.shared_routed, hidden)))
        if moe.router_bias:
            self._param("bias", Shard((scored,)))
        else:
            self.bias = None
        if moe.correction_bias:
            self._param("correction", Shard((scored,)))
        else:
            self.correction = None
        if moe.router_scale:
            self._param("scale", Shard((1,)))
        else:
            self.scale = None
        if moe.router_input_norm:  # Gemma 4's: a scale per input channel and one per expert
            self._param("input_scale", Shard((hidden,)))
            self._param("expert_scale", Shard((moe.num_experts,)))
        else:
            self.input_scale = self.expert_scale = None
        if moe.hash_vocab:  # DeepSeek-V4's hash layers: each token id's experts, stored
            self._param("tid2eid", Shard((moe.hash_vocab, moe.top_k)), torch.long)
        else:
            self.tid2eid = None

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids): weights [tokens, top_k], or [tokens, top_k + shared] where the
        router scores shared experts too (route_with_shared); an id from num_experts on is an
        identity expert. token_ids [tokens]: what a hash-routed router (tid2eid) chooses by."""
        bias = self.bias.float() if self.bias is not None else None
        if self.input_scale is not None:
            x = self._normed(x)
        logits = F.linear(x.float(), self.weight.float(), bias)
        if self.moe.shared_routed:
            weights, ids = route_with_shared(logits, self.moe, self.correction)
        else:
            hashed = self.tid2eid[token_ids].long() if self.tid2eid is not None else None
            weights, ids = route(logits, self.moe, self.correction, hashed)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale.float()[ids]
        return (weights * self.scale.float() if self.scale is not None else weights), ids

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        """Gemma 4's router input: a scale-free RMS norm (back in x's dtype), times the stored scale
        and 1/sqrt(hidden), as Transformers rounds them."""
        h = x.float()
        h = (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        return h * self.input_scale * (x.shape[-1] ** -0.5)

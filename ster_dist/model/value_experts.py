"""Value experts (K2-Horizon's MoVA): in place of a value projection, each token's value is the
weighted sum of the SiLU outputs of the few value experts its own router chooses.

The router is whole on every rank and routes as the feed-forward's experts do (moe/router.py route:
scores, a selection bias added only to choose, renormalisation, scaling). Every rank holds every
expert, each one's rows split like the value projection's (this rank's key-value heads), so a rank
computes its own value heads with no exchange.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ster_dist.config import MoEConfig
from ster_dist.moe.router import route
from ster_dist.parallel.ctx import Shard
from ster_dist.parallel.linear import ShardedModule


class ValueExperts(ShardedModule):
    def __init__(self, moe: MoEConfig, hidden: int, width: int, rows: tuple[int, int]):
        """width: the value projection's global rows (key-value heads x value width); rows: this
        rank's share."""
        super().__init__()
        self.moe = moe
        self._param("router", Shard((moe.num_experts, hidden)))
        if moe.correction_bias:
            self._param("correction", Shard((moe.num_experts,)))
        else:
            self.correction = None
        self._param(
            "experts",
            Shard((moe.num_experts, width, hidden), 1, (rows,), experts=(0, moe.num_experts)),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's values [..., local rows] for x [..., hidden]."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = route(F.linear(flat.float(), self.router.float()), self.moe, self.correction)
        out = torch.zeros(
            flat.shape[0], self.experts.shape[1], dtype=torch.float32, device=x.device
        )
        for expert in ids.unique().tolist():
            token, slot = (ids == expert).nonzero(as_tuple=True)
            y = F.silu(F.linear(flat[token], self.experts[expert]))
            out.index_add_(0, token, y.float() * weights[token, slot].unsqueeze(-1))
        return out.to(x.dtype).view(*x.shape[:-1], -1)

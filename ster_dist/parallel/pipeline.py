"""Pipeline stages: which contiguous layers each of --pp stages holds, balanced by parameter bytes.

The first stage also holds the embedding, the last the final norm and the head (the embedding again
when the head is tied to it), so those count in the balance. Each stage reads only its layers' tensors;
activations pass stage to stage point to point (ParallelCtx.send_next / recv_prev).

A family whose layers read more than the one hidden state the previous layer hands on cannot be cut
between layers this way, and is refused before any weight is read.
"""

from __future__ import annotations

import torch

from ster_dist.errors import Refusal


def pipeline_refusal(cfg, pp: int) -> str | None:
    """Why `cfg` cannot run as `pp` stages (None: it can)."""
    if pp == 1:
        return None
    if pp > cfg.num_layers:
        return f"--pp {pp} is more than the model's {cfg.num_layers} layers; use at most --pp {cfg.num_layers}"
    reasons = (
        (cfg.loop_layers, "runs its stored layers more than once"),
        (cfg.block_skips, "keeps hidden states across layers (block skip connections)"),
        (any(cfg.mixer(i).endswith("shared_block") for i in range(cfg.num_layers)),
         "shares blocks between layers that read the embedding"),
    )
    for applies, why in reasons:
        if applies:
            return (f"{cfg.family} {why}, so its layers cannot be split into pipeline stages; "
                    "use --tp (and --ep) without --pp")
    return None


def check_pipeline(cfg, pp: int) -> None:
    refusal = pipeline_refusal(cfg, pp)
    if refusal is not None:
        raise Refusal(refusal)


def stage_bounds(layer_sizes: list[int], first_extra: int, last_extra: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: contiguous, every stage at least one layer, the largest stage
    (its layers plus the first stage's embedding or the last one's head) as small as it can be."""
    n = len(layer_sizes)
    if not 1 <= pp <= n:
        raise ValueError(f"{pp} stages for {n} layers")
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first_extra if stage == 0 else 0) + (last_extra if stage == pp - 1 else 0)

    # best[s][e]: the smallest largest-stage cost of the first e layers as s + 1 stages; exact, O(pp * n^2)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for e in range(1, n + 1):
        best[0][e] = cost(0, 0, e)
    for s in range(1, pp):
        for e in range(s + 1, n + 1):
            for a in range(s, e):
                value = max(best[s - 1][a], cost(s, a, e))
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, a
    bounds, end = [], n
    for s in range(pp - 1, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    bounds.append((0, end))
    return bounds[::-1]


def layer_sizes(cfg) -> tuple[list[int], int, int]:
    """(parameter count of each layer, of the embedding, of the norm and head) at one rank, on the meta
    device (nothing allocated). A tied head counts the embedding again: the last stage holds it."""
    from ster_dist.model.decoder import Block
    from ster_dist.parallel.ctx import SINGLE

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        sizes = [count(Block(cfg, i, SINGLE)) for i in range(cfg.num_layers)]
    embed = cfg.vocab_size * cfg.hidden_size
    head = embed + 2 * cfg.hidden_size
    return sizes, embed, head


def stage_layers(cfg, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds."""
    if pp_size == 1:
        return 0, cfg.num_layers
    sizes, embed, head = layer_sizes(cfg)
    return stage_bounds(sizes, embed, head, pp_size)[pp_rank]

"""Pipeline stages: which contiguous layers each of --pp stages holds, balanced by parameter bytes.

The first stage also holds the embedding, the last the final norm and the head (the embedding again
when the head is tied to it), so those count in the balance. Each stage reads only its layers'
tensors; activations pass stage to stage point to point (ParallelCtx.send_next / recv_prev). The
decoder (model/decoder.py stage_layers) measures its layers and asks stage_bounds for its share.

A family whose layers read more than the one hidden state the previous layer hands on cannot be cut
between layers this way, and is refused before any weight is read.
"""

from __future__ import annotations

from ster_dist.errors import Refusal


def pipeline_refusal(cfg, pp: int) -> str | None:
    """Why `cfg` cannot run as `pp` stages (None: it can)."""
    if pp == 1:
        return None
    if pp > cfg.num_layers:
        return f"--pp {pp} is more than the model's {cfg.num_layers} layers; use at most --pp {cfg.num_layers}"
    reasons = (
        (cfg.loop_layers or cfg.loop_schedule, "runs its stored layers more than once"),
        (cfg.block_skips, "keeps hidden states across layers (block skip connections)"),
        (
            any(cfg.mixer(i).endswith("shared_block") for i in range(cfg.num_layers)),
            "shares blocks between layers that read the embedding",
        ),
        (cfg.altup is not None, "carries AltUp's copies of the hidden state and per-layer inputs"),
        (any(s is not None for s in cfg.layer_kv_source), "reuses earlier layers' keys and values"),
        (cfg.per_layer_input, "feeds every layer per-layer inputs made from the tokens"),
        (cfg.spec.halved_layers, "hands shortcut experts' output from one layer to the next"),
        (cfg.hyper_streams, "keeps several hyper-connected residual streams"),
    )
    for applies, why in reasons:
        if applies:
            return (
                f"{cfg.family} {why}, so its layers cannot be split into pipeline stages; "
                "use --tp (and --ep) without --pp"
            )
    return None


def check_pipeline(cfg, pp: int) -> None:
    refusal = pipeline_refusal(cfg, pp)
    if refusal is not None:
        raise Refusal(refusal)


def stage_bounds(
    layer_sizes: list[int], first_extra: int, last_extra: int, pp: int
) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: contiguous, every stage at least one layer, the largest
    stage (its layers plus the first stage's embedding or the last one's head) as small as it can
    be."""
    n = len(layer_sizes)
    if not 1 <= pp <= n:
        raise ValueError(f"{pp} stages for {n} layers")
    prefix = [0]
    for size in layer_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, a: int, b: int) -> int:
        return (
            prefix[b]
            - prefix[a]
            + (first_extra if stage == 0 else 0)
            + (last_extra if stage == pp - 1 else 0)
        )

    # best[s][e]: the smallest largest-stage cost of the first e layers as s + 1 stages; exact, O(pp
    # * n^2)
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

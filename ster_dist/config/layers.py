"""Per-layer tables a family's normalisation states in a config (one entry a layer), read and
checked.

Each table reader returns a tuple with one entry a layer, or an empty tuple where the config states
nothing (the decoder then uses the model-wide value); the looped models' stored layer count and pass
schedule are read here too. Each refuses, in one line naming the key and what it must hold, a table
of the wrong length or with entries of the wrong kind: config.from_hf calls them before any weight
is read.
"""

from __future__ import annotations

from ster_dist.config.keys import Keys
from ster_dist.errors import Refusal


def switches(keys: Keys, key: str, num_layers: int) -> tuple[bool, ...]:
    """A per-layer on/off list a family's normalisation states (0/1 or booleans); empty when
    unstated."""
    stated = keys.get(key)
    if stated is None:
        return ()
    if not isinstance(stated, (list, tuple)) or len(stated) != num_layers:
        raise Refusal(
            f"invalid model config {keys.path}: {key} must list 0 or 1 for each of the {num_layers} "
            "layers"
        )
    return tuple(bool(x) for x in stated)


def counts(keys: Keys, key: str, num_layers: int) -> tuple[int, ...]:
    """A per-layer count (heads, feed-forward width) a family's normalisation states; empty when
    unstated."""
    stated = keys.get(key)
    if stated is None:
        return ()
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != num_layers
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in stated)
    ):
        what = "width" if "intermediate" in key else "head count"
        raise Refusal(
            f"invalid model config {keys.path}: {key} must list a positive {what} for each of the "
            f"{num_layers} layers"
        )
    return tuple(stated)


def limits(keys: Keys, key: str, num_layers: int) -> tuple[float, ...]:
    """A per-layer clamp bound a family's normalisation states (0: none); empty when unstated."""
    stated = keys.get(key)
    if stated is None:
        return ()
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != num_layers
        or any(isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0 for n in stated)
    ):
        raise Refusal(
            f"invalid model config {keys.path}: {key} must list a bound of zero or more for each of the "
            f"{num_layers} layers"
        )
    return tuple(float(n) for n in stated)


def kv_sources(keys: Keys, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the earlier layer whose keys and values it reads (None: its own); empty when
    unstated."""
    stated = keys.get("kv_source_layers")
    if stated is None:
        return ()
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != num_layers
        or any(
            src is not None
            and (
                isinstance(src, bool)
                or not isinstance(src, int)
                or not 0 <= src < i
                or stated[src] is not None
            )
            for i, src in enumerate(stated)
        )
    ):
        raise Refusal(
            f"invalid model config {keys.path}: kv_source_layers must name, for each of the {num_layers} "
            "layers, null or an earlier layer that makes its own keys and values"
        )
    return tuple(stated)


def gate_sparsity(keys: Keys, num_layers: int) -> tuple[float, ...]:
    stated = keys.get("gate_sparsity_layers")
    if stated is None:
        return ()
    if (
        not isinstance(stated, (list, tuple))
        or len(stated) != num_layers
        or any(
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1 for p in stated
        )
    ):
        raise Refusal(
            f"invalid model config {keys.path}: activation_sparsity_pattern must give a sparsity in [0, 1) "
            f"for each of the {num_layers} layers"
        )
    return tuple(float(p) for p in stated)


def residual_factors(keys: Keys, num_layers: int) -> tuple[tuple[float, float, float, float], ...]:
    factors = keys.get("residual_factors")
    if factors is None:
        return ()

    def four_numbers(f) -> bool:
        return (
            isinstance(f, (list, tuple))
            and len(f) == 4
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in f)
        )

    if (
        not isinstance(factors, (list, tuple))
        or len(factors) != num_layers
        or not all(map(four_numbers, factors))
    ):
        raise Refusal(
            f"invalid model config {keys.path}: residual_factors must give four numbers (mixer alpha, "
            f"mixer beta, feed-forward alpha, feed-forward beta) for each of the {num_layers} layers"
        )
    return tuple(tuple(float(x) for x in f) for f in factors)


def block_skips(
    keys: Keys, num_layers: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...]:
    skips = keys.get("block_skips")
    if skips is None:
        return ()
    problem = (
        f"invalid model config {keys.path}: block_skips must list, per skip, the layers keeping the hidden "
        f"state, the layers mixing it back in (each after a keeping one, all below {num_layers}) and a "
        "weight between 0 and 1"
    )
    out = []
    for skip in skips if isinstance(skips, (list, tuple)) else [None]:
        if not isinstance(skip, (list, tuple)) or len(skip) != 3:
            raise Refusal(problem)
        keep, mix, weight = skip
        layers = (
            [*keep, *mix]
            if isinstance(keep, (list, tuple)) and isinstance(mix, (list, tuple))
            else [None]
        )
        if (
            any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers
                for i in layers
            )
            or isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not 0 <= weight <= 1
            or (mix and (not keep or min(mix) < min(keep)))
        ):
            raise Refusal(problem)
        out.append((tuple(keep), tuple(mix), float(weight)))
    return tuple(out)


def loop_layers(keys: Keys, num_layers: int, path: str) -> int:
    n = keys.get("loop_layers", default=0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or (n and num_layers % n):
        raise Refusal(
            f"invalid model config {path}: the looped model's {n!r} stored layers do not divide its "
            f"{num_layers} layers of every pass; state a whole number of loops"
        )
    return n


def loop_schedule(
    keys: Keys, num_layers: int, path: str
) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    stated = keys.get("loop_schedule", default=())
    stored = keys.get("loop_layers", default=0)
    try:
        schedule = tuple(
            (int(stack), int(state), tuple(int(r) for r in reads)) for stack, state, reads in stated
        )
    except (TypeError, ValueError):
        schedule = None
    if schedule is None or (
        schedule
        and (
            len(schedule) * stored != num_layers
            or any(
                stack < 0 or state not in (0, 1) or not reads or not set(reads) <= {0, 1}
                for stack, state, reads in schedule
            )
        )
    ):
        raise Refusal(
            f"invalid model config {path}: the loop schedule {stated!r} does not run {stored!r} stored "
            f"layers a pass over {num_layers} layers from states 0 and 1; state whole counts of cycles"
        )
    return schedule

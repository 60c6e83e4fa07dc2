"""What a steering or capture run knows before any weight is read: the resolved checkpoint's
ModelConfig (layer count and width), so layer selections and artifacts are refused first."""

from __future__ import annotations

from ster_dist.errors import Refusal


def model_config_of(args):
    from ster_dist.config.load import model_config
    from ster_dist.resolve import resolve

    return model_config(resolve(args.model, getattr(args, "revision", None)))


def positive(value, flag: str) -> int:
    if value is None or int(value) < 1:
        raise Refusal(f"{flag} must be 1 or more, got {value}")
    return int(value)

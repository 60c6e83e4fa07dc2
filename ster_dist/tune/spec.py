"""The settings of a training run and every refusal that needs only them and the model's config.

All of these run before a rank starts or a weight is read: numbers without defaults (learning rate,
epochs, seed) named when missing, values out of range, families that take no adapter (seeds/000:
state-space, linear-attention, looped and per-layer-shaped models), a gate on a plain feed-forward,
feed-forward targets on a mixture-of-experts family, and projections the model does not have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ster_dist.adapters.format import TARGETS
from ster_dist.adapters.targets import PARAMS, refuse_family
from ster_dist.checkpoint import Checkpoint
from ster_dist.config import ModelConfig
from ster_dist.errors import Refusal
from ster_dist.families.adapter_rules import TARGETS_REFUSED

FEED_FORWARD = ("gate", "up", "down")
_NAMES = {
    **{t: t for t in TARGETS},
    "q": "query",
    "k": "key",
    "v": "value",
    "o": "output",
    **{f"{t}_proj": t for t in ("gate", "up", "down")},
    "q_proj": "query",
    "k_proj": "key",
    "v_proj": "value",
    "o_proj": "output",
}
REQUIRED = (
    ("learning_rate", "--learning-rate", "1e-4"),
    ("epochs", "--epochs", "3"),
    ("seed", "--seed", "0"),
)


@dataclass(frozen=True)
class TrainSettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # Ster's names, in TARGETS order
    layers: tuple[int, ...]
    epochs: int
    learning_rate: float
    seed: int
    batch_size: int = 1  # examples per micro-batch on each data-parallel rank
    accumulation: int = 1  # micro-batches per optimizer step
    max_sequence: int | None = None  # None: the model's positions
    dp: int = 1
    tp: int = 1
    precision: str = "f32"
    zero_stage: int = 2
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    device: str = "cpu"
    # PEFT starts B at zero; tests start it elsewhere so A's first gradient is not zero
    b_init_std: float = 0.0
    # the reward head starts at zero (a first loss of ln 2); tests start it elsewhere
    head_init_std: float = 0.0

    @property
    def step_examples(self) -> int:
        return self.batch_size * self.accumulation * self.dp

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def require_numbers(args) -> None:
    """--learning-rate, --epochs and --seed have no defaults: a missing one is named."""
    missing = [flag for attr, flag, _ in REQUIRED if getattr(args, attr, None) is None]
    if missing:
        example = " ".join(f"{flag} {value}" for attr, flag, value in REQUIRED if flag in missing)
        raise Refusal(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required and has no default; "
            f"pass {'it' if len(missing) == 1 else 'them'}, e.g. {example}"
        )


def parse_targets(text: str) -> tuple[str, ...]:
    chosen = set()
    for word in (w.strip().lower() for w in (text or "").split(",")):
        if not word:
            continue
        if word not in _NAMES:
            raise Refusal(
                f"unknown adapter target {word!r} in --targets; use q, k, v, o, gate, up and down"
            )
        chosen.add(_NAMES[word])
    if not chosen:
        raise Refusal("--targets names no projection; use e.g. --targets q,k,v,o")
    return tuple(t for t in TARGETS if t in chosen)


def check_values(s: TrainSettings) -> TrainSettings:
    positive_ints = (
        ("--rank", s.rank),
        ("--epochs", s.epochs),
        ("--batch-size", s.batch_size),
        ("--accumulation", s.accumulation),
        ("--dp", s.dp),
        ("--tp", s.tp),
    )
    for flag, value in positive_ints:
        if not isinstance(value, int) or value < 1:
            raise Refusal(f"{flag} must be a whole number of at least 1, got {value}")
    for flag, value in (("--learning-rate", s.learning_rate), ("--alpha", s.alpha)):
        if not math.isfinite(value) or value <= 0:
            raise Refusal(f"{flag} must be a positive number, got {value}")
    if not math.isfinite(s.max_grad_norm) or s.max_grad_norm < 0:
        raise Refusal(
            f"--max-grad-norm must be zero (no clipping) or positive, got {s.max_grad_norm}"
        )
    if not math.isfinite(s.weight_decay) or s.weight_decay < 0:
        raise Refusal(f"--weight-decay must be zero or positive, got {s.weight_decay}")
    if s.max_sequence is not None and s.max_sequence < 2:
        raise Refusal(
            f"--max-sequence must be at least 2 (one prompt and one completion token), got {s.max_sequence}"
        )
    if s.precision not in ("f32", "bf16"):
        raise Refusal(
            f"--precision {s.precision} is not trainable here: train in f32 or bf16 (f16 products run "
            "about 300x slower on CPU and need loss scaling)"
        )
    if s.zero_stage not in (1, 2):
        raise Refusal(
            f"--zero {s.zero_stage}: LoRA factors train under ZeRO stage 1 or 2; stage 3 would partition "
            "factors that every rank's shard reads whole"
        )
    return s


def check_beta(beta: float) -> float:
    """DPO's beta scales the log-ratio, IPO's divides its target: zero or less means nothing."""
    if not math.isfinite(beta) or beta <= 0:
        raise Refusal(f"--beta must be a positive number, got {beta}; DPO's usual is --beta 0.1")
    return beta


def refuse_checkpoint(checkpoint: Checkpoint, targets: tuple[str, ...]) -> None:
    """Before the config is even normalised: the families that take no adapter (or not these
    targets), and the weight format."""
    from ster_dist.config.file import family_of
    from ster_dist.resolve import gate_view

    family = family_of(gate_view(checkpoint.raw_config, checkpoint.weight_format))
    refuse_family(family)
    refused, why = TARGETS_REFUSED.get(family, ((), ""))
    named = [t for t in targets if t in refused]
    if named:
        raise Refusal(
            f"the {', '.join(named)} target{'s are' if len(named) > 1 else ' is'} refused on {family}: {why}"
        )
    if checkpoint.weight_format != "safetensors":
        raise Refusal(
            f"{checkpoint.model} is a {checkpoint.weight_format} checkpoint; adapters train on a "
            "Transformers-format safetensors base, whose tensor names the PEFT adapter is written under"
        )


def check_targets(
    cfg: ModelConfig, targets: tuple[str, ...], layers: tuple[int, ...], params: set[str]
) -> None:
    """The family takes these targets (seeds/000) and the model has each projection on each
    layer."""
    ff = [t for t in targets if t in FEED_FORWARD]
    if cfg.moe is not None and ff:
        raise Refusal(
            f"adapters on {cfg.family} sit on attention only: its feed-forward is a mixture of experts, "
            f"so the {', '.join(ff)} target{'s are' if len(ff) > 1 else ' is'} refused; "
            "train on q,k,v,o"
        )
    if not cfg.mlp_gated and "gate" in targets:
        raise Refusal(
            f"the {cfg.family} feed-forward is plain (no gate), so an adapter naming gate is refused; "
            "drop gate from --targets"
        )
    for layer in layers:
        for target in targets:
            if f"layers.{layer}.{PARAMS[target]}.weight" not in params:
                raise Refusal(
                    f"this {cfg.family} model has no {target} projection at layer {layer} to adapt; "
                    "drop it from --targets or --adapter-layers"
                )

"""What a queued job needs beyond the CLI's own checks, each refused naming its field before any
model is touched: a token budget is not negative, tp / ep / batch sizes are at least one, a job
that samples states its seed (so a retry or a re-run after a restart gives the same answer), an
input file is not standard input, and the layers a job names exist (read from the model's
config.json when the model is a local directory: no weight is read).

A command line (`ster generate ...`, run through the scheduler by cli.py) is checked by the same
rules, worded with its flags (`--max-new-tokens`) instead of spec fields, and without the rules
that only a queued job needs (a stated seed, no standard input): it runs now, in this process."""

from __future__ import annotations

from pathlib import Path

from ster_dist.errors import Refusal
from ster_dist.sched.fields import is_int

# kinds whose work draws random numbers even at their defaults: the spec must state the seed
SEEDED_KINDS = {"steer-train", "steer-optimize"}
_POSITIVE = ("tp", "ep")
_FILE_FIELDS = ("request", "input", "pairs", "prompts", "system", "vector")
# the layer count assumed when only the grammar of a layer list is checked (a Hub model's config is
# not read on arrival): above any real model, small enough that `all` can be listed
_SYNTAX_ONLY = 1 << 16


def label(dest: str, cli: bool) -> str:
    """How a refusal names a field: as the flag of a command line, or as the spec's field."""
    return f"--{dest.replace('_', '-')}" if cli else f"job spec field {dest!r}"


def check(job, check_model: bool, cli: bool = False) -> None:
    fields, kind = job.fields, job.kind
    for dest, value in fields.items():
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not is_int(item) and not isinstance(item, float):
                continue
            if ("tokens" in dest or "budget" in dest) and item < 0:
                raise Refusal(f"{label(dest, cli)} must be zero or more (a token budget), got {item}")
            if (dest in _POSITIVE or dest.endswith("batch_size")) and item < 1:
                raise Refusal(f"{label(dest, cli)} must be 1 or more, got {item}")
            if dest == "seed" and item < 0:
                raise Refusal(f"{label(dest, cli)} must be zero or more, got {item}")
    for dest in _FILE_FIELDS:
        if fields.get(dest) == "-" and not cli:
            raise Refusal(f"job spec field {dest!r} is '-' (standard input), which a queued job does not have; "
                          "give a file")
    if "model" in fields and not str(fields["model"]).strip():
        raise Refusal(f"{label('model', cli)} is empty; give a model directory or a Hub id")
    if kind == "generate":
        _generate_rules(job, cli)
    from ster_dist.protocol import accepts

    if kind in SEEDED_KINDS and accepts(kind, "seed") and "seed" not in fields and not cli:
        raise Refusal(f"a {kind} job spec must state 'seed', so that a retried or re-run job gives the same result")
    if check_model:
        _check_layers(job, cli)


def _generate_rules(job, cli: bool) -> None:
    from ster_dist.commands.core import check_prompt_flags
    from ster_dist.generate import Sampling

    fields = job.fields
    if cli:
        check_prompt_flags(fields.get("prompt"), fields.get("prompts"), fields.get("output"))
    elif (fields.get("prompt") is None) == (fields.get("prompts") is None):
        raise Refusal("a generate job spec needs exactly one of the fields 'prompt' (text) or 'prompts' (a file)")
    elif fields.get("prompts") is not None and fields.get("output") is None:
        raise Refusal("a generate job spec with 'prompts' needs 'output', the file for the answers")
    ns = job.namespace()
    Sampling(ns.max_new_tokens, ns.temperature, ns.top_p, ns.seed).check(lambda dest: label(dest, cli))
    if ns.temperature > 0 and "seed" not in fields and not cli:
        raise Refusal(f"a generate job spec that samples (temperature {ns.temperature}) must state 'seed', "
                      "so that a retried or re-run job gives the same answer")


def _layers(dest: str, value, count: int, cli: bool = False) -> list[int]:
    """The layers a field names, read with the --layers grammar of the commands (all, 5, 8..16,
    comma lists), checked against `count` layers."""
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    try:
        from ster_dist.steer.layers import parse_layers
    except ImportError:  # a build without steering: plain indexes only
        def parse_layers(spec: str, count: int) -> list[int]:
            try:
                layers = [int(part) for part in spec.split(",")]
            except ValueError:
                raise Refusal(f"invalid layer list {spec!r}; use indexes such as 3,5") from None
            for layer in layers:
                if not 0 <= layer < count:
                    raise Refusal(f"layer {layer} is outside the model's 0..{count - 1} range")
            return layers
    try:
        return parse_layers(text, count)
    except Refusal as refusal:
        raise Refusal(f"{label(dest, cli)}: {refusal}") from None


def _check_layers(job, cli: bool) -> None:
    """Layers written wrongly, always; a layer the model does not have, when the model is a local
    directory (its config only: no weight is read)."""
    layer_fields = {d: v for d, v in job.fields.items() if d in ("layer", "layers") and v is not None}
    if not layer_fields:
        return
    for dest, value in layer_fields.items():
        _layers(dest, value, _SYNTAX_ONLY, cli)
    model = job.fields.get("model")
    if not isinstance(model, str) or not Path(model).is_dir():
        return
    from ster_dist.config_load import model_config
    from ster_dist.resolve import resolve

    count = model_config(resolve(model, job.fields.get("revision"))).num_layers
    for dest, value in layer_fields.items():
        _layers(dest, value, count, cli)

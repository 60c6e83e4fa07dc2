"""`--layers`: Ster's layer-selection grammar (all, a comma list, half-open ranges) checked against
the model's layer count, with Ster's refusal sentences."""

from __future__ import annotations

from ster_dist.errors import Refusal


def parse_layers(spec: str, count: int) -> list[int]:
    """The sorted, deduplicated 0-based layers `spec` names: `all`, `5`, `8..16` (end excluded) or a
    comma list of those; refused when unparsable, empty or past the model's layers."""
    if count <= 0:
        raise Refusal("model has no layers")
    text = (spec or "").strip()
    if text == "all":
        return list(range(count))
    chosen: set[int] = set()
    for segment in (s.strip() for s in text.split(",")):
        if not segment:
            continue
        if ".." in segment:
            start, _, end = segment.partition("..")
            try:
                a, b = int(start.strip()), int(end.strip())
            except ValueError:
                raise Refusal(
                    f'invalid layer range "{segment}"; write it as START..END, e.g. 8..16'
                ) from None
            if a < 0 or b < 0:
                raise Refusal(
                    f'invalid layer range "{segment}"; layers are 0-based and not negative'
                )
            if a >= b:
                raise Refusal(
                    f'layer range "{segment}" must have start < end (the end is excluded)'
                )
            chosen.update(range(a, b))
        else:
            try:
                layer = int(segment)
            except ValueError:
                raise Refusal(
                    f'invalid layer "{segment}"; use an index, a range such as 8..16, or all'
                ) from None
            if layer < 0:
                raise Refusal(f'invalid layer "{segment}"; layers are 0-based and not negative')
            chosen.add(layer)
    if not chosen:
        raise Refusal("no layers selected; name at least one layer or use --layers all")
    layers = sorted(chosen)
    check_layers(layers, count)
    return layers


def check_layers(layers: list[int], count: int) -> None:
    """Every layer exists in a model of `count` layers (artifact layers arrive here too)."""
    if not layers:
        raise Refusal("at least one layer is required")
    for layer in layers:
        if not 0 <= layer < count:
            raise Refusal(
                f"layer {layer} is outside the model's 0..{count - 1} range "
                f"({count} layers, 0-based); choose layers from 0 to {count - 1}"
            )

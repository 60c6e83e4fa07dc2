"""Ster's activation artifact (`ster extract --format ster-json`), schema 1.

    {"schema_version": 1, "product": "ster", "model", "model_revision", "hidden_size",
     "records": [{"prompt", "layers": {"<layer>": [hidden_size f32 values]}}]}

One record per prompt, in the set's order; `layers` maps each 0-based block index (a JSON string
key, in ascending order as Ster's BTreeMap writes them) to the final-token residual after that
block, before any steering. Written whole, compact, floats as f32 (ster_json), like Ster's file.
Ster reads none back; `read_activations` here checks one for the tests and for analysis.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ster_dist.atomic import replacing
from ster_dist.errors import Refusal
from ster_dist.steer.artifact import PRODUCT, SCHEMA_VERSION
from ster_dist.steer.ster_json import F32, dumps


def activation_document(
    model: str,
    revision: str | None,
    hidden_size: int,
    prompts: list[str],
    rows: dict[int, torch.Tensor],
) -> dict:
    """rows: {layer: [prompts, hidden] f32}, the last-token reads."""
    layers = sorted(rows)
    for layer in layers:
        if not bool(rows[layer].isfinite().all()):
            raise Refusal(
                f"layer {layer} read a non-finite activation; "
                "check the model's weights and precision"
            )
    return {
        "schema_version": SCHEMA_VERSION,
        "product": PRODUCT,
        "model": model,
        "model_revision": revision,
        "hidden_size": hidden_size,
        "records": [
            {
                "prompt": prompt,
                "layers": {
                    str(layer): [F32(x) for x in rows[layer][i].float().tolist()]
                    for layer in layers
                },
            }
            for i, prompt in enumerate(prompts)
        ],
    }


def write_activations(path: Path, document: dict) -> None:
    with replacing(Path(path)) as handle:
        handle.write(dumps(document))


def read_activations(path: str) -> dict:
    """The document, checked: Ster's product and schema, every vector hidden_size finite numbers."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refusal(
            f"invalid activation artifact JSON in {path}: {getattr(exc, 'msg', exc)}"
        ) from None
    if (
        not isinstance(data, dict)
        or data.get("product") != PRODUCT
        or data.get("schema_version") != SCHEMA_VERSION
    ):
        raise Refusal(f"{path} is not a Ster schema-1 activation artifact")
    width = data.get("hidden_size")
    for record in data.get("records") or []:
        for layer, values in record["layers"].items():
            if len(values) != width or not bool(torch.tensor(values).isfinite().all()):
                raise Refusal(f"layer {layer} of {record['prompt']!r} is not {width} finite values")
    return data

"""extract: residual-stream hidden states at the named layers, streamed to safetensors.

The file holds `layers.{L}` (F32, [rows, hidden]: one row per prompt with positions "last", one per
token of every prompt, prompt after prompt, with "all"), `lengths` (I64, tokens per prompt), with
"all" `token_ids` (I64, the tokens those rows belong to), and a metadata block: model,
model_revision ("" when none), precision, chat_template, layers (a JSON list), positions,
hidden_size, prompts. Batches go to disk as they are read, and the file appears whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.inputs import output_not_an_input, writable_file
from ster_dist.schema.capture import ExtractRequest
from ster_dist.session import Session, modifiers


def extract(session: Session, request: ExtractRequest) -> dict:
    from ster_dist.steer.bar import bar
    from ster_dist.steer.capture import capture
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.pairs import load_prompts
    from ster_dist.steer.store import StreamedSafetensors
    from ster_dist.steer.text import chat_status, encode_prompt

    positions, mode, batch_size = request.positions, request.chat_template, request.batch_size
    if request.format == "ster-json":
        return _extract_ster_json(session, request)
    writable_file(request.output, request.label("output"), ".safetensors file")
    output_not_an_input(request)
    output = Path(request.output)
    prompts = load_prompts(request.input)
    cfg = session.cfg
    layers = parse_layers(request.layers, cfg.num_layers)
    with modifiers(session, request, steering=False):
        tokenizer = session.tokenizer
        chat = chat_status(tokenizer, mode)
        encoded = [encode_prompt(tokenizer, p, mode) for p in prompts]
        for ids in encoded:
            if len(ids) > cfg.max_position:
                raise Refusal(
                    f"prompt contains {len(ids)} tokens, model context allows {cfg.max_position}; "
                    "shorten it"
                )
        lengths = torch.tensor([len(ids) for ids in encoded], dtype=torch.long)
        rows = len(encoded) if positions == "last" else int(lengths.sum())
        tensors = {f"layers.{layer}": (torch.float32, (rows, cfg.hidden_size)) for layer in layers}
        tensors["lengths"] = (torch.int64, (len(encoded),))
        if positions == "all":
            tensors["token_ids"] = (torch.int64, (rows,))
        revision = session.checkpoint.model_revision
        metadata = {
            "format": "ster_dist.activations",
            "model": request.model,
            "model_revision": revision or "",
            "precision": request.precision,
            "chat_template": chat,
            "layers": json.dumps(layers),
            "positions": positions,
            "hidden_size": str(cfg.hidden_size),
            "prompts": str(len(encoded)),
            "adapter": request.adapter or "",
        }
        progress(
            f"capturing {len(encoded)} prompts at layers {layers} ({positions} positions) in batches of "
            f"{batch_size}"
        )
        update = bar("extract")
        group = session.group
        with StreamedSafetensors(output, tensors, metadata) as store:
            store.write_rows("lengths", 0, lengths)
            if positions == "all":
                store.write_rows("token_ids", 0, torch.tensor([t for ids in encoded for t in ids]))
            row = 0
            for start, read in capture(
                group, encoded, layers, positions, session.pad_id, batch_size
            ):
                for layer in layers:
                    store.write_rows(f"layers.{layer}", row, read[layer])
                row += read[layers[0]].shape[0]
                update(min(start + batch_size, len(encoded)), len(encoded))
    return {
        "model": request.model,
        "model_revision": revision,
        "precision": request.precision,
        "chat_template": chat,
        "layers": layers,
        "positions": positions,
        "hidden_size": cfg.hidden_size,
        "prompts": len(encoded),
        "rows": rows,
        "tp": request.tp,
        "adapter": request.adapter,
        "output": str(output),
    }


def _extract_ster_json(session: Session, request: ExtractRequest) -> dict:
    """Ster's activation artifact: the last-token read of every prompt, before any steering."""
    from ster_dist.steer.activation import activation_document, write_activations
    from ster_dist.steer.capture import last_token_rows
    from ster_dist.steer.layers import parse_layers
    from ster_dist.steer.pairs import load_prompts
    from ster_dist.steer.text import chat_status, encode_prompt

    writable_file(request.output, request.label("output"), "activation artifact (JSON)")
    output_not_an_input(request)
    prompts = load_prompts(request.input)
    cfg = session.cfg
    layers = parse_layers(request.layers, cfg.num_layers)
    with modifiers(session, request, steering=False):
        chat = chat_status(session.tokenizer, request.chat_template)
        encoded = [encode_prompt(session.tokenizer, p, request.chat_template) for p in prompts]
        progress(
            f"capturing {len(encoded)} prompts at layers {layers} (last positions) for Ster's activation artifact"
        )
        rows = last_token_rows(session.group, encoded, layers, session.pad_id, request.batch_size)
        revision = session.checkpoint.model_revision
    write_activations(
        Path(request.output),
        activation_document(request.model, revision, cfg.hidden_size, prompts, rows),
    )
    return {
        "model": request.model,
        "model_revision": revision,
        "precision": request.precision,
        "chat_template": chat,
        "layers": layers,
        "positions": "last",
        "hidden_size": cfg.hidden_size,
        "prompts": len(prompts),
        "rows": len(prompts),
        "tp": request.tp,
        "adapter": request.adapter,
        "format": "ster-json",
        "output": str(request.output),
    }

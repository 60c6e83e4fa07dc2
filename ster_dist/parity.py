"""`ster parity`: the checkpoint through Transformers and through ster_dist on the same token ids,
compared per layer (residual stream after each layer) and on the logits.

Transformers is a test/reference dependency: it is imported here only, when parity runs.
"""

from __future__ import annotations

import torch

from ster_dist.errors import Refusal
from ster_dist.load import LoadedModel

# Transformers' Mamba models list every layer's output and then the final norm's, with no embedding
# state
# first (the others: the embeddings, each layer's output, the last one replaced by the final norm's)
_NO_EMBEDDING_STATE = {"MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"}
THRESHOLDS = {"f32": (1e-4, 0.9999), "bf16": (5e-2, 0.999), "f16": (1e-4, 0.9999)}


def compare(ours: torch.Tensor, reference: torch.Tensor) -> dict:
    ours, reference = ours.float(), reference.float()
    rel = ((ours - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
    cos = (
        torch.nn.functional.cosine_similarity(
            ours.flatten(1) if ours.dim() > 1 else ours,
            reference.flatten(1) if reference.dim() > 1 else reference,
            dim=-1,
        )
        .mean()
        .item()
    )
    return {"max_relative_error": rel, "mean_cosine": cos}


def reference_model(loaded: LoadedModel, dtype: torch.dtype):
    try:
        import transformers
    except ImportError:
        raise Refusal(
            "ster parity needs Transformers as its reference: pip install 'ster_dist[test]'"
        ) from None
    ckpt = loaded.checkpoint
    if ckpt.weight_format == "mistral":
        raise Refusal(
            f"{ckpt.model} is in Mistral's own format (params.json), which Transformers does not load, "
            "so it has no reference here; run parity on the repository's Transformers-format files"
        )
    kwargs = {"dtype": dtype}
    if ckpt.weight_format == "gguf":
        kwargs["gguf_file"] = ckpt.weight_files[0].name
    else:
        # without it Transformers falls back to a pytorch_model.bin beside the safetensors (when
        # their
        # names are not its own), and a .bin is a pickle: never unpickle what ster_dist did not read
        kwargs["use_safetensors"] = True
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.directory), **kwargs)
    except OSError as exc:
        raise Refusal(
            f"Transformers cannot load the reference from {ckpt.directory}: {str(exc).splitlines()[0]} "
            "(it reads model.safetensors or model.safetensors.index.json only); name the weights so"
        ) from None
    return model.eval()


def token_ids(loaded: LoadedModel, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    low = 3 if loaded.cfg.vocab_size > 8 else 0
    return torch.randint(low, loaded.cfg.vocab_size, (2, length), generator=gen)


@torch.inference_mode()
def ours(loaded: LoadedModel, length: int = 24, seed: int = 0):
    """(token ids, {layer: residual after it}, logits) from ster_dist; every rank runs it. Under
    pipeline parallelism a rank reads the layers its stage holds, and only the last stage has
    logits."""
    model = loaded.model
    ids = token_ids(loaded, length, seed)
    captured: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        return lambda h: captured.__setitem__(layer, h.clone())

    removers = [model.add_hook(i, keep(i)) for i in range(loaded.cfg.num_layers)]
    try:
        logits = model(ids)
    finally:
        for remove in removers:
            remove()
    return ids, captured, logits


@torch.inference_mode()
def run_parity(loaded: LoadedModel, length: int = 24, seed: int = 0, tp: int = 1) -> dict:
    ids, captured, logits = ours(loaded, length, seed)
    return against_reference(loaded, ids, captured, logits, tp)


@torch.inference_mode()
def against_reference(loaded: LoadedModel, ids, captured, logits, tp: int = 1) -> dict:
    model = loaded.model
    dtype = model.dtype
    reference = reference_model(loaded, dtype)
    out = reference(ids, output_hidden_states=True)
    ref_hidden = out.hidden_states
    if type(reference).__name__ in _NO_EMBEDDING_STATE:
        ref_hidden = (None, *ref_hidden)
    layers = []
    for i, h in sorted(captured.items()):
        # Transformers' last hidden state is taken after the final norm
        last = i == loaded.cfg.num_layers - 1
        ours = model.final_norm(h) if last else h
        layers.append({"layer": i, **compare(ours, ref_hidden[-1] if last else ref_hidden[i + 1])})
    result = compare(logits, out.logits)
    rel_limit, cos_limit = THRESHOLDS[loaded.precision]
    worst = max([result["max_relative_error"]] + [l["max_relative_error"] for l in layers])
    lowest = min([result["mean_cosine"]] + [l["mean_cosine"] for l in layers])
    return {
        "model": loaded.checkpoint.model,
        "model_revision": loaded.checkpoint.model_revision,
        "family": loaded.cfg.family,
        "precision": loaded.precision,
        "tp": tp,
        "tokens": list(ids.shape),
        "logits": result,
        "layers": layers,
        "threshold": {"max_relative_error": rel_limit, "mean_cosine": cos_limit},
        "passed": worst <= rel_limit and lowest >= cos_limit,
    }

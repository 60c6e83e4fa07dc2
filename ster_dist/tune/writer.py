"""The trained factors written as a PEFT LoRA adapter directory, with Ster's sidecar fields.

adapter_model.safetensors holds base_model.model.<module>.lora_A.weight [r, inputs] and
.lora_B.weight [outputs, r] under the checkpoint's own module names (q_proj, qkv_proj, c_attn,
query_key_value, ...), so PEFT, vLLM, `ster merge` and `ster generate --adapter` read it as any PEFT
adapter: a fused module's lora_B stacks its parts' rows where the family's layout puts them (the
rows shard/writer.placements gives the merge), and a part that was not trained keeps zero rows,
which add nothing.

adapter_config.json is PEFT's LoraConfig (r, lora_alpha, target_modules, layers_to_transform, scale
alpha / r, no rsLoRA) plus the fields adapters/format.py checks when the adapter is attached or
merged (schema_version, product, kind, model, model_revision, hidden_size) and the run's report
under "train". PEFT ignores keys it does not know, with a warning.

A reward model (`tune reward`) is written as PEFT writes a sequence-classification LoRA: its head as
base_model.model.score.weight [1, hidden] (what modules_to_save=["score"] saves; `score` is the head
of Transformers' *ForSequenceClassification models, loaded with num_labels=1), task_type SEQ_CLS,
and Ster's kind "reward", which `--adapter` refuses for generation (adapters/format.py).

The directory is written beside its final name and renamed into place when complete.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from ster_dist.adapters.format import SCHEMA_VERSION
from ster_dist.atomic import finish_dir, write_bytes, write_json
from ster_dist.errors import Refusal
from ster_dist.tune.lora import TrainSite, global_factors, modules_of

PREFIX = "base_model.model."
# the trained reward head, as the run returns it and as PEFT saves it (after PREFIX)
HEAD = "score.weight"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def peft_tensors(
    sites: list[TrainSite], factors: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """{PEFT tensor name: f32 tensor}: one lora_A per module, its parts' B rows placed in one
    lora_B."""
    pairs = global_factors(factors, sites)
    out: dict[str, torch.Tensor] = {}
    for module in modules_of(sites):
        members = [(site, pair) for site, pair in zip(sites, pairs) if site.module == module]
        first, (a, _) = members[0]
        b = torch.zeros(first.module_rows, rank, dtype=torch.float32)
        for site, (_, b_site) in members:
            if site.runs is None:
                b = b_site.float().clone()
                continue
            for start, stop, offset in site.runs:
                b[start:stop] = b_site[offset : offset + stop - start]
        out[f"{PREFIX}{module}.lora_A.weight"] = a.float().contiguous()
        out[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous()
    if HEAD in factors:
        out[PREFIX + HEAD] = factors[HEAD].float().contiguous()
    return out


def target_modules(sites: list[TrainSite]) -> list[str]:
    """Each module's path after its layer index (self_attn.q_proj, attn.c_proj): PEFT matches a
    target by suffix, and the short name alone would also take a same-named module the run did not
    train (GPT-2's attn.c_proj and mlp.c_proj)."""
    out = []
    for module in modules_of(sites):
        m = re.fullmatch(r".*?\.\d+\.(.+)", module)
        out.append(m.group(1) if m else module)
    return sorted(set(out))


def adapter_config(
    sites: list[TrainSite], report: dict, num_layers: int, reward: bool = False
) -> dict:
    layers = sorted({site.layer for site in sites})
    return {
        # PEFT's LoraConfig
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if reward else "CAUSAL_LM",
        "r": report["rank"],
        "lora_alpha": report["alpha"],
        "target_modules": target_modules(sites),
        "layers_to_transform": None if layers == list(range(num_layers)) else layers,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": any(site.transposed for site in sites),
        "init_lora_weights": True,
        "modules_to_save": ["score"] if reward else None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "base_model_name_or_path": report["model"],
        # Ster's sidecar fields
        "schema_version": SCHEMA_VERSION,
        "product": "ster_dist",
        "kind": "reward" if reward else "adapter",
        "model": report["model"],
        "model_revision": report.get("model_revision"),
        "hidden_size": report["hidden_size"],
        "targets": report["targets"],
        "layers": layers,
        "train": report,
    }


def write_adapter(
    output: str | Path,
    sites: list[TrainSite],
    factors: dict[str, torch.Tensor],
    report: dict,
    num_layers: int,
) -> list[str]:
    """Write the adapter directory at `output` (refused if it exists); returns its file names."""
    from safetensors.torch import save

    output = Path(output)
    if output.exists():
        raise Refusal(f"output {output} already exists; remove it or choose another --output")
    tensors = peft_tensors(sites, factors, report["rank"])
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise Refusal(
                f"training produced a non-finite value in {name}; lower --learning-rate and retrain"
            )
    output.parent.mkdir(parents=True, exist_ok=True)
    # not atomic.staging_dir: when the output appears meanwhile the trained adapter is kept in
    # `work`
    work = output.parent / f".{output.name}.writing-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        # through atomic: the umask's mode (safetensors alone writes owner-only; servers read
        # adapters too)
        write_bytes(work / WEIGHTS, save(tensors, metadata={"format": "pt"}))
        write_json(work / CONFIG, adapter_config(sites, report, num_layers, HEAD in factors))
        if output.exists():
            raise Refusal(f"output {output} appeared while training; the adapter is kept in {work}")
        finish_dir(work, output)
    except BaseException:
        if work.exists() and not output.exists():
            shutil.rmtree(work, ignore_errors=True)
        raise
    return sorted(p.name for p in output.iterdir())

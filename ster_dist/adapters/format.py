"""Adapter formats: PEFT's directory and Ster's safetensors + sidecar, read into one value.

Opening an adapter reads its config or sidecar and its safetensors header only, so every
refusal about what the adapter is, which model it was made for and how its factors are shaped
comes before a factor is read; `read_factors` then reads the factors with positioned reads
(SafetensorsSource). Nothing is unpickled and nothing is memory-mapped.

PEFT: a directory holding adapter_config.json (r, lora_alpha, target_modules,
layers_to_transform, rank_pattern / alpha_pattern, use_rslora) and adapter_model.safetensors,
whose tensors are base_model.model.<module path>.lora_A.weight [r, inputs] and .lora_B.weight
[outputs, r]; the module path is the base checkpoint's own (q_proj, qkv_proj, c_attn,
query_key_value, ...). Each module is scaled by its alpha / r, or alpha / sqrt(r) under rsLoRA.

Ster: <name>.safetensors holding layers.{layer}.{target}.a [rank, inputs] and .b
[outputs, rank], beside <name>.json, the sidecar (schema_version, product, kind, model,
model_revision, rank, alpha, targets, layers, hidden_size, train), scaled by alpha / rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ster_dist.errors import Refusal
from ster_dist.shard.safetensors_header import DTYPES, read_header
from ster_dist.shard.source import SafetensorsSource

TARGETS = ("query", "key", "value", "output", "gate", "up", "down")
# Ster accepts the short name and the Hugging Face projection name for each target
_SPELLINGS = {
    "query": "query",
    "q_proj": "query",
    "q": "query",
    "key": "key",
    "k_proj": "key",
    "k": "key",
    "value": "value",
    "v_proj": "value",
    "v": "value",
    "output": "output",
    "o_proj": "output",
    "o": "output",
    "gate": "gate",
    "gate_proj": "gate",
    "up": "up",
    "up_proj": "up",
    "down": "down",
    "down_proj": "down",
}
SCHEMA_VERSION = 1
_PRODUCTS = ("ster", "ster_dist")
_PEFT_PREFIX = "base_model.model."
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_PICKLED = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Factor:
    """One adapted module as the adapter names it, and the scale its product is multiplied by."""

    key: str  # PEFT: the module path; Ster: "layers.{layer}.{target}"
    a: str  # tensor names in the weights file
    b: str
    a_shape: tuple[int, int]
    b_shape: tuple[int, int]
    rank: int
    alpha: float
    scale: float


@dataclass
class Adapter:
    path: Path  # what --adapter named
    format: str  # "peft" | "ster"
    weights: Path
    factors: tuple[Factor, ...]
    rank: int
    alpha: float
    use_rslora: bool = False
    model: str | None = None  # the model it was made for, when the adapter says
    model_revision: str | None = None
    hidden_size: int | None = None
    kind: str = "adapter"
    # PEFT rank_pattern / alpha_pattern gave some modules their own r or alpha
    patterns: bool = False
    config: dict = field(default_factory=dict, repr=False)

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def files(self) -> list[Path]:
        """Every file the adapter is made of (for fingerprints)."""
        if self.format == "peft":
            return [self.weights, self.weights.parent / "adapter_config.json"]
        return [self.weights, self.weights.with_suffix(".json")]

    def read_factors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Every factor pair, keyed by Factor.key; a non-finite value is refused here."""
        from ster_dist.shard.writer import one_thread

        source = SafetensorsSource([self.weights])
        with one_thread():
            return self._read(source)

    def _read(self, source: SafetensorsSource) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        try:
            out = {}
            for factor in self.factors:
                a, b = source.read(factor.a), source.read(factor.b)
                for name, tensor in ((factor.a, a), (factor.b, b)):
                    if not torch.isfinite(tensor.abs().amax()):  # amax carries a NaN through
                        raise Refusal(
                            f"adapter tensor {name} in {self.weights} contains a non-finite value; "
                            "the adapter is corrupt: retrain or re-export it"
                        )
                out[factor.key] = (a, b)
            return out
        finally:
            source.close()


def open_adapter(path: str | Path) -> Adapter:
    """Recognise and open the adapter at `path` (headers and config only)."""
    path = Path(path)
    if not path.exists():
        raise Refusal(
            f"failed to read adapter {path}: no such file or directory; pass a PEFT adapter "
            "directory or a Ster adapter .safetensors"
        )
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            return _open_peft(path)
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLED)
        if pickled:
            raise Refusal(
                f"adapter {path} holds only pickled weights ({', '.join(pickled)}), which ster_dist "
                "never reads; save the adapter with safe_serialization (adapter_model.safetensors)"
            )
        raise Refusal(
            f"adapter directory {path} holds no adapter_config.json; pass a PEFT adapter directory "
            "or a Ster adapter .safetensors"
        )
    if path.suffix in _PICKLED:
        raise Refusal(
            f"adapter {path} is a pickled file, which ster_dist never reads; "
            "save the adapter as safetensors"
        )
    if path.suffix == ".json":
        document = _read_json(path, "adapter sidecar")
        _refuse_steering(path, document)
        return _open_ster(path.with_suffix(".safetensors"), path, document)
    sidecar = path.with_suffix(".json")
    if sidecar.is_file():
        return _open_ster(path, sidecar, None)
    # adapter_model.safetensors inside a PEFT directory
    if (path.parent / "adapter_config.json").is_file():
        return _open_peft(path.parent)
    raise Refusal(
        f"adapter {path} has no sidecar at {sidecar}; the pair is written together and must "
        "travel together"
    )


def is_steering_artifact(document) -> bool:
    """A steering artifact carries a trait_name and vectors (per layer); an adapter, a rank and
    targets."""
    if not isinstance(document, dict) or "trait_name" not in document:
        return False
    layers = document.get("layers")
    return "vectors" in document or (
        isinstance(layers, list)
        and any(isinstance(entry, dict) and "vector" in entry for entry in layers)
    )


def _refuse_steering(path: Path, document) -> None:
    if is_steering_artifact(document):
        raise Refusal(
            f"{path} is a steering artifact, not a LoRA adapter sidecar: it carries trait_name and "
            "vectors where an adapter sidecar carries rank and targets"
        )


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise Refusal(f"failed to read {what} {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refusal(f"invalid {what} JSON in {path}: {exc}; re-export the adapter") from None
    except RecursionError:  # arrays or objects nested past json.loads' depth
        raise Refusal(
            f"invalid {what} JSON in {path}: it nests too deeply to be read; re-export the adapter"
        ) from None


def _header(weights: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if not weights.is_file():
        raise Refusal(
            f"failed to read adapter weights {weights}: no such file; the adapter is incomplete"
        )
    out = {}
    for name, info in read_header(weights).tensors.items():
        dtype = DTYPES.get(info.get("dtype"))
        if dtype not in _FLOATS:
            raise Refusal(
                f"adapter tensor {name} in {weights} is {info.get('dtype')}; LoRA factors must be "
                "F32, F16 or BF16"
            )
        out[name] = (tuple(info.get("shape", ())), dtype)
    return out


# ---- Ster ------------------------------------------------------------------------------------


def _open_ster(weights: Path, sidecar: Path, document) -> Adapter:
    if not weights.is_file():
        raise Refusal(
            f"failed to read adapter {weights}: the sidecar {sidecar} has no weights beside it"
        )
    if document is None:
        document = _read_json(sidecar, "adapter sidecar")
        _refuse_steering(sidecar, document)
    if not isinstance(document, dict):
        raise Refusal(f"invalid adapter sidecar JSON in {sidecar}: expected an object")
    missing = [
        k
        for k in (
            "schema_version",
            "product",
            "model",
            "rank",
            "alpha",
            "targets",
            "layers",
            "hidden_size",
        )
        if k not in document
    ]
    if missing:
        raise Refusal(f"invalid adapter sidecar JSON in {sidecar}: missing {', '.join(missing)}")
    if document["schema_version"] != SCHEMA_VERSION:
        raise Refusal(
            f"adapter artifact schema {document['schema_version']} is unsupported; this ster_dist "
            f"build reads schema {SCHEMA_VERSION}"
        )
    if document["product"] not in _PRODUCTS:
        raise Refusal(f"adapter artifact belongs to product {document['product']!r}, not Ster")
    kind = document.get("kind", "adapter")
    if kind != "adapter":
        raise Refusal(
            f"adapter artifact is a {kind} model, not a generation adapter; pass a generation adapter "
            "(tune sft or tune dpo writes one)"
        )
    rank, alpha, hidden = document["rank"], document["alpha"], document["hidden_size"]
    if not isinstance(rank, int) or rank <= 0:
        raise Refusal(
            f"adapter artifact declares rank {rank}, which stores nothing; retrain with rank >= 1"
        )
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise Refusal(
            f"adapter artifact declares alpha {alpha}, which is not a positive finite number"
        )
    if not isinstance(hidden, int) or hidden <= 0:
        raise Refusal(f"adapter artifact declares hidden size {hidden}")
    targets = [_target(t, sidecar) for t in document["targets"] or ()]
    layers = document["layers"] or []
    if not targets:
        raise Refusal("adapter artifact names no targets")
    if not layers or not all(isinstance(layer, int) and layer >= 0 for layer in layers):
        raise Refusal(
            f"adapter artifact names no layers (or a layer that is not a number): {layers}"
        )
    for seq, what in ((targets, "target"), (layers, "layer")):
        twice = [x for i, x in enumerate(seq) if x in seq[:i]]
        if twice:
            raise Refusal(f"adapter artifact names {what} {twice[0]} twice")
    header = _header(weights)
    factors, declared = [], set()
    for layer in layers:
        for target in targets:
            a, b = f"layers.{layer}.{target}.a", f"layers.{layer}.{target}.b"
            declared |= {a, b}
            for name in (a, b):
                if name not in header:
                    raise Refusal(f"adapter artifact is missing tensor {name}")
            a_shape, b_shape = header[a][0], header[b][0]
            for name, shape, axis in ((a, a_shape, 0), (b, b_shape, 1)):
                if len(shape) != 2:
                    raise Refusal(f"adapter tensor {name} has {len(shape)} dimensions, expected 2")
                if shape[axis] != rank:
                    raise Refusal(
                        f"adapter tensor {name} has {shape[axis]} {('rows', 'columns')[axis]}, "
                        f"expected {rank}"
                    )
            factors.append(
                Factor(
                    f"layers.{layer}.{target}",
                    a,
                    b,
                    a_shape,
                    b_shape,
                    rank,
                    float(alpha),
                    float(alpha) / rank,
                )
            )
    extra = sorted(set(header) - declared)
    if extra:
        raise Refusal(
            f"adapter artifact carries tensor {extra[0]} that its sidecar does not declare "
            f"({len(extra)} in all); the sidecar and the weights disagree"
        )
    return Adapter(
        weights,
        "ster",
        weights,
        tuple(factors),
        rank,
        float(alpha),
        model=document["model"],
        model_revision=document.get("model_revision"),
        hidden_size=hidden,
        config=document,
    )


def _target(text, where: Path) -> str:
    target = _SPELLINGS.get(str(text).strip().lower())
    if target is None:
        raise Refusal(
            f"unknown adapter target {text!r} in {where}; expected one of {', '.join(TARGETS)}"
        )
    return target


# ---- PEFT ------------------------------------------------------------------------------------


def _open_peft(directory: Path) -> Adapter:
    config = _read_json(directory / "adapter_config.json", "adapter config")
    if not isinstance(config, dict):
        raise Refusal(
            f"invalid adapter config JSON in {directory / 'adapter_config.json'}: expected an object"
        )
    _refuse_steering(directory / "adapter_config.json", config)
    kind = str(config.get("peft_type") or "LORA").upper()
    if kind != "LORA":
        raise Refusal(
            f"adapter {directory} is a PEFT {kind} adapter; only LoRA adapters are merged or attached"
        )
    # before modules_to_save: a reward model carries its head so
    if config.get("kind", "adapter") != "adapter":
        raise Refusal(
            f"adapter artifact is a {config['kind']} model, not a generation adapter; pass a generation "
            "adapter (tune sft or tune dpo writes one)"
        )
    refused = {
        "use_dora": "it is a DoRA adapter (a learned magnitude per row), which is not a plain low-rank update",
        "modules_to_save": "it carries whole trained modules (modules_to_save), which are not low-rank updates",
        "lora_bias": "it trains biases beside the factors (lora_bias)",
        "target_parameters": "it adapts raw parameters (target_parameters), not projection modules",
        "trainable_token_indices": "it trains token embeddings (trainable_token_indices)",
    }
    for key, why in refused.items():
        if config.get(key):
            raise Refusal(
                f"adapter {directory} cannot be applied: {why}; export a plain LoRA adapter"
            )
    if config.get("bias", "none") not in ("none", None):
        raise Refusal(
            f"adapter {directory} cannot be applied: it trains biases (bias={config['bias']!r}); "
            "export a plain LoRA adapter with bias='none'"
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        raise Refusal(
            f"adapter config {directory / 'adapter_config.json'} gives r={rank}; LoRA needs r >= 1"
        )
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise Refusal(
            f"adapter config {directory / 'adapter_config.json'} gives lora_alpha={alpha}"
        )
    rslora = bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = (
        config.get("rank_pattern") or {},
        config.get("alpha_pattern") or {},
    )
    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        pickled = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLED)
        if pickled:
            raise Refusal(
                f"adapter {directory} holds only pickled weights ({', '.join(pickled)}), which ster_dist "
                "never reads; save the adapter with safe_serialization (adapter_model.safetensors)"
            )
        raise Refusal(f"failed to read adapter weights {weights}: no such file")
    header = _header(weights)
    modules: dict[str, dict[str, str]] = {}
    for name in header:
        stripped = name.removeprefix(_PEFT_PREFIX)
        m = re.fullmatch(r"(.+)\.lora_([AB])\.weight", stripped)
        if m is None:
            what = (
                "an embedding (lora_embedding)"
                if "lora_embedding" in name
                else "a DoRA magnitude"
                if "lora_magnitude" in name
                else "not a LoRA factor"
            )
            raise Refusal(
                f"adapter tensor {name} in {weights} is {what}; ster_dist applies lora_A / lora_B "
                "factors of projection modules only"
            )
        modules.setdefault(m.group(1), {})[m.group(2)] = name
    if not modules:
        raise Refusal(f"adapter {weights} holds no LoRA factors")
    factors = []
    for module in sorted(modules, key=_natural):
        pair = modules[module]
        if set(pair) != {"A", "B"}:
            raise Refusal(
                f"adapter module {module} has lora_{'A' if 'A' in pair else 'B'} without "
                f"lora_{'B' if 'A' in pair else 'A'}; the adapter is incomplete"
            )
        r = rank_pattern.get(_pattern_key(rank_pattern, module), rank)
        a_ = alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha)
        a_shape, b_shape = header[pair["A"]][0], header[pair["B"]][0]
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise Refusal(
                f"adapter module {module} has factors of shapes {list(a_shape)} and {list(b_shape)}; "
                "expected two matrices"
            )
        if a_shape[0] != r or b_shape[1] != r:
            raise Refusal(
                f"adapter module {module} has factors of rank {a_shape[0]} x {b_shape[1]} but "
                f"adapter_config.json gives it r={r}; the config and the weights disagree"
            )
        scale = a_ / math.sqrt(r) if rslora else a_ / r
        factors.append(Factor(module, pair["A"], pair["B"], a_shape, b_shape, r, float(a_), scale))
    return Adapter(
        directory,
        "peft",
        weights,
        tuple(factors),
        rank,
        float(alpha),
        rslora,
        model=config.get("model") or config.get("base_model_name_or_path"),
        model_revision=config.get("model_revision") or config.get("revision"),
        hidden_size=config.get("hidden_size"),
        patterns=bool(rank_pattern or alpha_pattern),
        config=config,
    )


def _pattern_key(patterns: dict, module: str) -> str:
    """PEFT's rule for rank_pattern / alpha_pattern: the first key matching a dotted suffix of the
    module."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def same_model(declared: str | None, model: str) -> bool:
    """Whether an adapter's declared base is this --model: the same string, the same last path
    component (a Hub id and a local copy named after it), or the Hub id a cache snapshot holds."""
    if not declared or declared == model:
        return True
    return bool(_names(declared) & _names(model))


def _names(model: str) -> set[str]:
    parts = Path(model.rstrip("/")).parts
    names = {parts[-1]} if parts else set()
    for part in parts:  # .../models--org--name/snapshots/<sha>
        if part.startswith("models--"):
            names.add(part.split("--")[-1])
    return names

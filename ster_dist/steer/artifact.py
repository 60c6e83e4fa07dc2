"""Ster's steering artifact, schema 1: a model-bound set of unit directions, one per layer.

Wire shape (compact JSON, byte for byte as Ster writes it, floats as f32: ster_json):
schema_version, product "ster", model (the --model string it was fitted with), model_revision,
trait_name, method, hidden_size, vectors [{layer, values, train_margin, train_accuracy}], metadata
(string to string), precision, chat_template (applied / absent / off: how its pairs were encoded).
precision and chat_template may be null or absent (files written before Ster recorded them), and
then nothing is compared. metadata["weights_fingerprint"] (written here, absent from Ster's files)
names the weights the vector was read from (shard/fingerprint.py): where both sides have one, it
decides whether a model matches, whatever path either was loaded from.

Refusals are Ster's sentences: schema, product, no vectors, width, non-finite; for a run: another
model, another width, a layer the model lacks; and a LoRA adapter handed over as a vector.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ster_dist.atomic import replacing
from ster_dist.errors import Refusal
from ster_dist.inputs import read_bytes
from ster_dist.shard.safetensors_header import read_header
from ster_dist.steer.layers import check_layers
from ster_dist.steer.ster_json import F32, dumps

SCHEMA_VERSION = 1
PRODUCT = "ster"


def _f32(value: float) -> float:
    return float(torch.tensor(float(value), dtype=torch.float32))


@dataclass
class Direction:
    layer: int
    values: torch.Tensor  # [hidden] f32
    train_accuracy: float
    train_margin: float

    def __post_init__(self):
        # Ster holds the scores as f32: the value in memory is the one the file reads back as
        self.train_accuracy = _f32(self.train_accuracy)
        self.train_margin = _f32(self.train_margin)

    @property
    def norm(self) -> float:
        return float(self.values.double().norm())


@dataclass
class SteeringArtifact:
    model: str
    model_revision: str | None
    trait_name: str
    method: str
    hidden_size: int
    vectors: list[Direction]
    precision: str | None = None
    chat_template: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    product: str = PRODUCT

    # -- checks ---------------------------------------------------------------
    def validate(self) -> SteeringArtifact:
        if self.schema_version != SCHEMA_VERSION:
            raise Refusal(
                f"artifact schema {self.schema_version} is unsupported; this Ster build reads schema "
                f"{SCHEMA_VERSION}: retrain the vector with this build"
            )
        if self.product != PRODUCT:
            raise Refusal(
                f'artifact belongs to product "{self.product}", not Ster: supply a Ster steering artifact'
            )
        if self.hidden_size <= 0 or not self.vectors:
            raise Refusal("artifact has no steering vectors: retrain it")
        for vector in self.vectors:
            if vector.values.numel() != self.hidden_size:
                raise Refusal(
                    f"layer {vector.layer} has vector width {vector.values.numel()}, expected "
                    f"{self.hidden_size}: restore the untampered file or retrain"
                )
            if not bool(vector.values.isfinite().all()):
                raise Refusal(
                    f"layer {vector.layer} contains a non-finite value: retrain it; do not apply it"
                )
        return self

    @property
    def layers(self) -> list[int]:
        return [v.layer for v in self.vectors]

    # -- wire form ------------------------------------------------------------
    def to_json(self) -> dict:
        """Ster's field order (schema 1, then the newer precision and chat_template); every float an
        F32, so the text is the one Ster writes (ster_json)."""
        return {
            "schema_version": self.schema_version,
            "product": self.product,
            "model": self.model,
            "model_revision": self.model_revision,
            "trait_name": self.trait_name,
            "method": self.method,
            "hidden_size": self.hidden_size,
            "vectors": [
                {
                    "layer": v.layer,
                    "values": [F32(x) for x in v.values.float().tolist()],
                    "train_margin": F32(v.train_margin),
                    "train_accuracy": F32(v.train_accuracy),
                }
                for v in self.vectors
            ],
            "metadata": dict(self.metadata),
            "precision": self.precision,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_json(cls, data, where: str) -> SteeringArtifact:
        def bad(why: str):
            return Refusal(
                f"invalid steering artifact JSON in {where}: {why}; regenerate it against schema 1"
            )

        if not isinstance(data, dict):
            raise bad("not a JSON object")
        required = (
            "schema_version",
            "product",
            "model",
            "trait_name",
            "method",
            "hidden_size",
            "vectors",
        )
        missing = [k for k in required if k not in data]
        if missing:
            raise bad(f"missing field {missing[0]}")
        if not isinstance(data["schema_version"], int) or isinstance(data["schema_version"], bool):
            raise bad("schema_version must be an integer")
        # say the version before any other shape complaint
        if data["schema_version"] != SCHEMA_VERSION:
            cls._version_refusal(data["schema_version"])
        for key in ("product", "model", "trait_name", "method"):
            if not isinstance(data[key], str):
                raise bad(f"{key} must be a string")
        for key in ("model_revision", "precision", "chat_template"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise bad(f"{key} must be a string or null")
        if not isinstance(data["hidden_size"], int) or data["hidden_size"] < 0:
            raise bad("hidden_size must be a non-negative integer")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise bad("metadata must map strings to strings")
        if not isinstance(data["vectors"], list):
            raise bad("vectors must be a list")
        vectors = []
        for entry in data["vectors"]:
            values = entry.get("values") if isinstance(entry, dict) else None
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("layer"), int)
                or entry["layer"] < 0
                or not isinstance(values, list)
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in values)
            ):
                raise bad(
                    "every vector needs a 0-based integer layer and a list of numbers in values"
                )
            try:
                accuracy, margin = float(entry["train_accuracy"]), float(entry["train_margin"])
            except (KeyError, TypeError, ValueError):
                raise bad(
                    f"vector at layer {entry['layer']} needs numeric train_accuracy and train_margin"
                ) from None
            vectors.append(
                Direction(
                    entry["layer"], torch.tensor(values, dtype=torch.float32), accuracy, margin
                )
            )
        return cls(
            model=data["model"],
            model_revision=data.get("model_revision"),
            trait_name=data["trait_name"],
            method=data["method"],
            hidden_size=data["hidden_size"],
            vectors=vectors,
            precision=data.get("precision"),
            chat_template=data.get("chat_template"),
            metadata=dict(metadata),
            schema_version=data["schema_version"],
            product=data["product"],
        ).validate()

    @staticmethod
    def _version_refusal(version) -> None:
        raise Refusal(
            f"artifact schema {version} is unsupported; this Ster build reads schema {SCHEMA_VERSION}: "
            "retrain the vector with this build"
        )

    def summary(self) -> dict:
        """What `inspect`, `train` and `optimize` print: everything but the floats."""
        return {
            "schema_version": self.schema_version,
            "product": self.product,
            "model": self.model,
            "model_revision": self.model_revision,
            "trait_name": self.trait_name,
            "method": self.method,
            "hidden_size": self.hidden_size,
            "precision": self.precision,
            "chat_template": self.chat_template,
            "metadata": dict(self.metadata),
            "layers": [
                {
                    "layer": v.layer,
                    "width": v.values.numel(),
                    "norm": v.norm,
                    "train_accuracy": v.train_accuracy,
                    "train_margin": v.train_margin,
                }
                for v in self.vectors
            ],
        }

    # -- files ----------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Validated, compact JSON, written beside the target and renamed."""
        self.validate()
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Refusal(f"failed to create {path.parent}: {exc.strerror or exc}") from None
        try:
            with replacing(path) as handle:
                handle.write(dumps(self.to_json()))
        except OSError as exc:
            raise Refusal(
                f"failed to write steering artifact {path}: {exc.strerror or exc}"
            ) from None


def load_artifact(path: str) -> SteeringArtifact:
    """Read and validate a steering artifact; a LoRA adapter (directory, PEFT config, adapter
    weights or a Ster adapter sidecar) is refused by name before anything else."""
    target = Path(path)
    adapter = _adapter_kind(target)
    if adapter:
        raise Refusal(
            f"{path} is a LoRA adapter ({adapter}), not a steering artifact: pass it as --adapter, "
            "and a steering vector (trait_name and vectors, from ster steer train) as --vector"
        )
    if target.is_dir():
        raise Refusal(
            f"{path} is a directory, not a steering artifact: pass the V.json that ster steer train wrote"
        )
    data = read_bytes(path, "failed to read steering artifact")
    try:
        parsed = json.loads(data)
    except RecursionError:  # json.loads' depth limit, reached by a file of ordinary size
        raise Refusal(
            f"invalid steering artifact JSON in {path}: its arrays or objects nest too deeply; "
            "flatten it"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Refusal(
            f"invalid steering artifact JSON in {path}: {getattr(exc, 'msg', exc)}; "
            "pass the V.json that ster steer train wrote"
        ) from None
    return SteeringArtifact.from_json(parsed, path)


def _adapter_kind(path: Path) -> str | None:
    """What makes `path` a LoRA adapter, or None. Reads only JSON and safetensors headers."""
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            return "a PEFT adapter directory with adapter_config.json"
        if any(path.glob("adapter_model*.safetensors")):
            return "a directory of adapter weights"
        return None
    if not path.is_file():
        return None
    if path.suffix == ".safetensors":
        names = _safetensors_names(path)
        if any("lora_" in n for n in names):
            return "LoRA weights in safetensors"
        return None
    # bounded as every input is; a file it cannot parse is no adapter, and load_artifact says why
    try:
        data = json.loads(read_bytes(str(path), "steering artifact"))
    except (Refusal, RecursionError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if "rank" in data and "targets" in data:
        return (
            "a Ster adapter sidecar: it carries rank and targets where a steering artifact carries "
            "trait_name and vectors"
        )
    if "peft_type" in data or ("r" in data and "target_modules" in data):
        return "a PEFT adapter_config.json"
    return None


def _safetensors_names(path: Path) -> list[str]:
    try:
        return list(read_header(path).tensors)
    except Refusal:  # not a safetensors file: no names to recognise it by
        return []


def is_steering_artifact(path: str) -> bool:
    """True when `path` is a steering artifact (a JSON object with trait_name and vectors): for the
    adapter side, which refuses one passed as --adapter."""
    target = Path(path)
    if not target.is_file():
        return False
    try:
        data = json.loads(target.read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "trait_name" in data and "vectors" in data


# -- the artifact against a run ----------------------------------------------------------------
def same_model(fitted: str, loaded: str) -> bool:
    """Ster's gate is string equality on --model; two spellings of one local directory match too."""
    if fitted == loaded:
        return True
    a, b = Path(fitted).expanduser(), Path(loaded).expanduser()
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


# the metadata key holding the fitted model's weights fingerprint (shard/fingerprint.py); Ster's
# metadata is string to string, so a file with it still reads in Ster
FINGERPRINT = "weights_fingerprint"


def check_for_run(
    artifact: SteeringArtifact,
    model: str,
    hidden_size: int,
    num_layers: int,
    verb: str = "generate",
    fingerprint: str | None = None,
) -> None:
    """Refuse an artifact fitted for another model, width or depth, before it touches a rank. The
    model is the same when the artifact's weights fingerprint is the loaded one's (another path to
    the same weights, a copy, an export), or, for an artifact without one, when the path names the
    same."""
    recorded = artifact.metadata.get(FINGERPRINT)
    if recorded is not None and fingerprint is not None:
        if recorded != fingerprint:
            raise Refusal(
                f'artifact was trained for model "{artifact.model}", current model is "{model}" (weights '
                f"{fingerprint[:19]}..., not the {recorded[:19]}... it was fitted on): load the model it "
                "was trained for, or retrain it for this one"
            )
    elif not same_model(artifact.model, model):
        if verb == "evaluate":
            raise Refusal(
                f'artifact model "{artifact.model}" does not match runtime model "{model}": '
                "load the model it was fitted with, or retrain it for this one"
            )
        raise Refusal(
            f'artifact was trained for model "{artifact.model}", current model is "{model}": '
            "load the model it was trained for, or retrain it for this one"
        )
    if artifact.hidden_size != hidden_size:
        raise Refusal(
            f"artifact width {artifact.hidden_size} does not match model width {hidden_size}: "
            "use the artifact with the checkpoint it was fitted on"
        )
    check_layers(artifact.layers, num_layers)


def provenance_warnings(
    artifact: SteeringArtifact, precision: str, chat: str, effect: str
) -> list[str]:
    """Ster's warnings (not refusals: a transfer may be measured on purpose) when this run reads
    the direction at another precision or in another prompt format than it was fitted in.
    `effect` ends the chat sentence ("the number below describes" / "it steers")."""
    warnings = []
    applied = {"applied": "applied", "absent": "off", "off": "off"}
    if artifact.chat_template is not None and applied.get(artifact.chat_template) != applied.get(
        chat
    ):
        warnings.append(
            f"warning: this direction was trained with chat template {artifact.chat_template} and "
            f"this run encodes {chat}, so {effect} a format it was not trained in"
        )
    if artifact.precision is not None and artifact.precision != precision:
        warnings.append(
            f"warning: this direction was trained at precision {artifact.precision} and this run "
            f"maps the base weights at {precision}, so it is being read in a different space "
            "than it was fitted in"
        )
    return warnings


def finite(value: float) -> float:
    """JSON has no NaN: a score that is not finite is refused at the source instead of written."""
    if not math.isfinite(value):
        raise Refusal("a training score is not finite; check the pairs and the model's activations")
    return value

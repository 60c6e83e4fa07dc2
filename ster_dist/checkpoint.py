"""Checkpoint: what resolution hands to everything after it (a value, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Checkpoint:
    """A resolved model: its local directory, the files to read, and provenance.

    weight_format is "safetensors" (Transformers layout), "mistral"
    (consolidated*.safetensors beside params.json) or "gguf" (one .gguf file).
    """

    model: str  # the --model string as given
    directory: Path  # local directory holding (or caching) the files
    config_path: Path  # config.json, or params.json for Mistral's format
    # tokenizer.json, PLaMo's tokenizer.jsonl, or the tiktoken file its class reads
    tokenizer_path: Path
    weight_files: tuple[Path, ...]  # sorted; exactly one for gguf
    weight_format: str
    model_revision: str | None  # commit SHA on the Hub; --revision verbatim locally; else None
    source: str  # "local" | "hub"
    raw_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tokenizer_config_path(self) -> Path:
        return self.directory / "tokenizer_config.json"

    @property
    def generation_config_path(self) -> Path:
        return self.directory / "generation_config.json"

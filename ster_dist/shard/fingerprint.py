"""A checkpoint's weights fingerprint: what a steering artifact records of the model it was fitted
on, so it is matched to a model by its weights' layout, not by the text of a path.

The fingerprint is a SHA-256 over the config (less the keys that only say how or where it was
written) and every tensor's name, shape and dtype, read from the safetensors headers (never the
data): the same directory under another spelling, a copy, or a safetensors export with the same
tensors share it; a checkpoint of other shapes, names or config does not. A GGUF file has none
(its tensors are named and typed otherwise), and then artifacts are matched by path as before.
"""

from __future__ import annotations

import hashlib
import json

from ster_dist.shard.safetensors_header import read_header

# config keys that record how or where a file was written, not what the model is
_COSMETIC = (
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_commit_hash",
    "use_cache",
    "auto_map",
)
_cache: dict[tuple, str | None] = {}


def weights_fingerprint(checkpoint) -> str | None:
    """ "sha256:HEX" of a resolved Checkpoint's config and tensor layout, or None for a GGUF file."""
    if checkpoint.weight_format == "gguf" or not checkpoint.weight_files:
        return None
    stamp = tuple(
        (str(path), path.stat().st_mtime_ns, path.stat().st_size)
        for path in checkpoint.weight_files
    )
    key = (str(checkpoint.config_path), stamp)
    if key not in _cache:
        tensors = []
        for path in checkpoint.weight_files:
            for name, entry in read_header(path).tensors.items():
                tensors.append([name, list(entry["shape"]), entry["dtype"]])
        config = {k: v for k, v in (checkpoint.raw_config or {}).items() if k not in _COSMETIC}
        document = json.dumps(
            {"config": config, "tensors": sorted(tensors)}, sort_keys=True, default=str
        )
        _cache[key] = "sha256:" + hashlib.sha256(document.encode()).hexdigest()
    return _cache[key]

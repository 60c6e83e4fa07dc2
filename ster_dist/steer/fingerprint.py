"""A weights fingerprint: which checkpoint a steering vector was read from, by content, not path.

Ster matches an artifact to a model by the `--model` text alone, so a vector fitted on one
directory applies to whatever later sits at that path (a fine-tune of the same shape included),
and the same weights copied elsewhere are refused. ster_dist records a fingerprint of the weights
in the artifact's metadata (`weights_fingerprint`, a string as Ster's metadata map requires) and,
where both sides have one, matches by it.

The fingerprint is bounded in time whatever the checkpoint's size: SHA-256 over config.json, each
weight file's size and its first 64 KiB (the safetensors header: names, shapes, dtypes, offsets),
and 64 blocks of 4 KiB spread evenly over the rest. Two fine-tunes of one base differ in every
tensor, so they differ in the sampled blocks; the same files anywhere read the same.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KEY = "weights_fingerprint"
_HEAD = 64 * 1024
_BLOCKS, _BLOCK = 64, 4096


def weights_fingerprint(config_path: Path, weight_files: tuple[Path, ...]) -> str:
    digest = hashlib.sha256()
    digest.update(Path(config_path).read_bytes())
    for path in weight_files:
        size = Path(path).stat().st_size
        digest.update(f"{Path(path).name}:{size}\n".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_HEAD))
            rest = size - _HEAD
            if rest > 0:
                for index in range(_BLOCKS):
                    handle.seek(_HEAD + rest * index // _BLOCKS)
                    digest.update(handle.read(_BLOCK))
    return "sha256:" + digest.hexdigest()


def of_checkpoint(checkpoint) -> str:
    """The fingerprint of a resolved Checkpoint (ster_dist.checkpoint)."""
    return weights_fingerprint(checkpoint.config_path, checkpoint.weight_files)

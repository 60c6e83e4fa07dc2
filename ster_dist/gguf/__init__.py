"""GGUF: llama.cpp's .gguf files read as a TensorSource under Transformers names (source.py, through
the one name table in names.py), and imported into a model directory (importer.py). Loading such a
directory dequantizes its tensors while loading; with `--weights blocks` on the CPU its
Q8_0/Q4_0/Q4_1 tensors stay in their blocks (source.py's read_blocks, shard/ggml_kept.py,
parallel/ggml.py, kernels/blocks.cpp)."""

from ster_dist.gguf.importer import import_gguf
from ster_dist.gguf.source import GGUFSource

__all__ = ["GGUFSource", "import_gguf"]

"""GGUF: llama.cpp's .gguf files read as a TensorSource under Transformers names (source.py,
through the one name table in names.py), and imported into a model directory (importer.py). Loading such a
directory on the CPU keeps its Q8_0/Q4_0/Q4_1 tensors in their blocks (source.py's read_blocks,
shard/ggml_kept.py, parallel/ggml.py); `ster gguf-import --safetensors` writes the dequantized model instead."""

from ster_dist.gguf.importer import import_gguf
from ster_dist.gguf.source import GGUFSource

__all__ = ["GGUFSource", "import_gguf"]

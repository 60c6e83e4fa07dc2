"""GGUF: llama.cpp's .gguf files read as a TensorSource under Transformers names (source.py,
through the one name table in names.py), and imported into a model directory (importer.py)."""

from ster_dist.gguf.importer import import_gguf
from ster_dist.gguf.source import GGUFSource

__all__ = ["GGUFSource", "import_gguf"]

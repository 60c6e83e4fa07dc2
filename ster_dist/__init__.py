"""ster_dist: a distributed engine for Hugging Face decoder checkpoints."""

__version__ = "0.1.0"

"""Tiny Transformers checkpoints, one module per family lineage, named as ster_dist/families/ names
them.

Each module holds TINY (variant -> (Transformers config class, model class, config kwargs over
tests/tiny_models.BASE_CONFIG)), and where it needs them VARIANT_FAMILY (variant -> family, for
variants not named after their family) and UNSTATED_BASE (variant -> keys of BASE_CONFIG its config
class does not take). tests/tiny_models.py gathers them into TINY, the one list every parity, TP and
EP test reads.
"""

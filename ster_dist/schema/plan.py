"""plan: how a model would sit on tp x ep x pp ranks over nodes, from its config and safetensors
headers."""

from __future__ import annotations

from ster_dist.schema.base import field
from ster_dist.schema.common import ModelRef, Precision, Weights


class PlanRequest(ModelRef):
    command = ("plan",)
    summary = "plan a model's ranks, bytes per rank, KV cache and placement from its config and headers alone"

    tp: int = field(1, ge=1, help="tensor-parallel ranks (each group inside one node)")
    ep: int = field(1, ge=1, help="expert-parallel ranks (tp x ep ranks in all)")
    pp: int = field(
        1,
        ge=1,
        help="pipeline stages, each holding a contiguous share of the layers balanced by "
        "parameter bytes (tp x ep x pp ranks in all)",
    )
    nodes: int = field(1, ge=1, help="nodes to place the ranks on")
    gpus_per_node: int = field(8, ge=1, help="GPUs in each node")
    precision: Precision = field("bf16", help="the dtype weights and the KV cache are held in")
    weights: Weights = field(
        "dequantize",
        help="an FP8 checkpoint's weights planned dequantized to --precision, "
        "or kept as fp8 (one byte an element plus their block scales)",
    )
    max_model_len: int | None = field(
        None, ge=1, help="one sequence's longest length (default: the config's)"
    )
    gpu_memory: float = field(80.0, gt=0, allow_inf_nan=False, help="memory of one GPU in GiB")

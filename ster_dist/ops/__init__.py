"""Every operation as a plain function over typed requests: `ops.generate(session,
GenerateRequest)`,
`ops.merge(MergeRequest)`, and so on. The command line, the job queue, jobs/run.py, the Python
API (and the server of a later issue) call these; nothing runs an operation any other way.

OPERATIONS maps each request class to its function and whether it needs a model session (a
worker group the job queue pools by the request's runtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ster_dist.ops.calibrate import calibrate
from ster_dist.ops.capture import extract
from ster_dist.ops.decide import decide
from ster_dist.ops.generate import generate, generate_inputs, parity
from ster_dist.ops.merge import batch_merge, merge
from ster_dist.ops.pairs import add as pairs_add
from ster_dist.ops.pairs import edit as pairs_edit
from ster_dist.ops.pairs import merge as pairs_merge
from ster_dist.ops.pairs import remove as pairs_remove
from ster_dist.ops.plan import plan
from ster_dist.ops.workspace import import_pairs as workspace_import
from ster_dist.ops.workspace import onboarding
from ster_dist.ops.workspace import remove as workspace_remove
from ster_dist.ops.workspace import select as workspace_select
from ster_dist.ops.workspace import show as workspace_show
from ster_dist.ops.steer import compare as vector_compare
from ster_dist.ops.steer import curve as vector_curve
from ster_dist.ops.steer import evaluate as steer_evaluate
from ster_dist.ops.steer import inspect as steer_inspect
from ster_dist.ops.steer import optimize as steer_optimize
from ster_dist.ops.steer import train as steer_train
from ster_dist.ops.tools import families, gguf_import, inspect_model, toy_model
from ster_dist.ops.tune import dpo as tune_dpo
from ster_dist.ops.tune import evaluate as tune_evaluate
from ster_dist.ops.tune import grpo as tune_grpo
from ster_dist.ops.tune import reward as tune_reward
from ster_dist.ops.tune import sft as tune_sft
from ster_dist.ops.tune_inspect import inspect as tune_inspect
from ster_dist.schema import (
    BatchMergeRequest,
    CalibrateRequest,
    DecideRequest,
    ExtractRequest,
    FamiliesRequest,
    GenerateRequest,
    GgufImportRequest,
    InspectModelRequest,
    MergeRequest,
    PairsAddRequest,
    PairsEditRequest,
    PairsMergeRequest,
    PairsRemoveRequest,
    OnboardingRequest,
    ParityRequest,
    PlanRequest,
    Request,
    SteerEvaluateRequest,
    SteerInspectRequest,
    SteerOptimizeRequest,
    SteerTrainRequest,
    ToyModelRequest,
    TuneDpoRequest,
    VectorCompareRequest,
    VectorCurveRequest,
    TuneEvaluateRequest,
    TuneGrpoRequest,
    TuneInspectRequest,
    TuneRewardRequest,
    TuneSftRequest,
    WorkspaceImportRequest,
    WorkspaceRemoveRequest,
    WorkspaceSelectRequest,
    WorkspaceShowRequest,
)


@dataclass(frozen=True)
class Operation:
    run: Callable
    needs_session: bool
    # runs through the session's token engine (shares the ranks with its other requests)
    engine: bool = False


OPERATIONS: dict[type[Request], Operation] = {
    GenerateRequest: Operation(generate, True, engine=True),
    ParityRequest: Operation(parity, True),
    ExtractRequest: Operation(extract, True),
    SteerTrainRequest: Operation(steer_train, True),
    SteerOptimizeRequest: Operation(steer_optimize, True),
    SteerEvaluateRequest: Operation(steer_evaluate, True),
    SteerInspectRequest: Operation(steer_inspect, False),
    VectorCompareRequest: Operation(vector_compare, False),
    VectorCurveRequest: Operation(vector_curve, True),
    DecideRequest: Operation(decide, True, engine=True),
    CalibrateRequest: Operation(calibrate, True, engine=True),
    MergeRequest: Operation(merge, False),
    BatchMergeRequest: Operation(batch_merge, False),
    TuneSftRequest: Operation(tune_sft, False),
    TuneDpoRequest: Operation(tune_dpo, False),
    TuneRewardRequest: Operation(tune_reward, False),
    TuneGrpoRequest: Operation(tune_grpo, False),
    TuneEvaluateRequest: Operation(tune_evaluate, True),
    TuneInspectRequest: Operation(tune_inspect, False),
    FamiliesRequest: Operation(families, False),
    InspectModelRequest: Operation(inspect_model, False),
    PlanRequest: Operation(plan, False),
    ToyModelRequest: Operation(toy_model, False),
    GgufImportRequest: Operation(gguf_import, False),
    PairsAddRequest: Operation(pairs_add, False),
    PairsRemoveRequest: Operation(pairs_remove, False),
    PairsEditRequest: Operation(pairs_edit, False),
    PairsMergeRequest: Operation(pairs_merge, False),
    WorkspaceImportRequest: Operation(workspace_import, False),
    WorkspaceShowRequest: Operation(workspace_show, False),
    WorkspaceSelectRequest: Operation(workspace_select, False),
    WorkspaceRemoveRequest: Operation(workspace_remove, False),
    OnboardingRequest: Operation(onboarding, False),
}


def shown(request: Request, result) -> dict:
    """A result as JSON: what the command line prints and a job's record carries."""
    if isinstance(request, GenerateRequest):
        return result.shown(request)
    return result


def exit_code(request: Request, result: dict) -> int:
    """0, or 1 for a result that reports a failure of what it checked (parity past its threshold, a
    batch merge with a failed merge)."""
    if isinstance(request, ParityRequest) and not result.get("passed", True):
        return 1
    if isinstance(request, BatchMergeRequest) and result.get("failed"):
        return 1
    if (
        isinstance(request, (WorkspaceImportRequest, OnboardingRequest))
        and result.get("import") == "conflicting"
    ):
        return 1
    return 0


__all__ = [
    "OPERATIONS",
    "Operation",
    "shown",
    "exit_code",
    "generate",
    "generate_inputs",
    "parity",
    "extract",
    "decide",
    "calibrate",
    "merge",
    "batch_merge",
    "steer_train",
    "steer_optimize",
    "steer_evaluate",
    "steer_inspect",
    "tune_sft",
    "tune_dpo",
    "tune_reward",
    "tune_grpo",
    "tune_evaluate",
    "families",
    "inspect_model",
    "plan",
    "toy_model",
    "gguf_import",
]

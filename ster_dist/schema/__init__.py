"""One typed request per operation (pydantic): the command line, job specs, the Python API and the
server all take these. REQUESTS lists them in the order `ster --help` shows them; JOB_REQUESTS
maps each job kind to its request."""

from __future__ import annotations

from ster_dist.schema.base import Request
from ster_dist.schema.batch import BatchRequest
from ster_dist.schema.calibrate import CalibrateRequest
from ster_dist.schema.capture import ExtractRequest
from ster_dist.schema.chat import ChatRequest
from ster_dist.schema.decide import DecideRequest
from ster_dist.schema.generate import Completion, GenerateRequest, GenerateResult, ParityRequest
from ster_dist.schema.jobs import QueueRequest, RunJobsRequest, SubmitRequest
from ster_dist.schema.merge import BatchMergeRequest, MergeItem, MergeRequest
from ster_dist.schema.pairs import (
    PairsAddRequest,
    PairsEditRequest,
    PairsMergeRequest,
    PairsRemoveRequest,
)
from ster_dist.schema.plan import PlanRequest
from ster_dist.schema.serve import ServeRequest
from ster_dist.schema.steer import (
    SteerEvaluateRequest,
    SteerInspectRequest,
    SteerOptimizeRequest,
    SteerTrainRequest,
    VectorCompareRequest,
    VectorCurveRequest,
)
from ster_dist.schema.workspace import (
    OnboardingRequest,
    WorkspaceImportRequest,
    WorkspaceRemoveRequest,
    WorkspaceSelectRequest,
    WorkspaceShowRequest,
)
from ster_dist.schema.tools import (
    FamiliesRequest,
    GgufImportRequest,
    InspectModelRequest,
    ToyModelRequest,
)
from ster_dist.schema.tune import (
    TuneDpoRequest,
    TuneEvaluateRequest,
    TuneGrpoRequest,
    TuneInspectRequest,
    TuneRewardRequest,
    TuneSftRequest,
)

REQUESTS: tuple[type[Request], ...] = (
    FamiliesRequest,
    InspectModelRequest,
    PlanRequest,
    GenerateRequest,
    ChatRequest,
    ParityRequest,
    ExtractRequest,
    SteerTrainRequest,
    SteerInspectRequest,
    SteerOptimizeRequest,
    SteerEvaluateRequest,
    VectorCompareRequest,
    VectorCurveRequest,
    DecideRequest,
    CalibrateRequest,
    PairsAddRequest,
    PairsRemoveRequest,
    PairsEditRequest,
    PairsMergeRequest,
    WorkspaceImportRequest,
    WorkspaceShowRequest,
    WorkspaceSelectRequest,
    WorkspaceRemoveRequest,
    OnboardingRequest,
    MergeRequest,
    TuneSftRequest,
    TuneDpoRequest,
    TuneRewardRequest,
    TuneGrpoRequest,
    TuneEvaluateRequest,
    TuneInspectRequest,
    ToyModelRequest,
    GgufImportRequest,
    SubmitRequest,
    QueueRequest,
    ServeRequest,
    BatchRequest,
)
JOB_REQUESTS: dict[str, type[Request]] = {cls.kind: cls for cls in REQUESTS if cls.kind is not None}

__all__ = [
    "REQUESTS",
    "JOB_REQUESTS",
    "Request",
    "GenerateRequest",
    "GenerateResult",
    "Completion",
    "ChatRequest",
    "ParityRequest",
    "ExtractRequest",
    "SteerTrainRequest",
    "SteerOptimizeRequest",
    "SteerEvaluateRequest",
    "SteerInspectRequest",
    "VectorCompareRequest",
    "VectorCurveRequest",
    "DecideRequest",
    "CalibrateRequest",
    "MergeRequest",
    "BatchMergeRequest",
    "MergeItem",
    "TuneSftRequest",
    "TuneDpoRequest",
    "TuneRewardRequest",
    "TuneGrpoRequest",
    "TuneEvaluateRequest",
    "FamiliesRequest",
    "InspectModelRequest",
    "ToyModelRequest",
    "GgufImportRequest",
    "SubmitRequest",
    "QueueRequest",
    "BatchRequest",
    "RunJobsRequest",
    "ServeRequest",
    "PlanRequest",
    "TuneInspectRequest",
    "PairsAddRequest",
    "PairsRemoveRequest",
    "PairsEditRequest",
    "PairsMergeRequest",
    "WorkspaceImportRequest",
    "WorkspaceShowRequest",
    "WorkspaceSelectRequest",
    "WorkspaceRemoveRequest",
    "OnboardingRequest",
]

"""steer train | optimize | evaluate | inspect: steering vectors from contrastive pairs."""

from __future__ import annotations

from pydantic import ValidationInfo, field_validator, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import Request, context_of, field, label_in
from ster_dist.schema.common import (
    ChatTemplate,
    LayersMixin,
    Runtime,
    adapter_field,
    chat_template_field,
    no_stdin,
)

PAIRS_HELP = 'a {"trait_name": ..., "pairs": [{"positive", "negative"}]} file'
LAYERS_HELP = "all, a comma list, or a half-open range such as 8..16"


class PairRun(Runtime):
    """What every pair-reading steering operation takes."""

    pairs: str | None = field(None, help=PAIRS_HELP + "; without it, the workspace's active set")
    chat_template: ChatTemplate = chat_template_field()
    adapter: str | None = adapter_field("a LoRA adapter applied unmerged while reading")

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo):
        no_stdin(self, ("pairs", "vector"), info)
        if self.pairs is None and context_of(info, "queued"):
            raise Refusal(
                f"a {self.kind} job spec is missing the required field 'pairs': a queued job "
                "has no workspace whose active set it could read"
            )
        return self


class FitRun(LayersMixin, PairRun):
    """What the operations that fit and write an artifact take."""

    layers: str = field("all", help=LAYERS_HELP)
    output: str = field(help="the steering artifact (V.json) to write")
    batch_size: int = field(8, ge=1, help="prompts per forward pass")


class SteerTrainRequest(FitRun):
    kind = "steer-train"
    command = ("steer", "train")
    ster_name = "train"
    ster_command = ("vector", "train")
    summary = "fit a direction per layer from contrastive pairs"

    method: str = field("caa", help="caa (mean difference), pca, or logistic (a probe)")


class SteerOptimizeRequest(FitRun):
    kind = "steer-optimize"
    command = ("steer", "optimize")
    ster_name = "optimize"
    ster_command = ("vector", "optimize")
    summary = "rank every layer x method on a holdout and write the winner"

    # its range is checked with Ster's words where the pairs are split (steer/optimize.py)
    holdout: float | None = field(None, help="the fraction of pairs held out to rank on (required)")

    @model_validator(mode="after")
    def _holdout_given(self, info: ValidationInfo):
        if self.holdout is None:
            raise Refusal(
                f"optimize needs {label_in(info, 'holdout')} FRACTION (the share of pairs to rank on); "
                "Ster assumes none"
            )
        return self


class SteerEvaluateRequest(PairRun):
    kind = "steer-evaluate"
    command = ("steer", "evaluate")
    ster_name = "evaluate"
    ster_command = ("vector", "evaluate")
    summary = "score an artifact on pairs, and strengths with --strengths"

    vector: str = field(help="the steering artifact (V.json)")
    strengths: list[float] | None = field(None, help="comma-separated, e.g. --strengths=-1,0.5,1")
    batch_size: int | None = field(
        None,
        ge=1,
        help="pairs per forward pass while measuring strengths (required with --strengths)",
    )
    max_sequence: int | None = field(
        None, ge=1, help="the longest pair side measured, in tokens (required with --strengths)"
    )

    @field_validator("strengths", mode="before")
    @classmethod
    def _strength_list(cls, value, info: ValidationInfo):
        """--strengths "-1,0.5,1" from a command line, a list (or one number) from a spec."""
        where = label_in(info, "strengths")
        if isinstance(value, str):
            try:
                return [float(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise Refusal(f"{where} takes comma-separated numbers, got {value!r}") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return [float(value)]
        if isinstance(value, list):
            if not value or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            ):
                raise Refusal(f"{where} must be a non-empty list of numbers, got {value!r}")
            return [float(v) for v in value]
        return value

    @model_validator(mode="after")
    def _measuring(self, info: ValidationInfo):
        if self.strengths is None and (
            self.batch_size is not None or self.max_sequence is not None
        ):
            raise Refusal(
                f"{label_in(info, 'batch_size')} and {label_in(info, 'max_sequence')} measure strengths "
                f"and exist only with {label_in(info, 'strengths')}"
            )
        return self


class SteerInspectRequest(Request):
    kind = None  # reads one small file: no job
    command = ("steer", "inspect")
    ster_name = "inspect"
    ster_command = ("vector", "inspect")
    summary = "validate an artifact and summarise it without the floats"

    artifact: str = field(help="the steering artifact (V.json)", cli={"positional": True})


class VectorCompareRequest(Request):
    command = ("vector", "compare")
    summary = "compare artifacts fitted for different traits on one model (no model loaded)"

    artifacts: list[str] = field(
        help="two or more steering artifacts", cli={"positional": True, "nargs": "+"}
    )
    clusters: int = field(
        ge=1, help="the number of groups to cut the artifacts into (Ster chooses none)"
    )
    layers: str | None = field(
        None, help="a comma list of layers every artifact carries (default: all shared)"
    )


class VectorCurveRequest(LayersMixin, PairRun):
    kind = "vector-curve"
    command = ("vector", "curve")
    summary = "score one method on growing numbers of pairs, on one held-out fraction"

    layers: str = field("all", help=LAYERS_HELP)
    method: str = field(help="caa, pca or logistic (Ster states none)")
    holdout: float = field(help="the fraction of pairs held out, as vector optimize holds it out")
    sizes: str = field(help="comma-separated pair counts to fit on, e.g. 1,2,4")
    batch_size: int = field(8, ge=1, help="prompts per forward pass")

    def size_list(self) -> list[int]:
        try:
            return [int(part) for part in self.sizes.split(",") if part.strip()]
        except ValueError:
            raise Refusal(
                f"{self.label('sizes')} takes comma-separated whole numbers, got {self.sizes!r}"
            ) from None

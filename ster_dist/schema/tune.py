"""tune sft | dpo | reward | grpo | evaluate: LoRA adapters (and reward models) trained across
ranks, and completion-token evaluation.

The training numbers keep their range checks in ster_dist/tune/spec.py (Ster's wording); the
schema states their types, defaults and help."""

from __future__ import annotations

from typing import Literal

from pydantic import ValidationInfo, model_validator

from ster_dist.errors import Refusal
from ster_dist.schema.base import Request, field, label_in
from ster_dist.schema.common import ChatTemplate, ModelRef, Runtime, chat_template_field, no_stdin

EXAMPLES_HELP = 'a {"examples": [{"prompt", "completion"}, ...]} JSON file'
PAIRS_HELP = 'a JSONL file of {"prompt", "chosen", "rejected"} objects, one per line'
PROMPTS_HELP = 'a JSONL file of {"prompt"} objects (optional "system"), one per line'
SYSTEM_HELP = "a file holding the system message of every example"
# numbers without defaults: a missing one is named, with an example (Ster's refusal)
REQUIRED = (("learning_rate", "1e-4"), ("epochs", "3"), ("seed", "0"))


class _TrainRequest(ModelRef):
    """What every training command takes besides its data: the factors, the ranks, the optimizer."""

    submitter_fields = {
        "address": "give the cluster to `ster submit --address` or Engine(address=...), "
        "not to a job"
    }

    output: str = field(help="the PEFT adapter directory to write (must not exist)")
    learning_rate: float | None = field(
        None, allow_inf_nan=False, help="required: AdamW's learning rate"
    )
    epochs: int | None = field(None, help="required: passes over the examples")
    seed: int | None = field(None, help="required: seeds the factors' start and the order")
    rank: int = field(8, help="LoRA rank r")
    alpha: float = field(
        16.0, allow_inf_nan=False, help="LoRA alpha; the update is scaled by alpha / r"
    )
    targets: str = field("q,k,v,o", help="projections to adapt: q,k,v,o,gate,up,down")
    adapter_layers: str = field("all", help="all, a comma list, or START..END (end excluded)")
    batch_size: int = field(1, help="examples per micro-batch on each data-parallel rank")
    accumulation: int = field(1, help="micro-batches per optimizer step")
    max_sequence: int | None = field(
        None, help="tokens per example, prompt and completion (default: the model's positions)"
    )
    dp: int = field(1, help="data-parallel ranks (world = dp x tp)")
    tp: int = field(1, help="tensor-parallel ranks")
    zero: int = field(2, help="DeepSpeed ZeRO stage: 1 or 2")
    precision: str = field("f32", help="f32 or bf16 (f32 master factors either way)")
    max_grad_norm: float = field(1.0, allow_inf_nan=False, help="gradient clipping (0: none)")
    weight_decay: float = field(0.0, allow_inf_nan=False, help="AdamW's weight decay")
    device: str = field("cpu", help="cpu or cuda")
    address: str | None = field(
        None, help="an existing Ray cluster (else RAY_ADDRESS, else a local one)"
    )
    launcher: Literal["ray", "spawn"] = field(
        "ray", help="ranks as Ray actors, or as local processes (one machine, no Ray)"
    )
    chat_template: ChatTemplate = chat_template_field()
    system: str | None = field(None, help=SYSTEM_HELP)

    @model_validator(mode="after")
    def _numbers_given(self, info: ValidationInfo):
        missing = [name for name, _ in REQUIRED if getattr(self, name) is None]
        if missing:
            flags = [label_in(info, name) for name in missing]
            example = " ".join(
                f"{label_in(info, name)} {value}" for name, value in REQUIRED if name in missing
            )
            one = len(missing) == 1
            raise Refusal(
                f"{', '.join(flags)} {'is' if one else 'are'} required and has no default; "
                f"pass {'it' if one else 'them'}, e.g. {example}"
            )
        no_stdin(self, ("examples", "pairs", "system"), info)
        return self


class TuneSftRequest(_TrainRequest):
    kind = "tune-sft"
    command = ("tune", "sft")
    summary = "supervised fine-tuning of LoRA factors (the base frozen)"

    examples: str = field(help=EXAMPLES_HELP)


class TuneDpoRequest(_TrainRequest):
    kind = "tune-dpo"
    command = ("tune", "dpo")
    summary = (
        "preference tuning of LoRA factors, DPO or IPO, against the base as the frozen reference"
    )

    pairs: str = field(help=PAIRS_HELP)
    loss: Literal["dpo", "ipo"] = field(
        "dpo", help="dpo (summed log-probabilities) or ipo (mean per token)"
    )
    beta: float = field(
        0.1,
        allow_inf_nan=False,
        help="how far from the reference the factors may move (DPO's beta; IPO's regulariser)",
    )


class TuneRewardRequest(_TrainRequest):
    kind = "tune-reward"
    command = ("tune", "reward")
    summary = (
        "a Bradley-Terry reward model: LoRA factors and a scalar head, written as a reward adapter"
    )

    pairs: str = field(help=PAIRS_HELP)


class TuneGrpoRequest(_TrainRequest):
    kind = "tune-grpo"
    command = ("tune", "grpo")
    summary = (
        "GRPO of LoRA factors: groups of completions sampled from the policy, group-relative "
        "advantages, a k3 KL to the base"
    )

    prompts: str = field(help=PROMPTS_HELP)
    reward: str = field(
        "length",
        help="length (completion tokens before the stop token) or a reward model "
        "directory written by `ster tune reward`",
    )
    group_size: int = field(
        4, help="completions sampled per prompt (at least 2: advantages are within a group)"
    )
    max_new_tokens: int = field(16, help="tokens sampled per completion at most")
    temperature: float = field(1.0, allow_inf_nan=False, help="sampling temperature (positive)")
    beta: float = field(0.04, allow_inf_nan=False, help="weight of the k3 KL to the base (0: none)")
    rollout: Literal["rank", "engine"] = field(
        "rank",
        help="where the groups are sampled: on the training ranks "
        "(whole re-reads) or by the token engine on its own "
        "ranks, the factors pushed to it after every step",
    )
    rollout_tp: int = field(
        1,
        help="tensor-parallel ranks of the rollout engine (--rollout engine), and of the "
        "user model's engine when --user-model is another checkpoint",
    )
    turns: int = field(
        1, help="policy turns per conversation; above 1 a user model answers between them"
    )
    user_model: str | None = field(
        None,
        help="the chat model playing the user in --turns > 1 conversations "
        "(another checkpoint, or the policy's --model: its base, no factors)",
    )

    @model_validator(mode="after")
    def _rollout(self, info: ValidationInfo):
        turns, user = label_in(info, "turns"), label_in(info, "user_model")
        if self.turns < 1:
            raise Refusal(
                f"{turns} must be at least 1 (the policy's turns per conversation), got {self.turns}"
            )
        if self.turns > 1 and self.user_model is None:
            raise Refusal(
                f"{turns} {self.turns} needs {user}: the model answering as the user between the policy's "
                f"turns (another chat model, or the policy's own --model)"
            )
        if self.turns == 1 and self.user_model is not None:
            raise Refusal(
                f"{user} answers between the policy's turns, and {turns} 1 has none; pass {turns} 2 or "
                f"more, or drop {user}"
            )
        if self.rollout_tp < 1:
            raise Refusal(
                f"{label_in(info, 'rollout_tp')} must be at least 1, got {self.rollout_tp}"
            )
        if self.rollout_tp != 1 and self.rollout != "engine":
            raise Refusal(
                f"{label_in(info, 'rollout_tp')} {self.rollout_tp} sizes the rollout engine; pass "
                f"{label_in(info, 'rollout')} engine with it, or drop it"
            )
        if self.group_size < 2:
            raise Refusal(
                f"{label_in(info, 'group_size')} must be at least 2 (an advantage is a completion's "
                f"reward against its group's), got {self.group_size}"
            )
        if self.max_new_tokens < 1:
            raise Refusal(
                f"{label_in(info, 'max_new_tokens')} must be at least 1, got {self.max_new_tokens}"
            )
        if self.temperature <= 0:
            raise Refusal(
                f"{label_in(info, 'temperature')} must be positive (greedy groups are all the same "
                f"completion, with no advantage), got {self.temperature}"
            )
        if self.beta < 0:
            raise Refusal(
                f"{label_in(info, 'beta')} must be zero (no KL) or positive, got {self.beta}"
            )
        no_stdin(self, ("prompts", "reward"), info)
        return self


class TuneEvaluateRequest(Runtime):
    kind = "tune-evaluate"
    command = ("tune", "evaluate")
    summary = "loss and perplexity over completion tokens; nothing written"

    examples: str = field(help=EXAMPLES_HELP)
    adapter: str | None = field(None, help="a LoRA adapter applied unmerged")
    batch_size: int = field(8, help="examples per forward pass")
    max_sequence: int | None = field(
        None, help="tokens per example (default: the model's positions)"
    )
    chat_template: ChatTemplate = chat_template_field()
    system: str | None = field(None, help=SYSTEM_HELP)

    @model_validator(mode="after")
    def _files(self, info: ValidationInfo):
        if self.batch_size < 1:
            raise Refusal(
                f"--batch-size must be a whole number of at least 1, got {self.batch_size}"
            )
        no_stdin(self, ("examples", "system"), info)
        return self


class TuneInspectRequest(Request):
    command = ("tune", "inspect")
    summary = "validate an adapter and summarise what it declares, its factors' names and shapes"

    adapter: str = field(
        help="the adapter (a directory, its weights, or its config)", cli={"positional": True}
    )

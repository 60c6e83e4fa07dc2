"""GRPO (Shao et al., DeepSeekMath): group-relative policy optimisation of LoRA factors on the
shared loop.

Each step's items are prompts. On the rank, before the step's forward, every prompt gets a group of
G completions sampled from the current policy (base plus the factors as they stand;
tune/rollout.py), or, with --turns > 1, G conversations with a user model whose turns carry no loss
(tune/conversation.py); either sampled here or brought with the step when the token engine sampled
them (tune/engine_rollouts.py); then their rewards. Each completion's advantage is its reward
against its group's: A = (r - mean_group) / (std_group + 1e-4), std the unbiased one, as TRL's
GRPOTrainer takes it.

The loss of a completion is the mean over its tokens of -(ratio - 1) * A + beta * k3, and a step's
loss the mean over its completions (the paper's 1/G sum_i 1/|o_i| sum_t). ratio = exp(logp -
logp.detach()) is one on-policy (one update per sampled batch) and carries the policy gradient; the
-1 changes no gradient and removes only -mean(A) from the value, which the group-mean-zero advantage
makes zero, so the value is not left with its rounding. k3 = exp(ref - logp) - (ref - logp) - 1
(Schulman's estimator of KL(policy || ref)), ref the same decoder with the factors skipped
(Attached.skipped), as DPO's reference. At the first step B is zero, so logp == ref bit for bit:
every k3 is zero and the loss is exactly zero, Ster's identity check.

The report holds the step's loss, mean reward, mean KL (k3 per token, averaged per completion) and
mean completion length in tokens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ster_dist.tune.conversation import Rollout, Side, converse
from ster_dist.tune.data import IGNORE, Example, collate
from ster_dist.tune.objective import Objective
from ster_dist.tune.rollout import (
    Prompt,
    RewardArtifact,
    length_rewards,
    model_rewards,
    sample_group,
    sample_rows,
)

METRICS = ("reward", "kl", "completion_length")
EPS = 1e-4


@dataclass
class Grpo(Objective):
    group_size: int
    max_new_tokens: int
    temperature: float
    beta: float
    seed: int
    stops: frozenset[int]
    reward: RewardArtifact | None = None  # None: the length reward
    # policy turns per conversation; above 1 a user model answers between
    turns: int = 1
    user: UserModel | None = None
    max_sequence: int = 0  # a conversation's tokens at most
    precision: str = "f32"
    device: str = "cpu"
    # the policy's tokenizer, read on the rank for conversations
    tokenizer_dir: str = ""
    # (policy tokenizer, user decoder or None, user tokenizer), read on the rank once
    # (Grpo._speakers)
    _speakers_read: tuple | None = field(default=None, repr=False, compare=False)

    name = "grpo"
    width = 5  # (summed loss, completions, summed reward, summed kl, completion tokens)

    def units(self, items: list[Prompt]) -> int:
        return len(items) * self.group_size

    def inputs(
        self, decoder, attached, items: list[Prompt], pad_id: int, step: int
    ) -> tuple[torch.Tensor, ...]:
        """Sample each prompt's group from the policy as it stands, score it, and collate it with
        its advantages."""
        with torch.no_grad():
            attached.refresh()
        if self.turns > 1:
            return self._conversations(decoder, attached, items, pad_id, step)
        examples, advantages, rewards = [], [], []
        for prompt in items:
            # drawn by the token engine, when it samples (--rollout engine)
            completions = prompt.completions
            if completions is None:
                completions = sample_group(
                    decoder,
                    attached.ctx,
                    prompt,
                    self.group_size,
                    self.max_new_tokens,
                    self.temperature,
                    self.stops,
                    self.seed,
                    step,
                )
            completions = [list(c) for c in completions]
            if self.reward is None:
                r = length_rewards(completions, self.stops)
            else:
                r = model_rewards(
                    decoder,
                    attached.ctx,
                    self.reward,
                    attached,
                    [list(prompt.ids) + c for c in completions],
                    pad_id,
                )
            examples += [Example(prompt.ids + tuple(c), len(prompt.ids)) for c in completions]
            advantages.append(group_advantages(torch.tensor(r, dtype=torch.float64)))
            rewards += r
        return (
            *collate(examples, pad_id),
            torch.cat(advantages),
            torch.tensor(rewards, dtype=torch.float64),
        )

    def _conversations(self, decoder, attached, items: list[Prompt], pad_id: int, step: int):
        """Each prompt's group of conversations (tune/conversation.py), collated with the user's
        turns masked."""
        rollouts, advantages, rewards = [], [], []
        for group in self.conversations(decoder, attached, items, step):
            # the policy's tokens, less the stop tokens that ended its turns
            if self.reward is None:
                r = [float(c.policy_tokens - c.policy_stops) for c in group]
            else:
                r = model_rewards(
                    decoder,
                    attached.ctx,
                    self.reward,
                    attached,
                    [list(c.ids) for c in group],
                    pad_id,
                )
            rollouts += group
            advantages.append(group_advantages(torch.tensor(r, dtype=torch.float64)))
            rewards += r
        inputs, valid, targets = collate(
            [Example(c.ids, c.prompt_tokens) for c in rollouts], pad_id
        )
        for row, c in enumerate(rollouts):
            # position t predicts ids[t + 1]: the user's tokens are targets t-1
            for start, stop in c.user_spans:
                targets[row, start - 1 : stop - 1] = IGNORE
        return (
            inputs,
            valid,
            targets,
            torch.cat(advantages),
            torch.tensor(rewards, dtype=torch.float64),
        )

    def conversations(
        self, decoder, attached, items: list[Prompt], step: int
    ) -> list[list[Rollout]]:
        """Each prompt's group of conversations: as the token engine drew them before the step
        (--rollout engine), or sampled here, the policy under the factors as they stand and the user
        model beside it."""
        if all(p.conversations is not None for p in items):
            return [list(p.conversations) for p in items]
        ctx = attached.ctx
        policy_tokenizer, user_decoder, user_tokenizer = self._speakers(ctx)
        policy = Side(
            lambda rows, seeds, limits: sample_rows(
                decoder, ctx, rows, seeds, limits, self.temperature, self.stops
            ),
            policy_tokenizer,
            self.stops,
            self.max_sequence,
        )

        def user_draw(rows, seeds, limits):
            # no user decoder: the policy's own base speaks as the user, its factors skipped
            with attached.skipped() if user_decoder is None else contextlib.nullcontext():
                return sample_rows(
                    user_decoder or decoder,
                    ctx,
                    rows,
                    seeds,
                    limits,
                    self.temperature,
                    self.user.stops,
                )

        user = Side(user_draw, user_tokenizer, self.user.stops, self.user.max_position)
        return converse(
            policy, user, items, self.group_size, self.turns, self.max_new_tokens, self.seed, step
        )

    def _speakers(self, ctx) -> tuple:
        """The policy's tokenizer, the user model's decoder on this rank (None: the policy's base,
        its factors skipped) and the user's tokenizer, read on the rank's first conversation step
        and kept."""
        if self._speakers_read is None:
            from ster_dist.load import load_model
            from ster_dist.tokenizer import Tokenizer

            user, policy_tokenizer = self.user, Tokenizer.from_directory(self.tokenizer_dir)
            if user.checkpoint is None:
                self._speakers_read = (policy_tokenizer, None, policy_tokenizer)
            else:
                loaded = load_model(user.checkpoint, self.precision, self.device, ctx)
                self._speakers_read = (
                    policy_tokenizer,
                    loaded.model,
                    Tokenizer.from_directory(user.checkpoint.directory),
                )
        return self._speakers_read

    def loss(self, decoder, attached, head, batch):
        inputs, valid, targets, advantages, rewards = batch
        with torch.no_grad(), attached.skipped():
            reference = token_logps(decoder, inputs, valid, targets)
        logp = token_logps(decoder, inputs, valid, targets)
        counted = targets != IGNORE
        ratio = torch.exp(logp - logp.detach())
        gap = reference - logp
        k3 = torch.exp(gap) - gap - 1
        per_token = -(ratio - 1) * advantages.to(logp.dtype)[:, None] + self.beta * k3
        tokens = counted.sum(-1)
        losses = (per_token * counted).sum(-1) / tokens
        kl = ((k3.detach() * counted).sum(-1) / tokens).double()
        sums = torch.stack(
            [
                losses.detach().double().sum(),
                torch.tensor(float(len(losses)), dtype=torch.float64),
                rewards.double().sum(),
                kl.sum(),
                tokens.double().sum(),
            ]
        )
        return losses.sum(), sums

    def report(self, sums: torch.Tensor) -> dict:
        n = float(sums[1])
        return {
            "loss": float(sums[0]) / n,
            "completions": int(n),
            "units": int(n),
            "reward": float(sums[2]) / n,
            "kl": float(sums[3]) / n,
            "completion_length": float(sums[4]) / n,
            "tokens": int(sums[4]),
        }


@dataclass(frozen=True)
class UserModel:
    """The model playing the user in conversations, as the driver resolved it (no weight read)."""

    checkpoint: object | None  # None: the policy's base, its factors skipped
    stops: frozenset[int]
    max_position: int


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    return (rewards - rewards.mean()) / (rewards.std() + EPS)


def token_logps(
    decoder, inputs: torch.Tensor, valid: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """log p(target) at every position [batch, width] in f32, zero where no target is counted."""
    logits = decoder(inputs, None, valid)
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return -nll.view(targets.shape)

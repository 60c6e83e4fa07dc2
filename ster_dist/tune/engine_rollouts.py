"""GRPO's groups sampled by the token engine on a worker group of its own (`tune grpo --rollout
engine`).

The split OpenRLHF and veRL make: the DeepSpeed ranks train, a second group of ranks holds the base
once more and samples with continuous batching (engine/loop.py), both groups on one Ray cluster
(or in this process, for one rank each). Before each step the driver takes the trained factors as
they stand (the f32 masters, gathered from the training ranks) and pushes them to the engine as the
per-request adapter "policy": registered on the first step, its tensors replaced in place after
that (engine.replace_adapter; the base is never reloaded, and the prefix cache keys each version
apart). Then every completion of the step's prompts is submitted at once, each seeded as the
in-process sampler seeds it (tune/rollout.completion_seed), so where both compute the same logits
they draw the same tokens; the first step's factors leave the base unchanged (B is zero), so its
loss and KL are exactly zero either way.

Conversations (--turns > 1) are held here on the driver by tune/conversation.converse, the same code
the training ranks run, turn by turn: the policy's turns are requests under the adapter; the user's
are requests without it on the same engine when the user model is the policy's base (its factors
skipped, as on the ranks), or on a second engine over a group of its own holding the user model's
checkpoint. Every turn draws from its turn's seed, so the conversations are the ranks' token for
token where the logits agree; the prefix cache serves each turn the conversation read so far.

The groups go to the training ranks with the step (Prompt.completions, Prompt.conversations);
rewards, advantages and the loss are computed there as for in-process rollouts.
"""

from __future__ import annotations

from dataclasses import replace

from ster_dist.tune.conversation import Draw, Side, converse
from ster_dist.tune.lora import global_factors
from ster_dist.tune.rollout import Prompt, completion_seed, sampling_params

ADAPTER = "policy"


def needs_user_group(plan) -> bool:
    """Whether the plan's conversations need a second group: a user model that is not the policy's
    base."""
    return plan.objective.turns > 1 and plan.objective.user.checkpoint is not None


class EngineRollouts:
    """A token engine over `group` (already opened: tp ranks, in this process or on the Ray cluster)
    sampling the groups of a GRPO plan, and for conversations with another checkpoint as the user
    model a second one over `user_group` (needs_user_group); close() stops the engines, the caller
    closes the groups."""

    def __init__(self, group, plan, kv_cache_memory: int | None = None, user_group=None):
        from ster_dist.tokenizer import Tokenizer

        s, objective = plan.settings, plan.objective
        self.plan, self.objective = plan, objective
        # every completion (or conversation) of a step runs at once
        running = max(1, s.step_examples) * objective.group_size
        self.tokenizer = Tokenizer.from_directory(plan.checkpoint.directory)
        self.engine = _engine(
            group, plan.checkpoint, self.tokenizer, s, objective.stops, running, kv_cache_memory
        )
        self.user_engine, self.user_tokenizer = None, self.tokenizer
        if needs_user_group(plan):
            if user_group is None:
                raise ValueError(
                    "conversations with another user model need a second group for its engine"
                )
            user = objective.user
            self.user_tokenizer = Tokenizer.from_directory(user.checkpoint.directory)
            try:
                self.user_engine = _engine(
                    user_group,
                    user.checkpoint,
                    self.user_tokenizer,
                    s,
                    user.stops,
                    running,
                    kv_cache_memory,
                )
            except BaseException:
                self.engine.close()
                raise
        self.registered = False

    def refresh(self, factors: dict) -> None:
        """The policy's factors as they stand ("a.i", "b.j": f32 global values) pushed to the
        engine."""
        scale = self.plan.settings.scale
        sites = [
            {"param": site.param, "a": a, "b": b, "scale": scale}
            for site, (a, b) in zip(self.plan.sites, global_factors(factors, self.plan.sites))
        ]
        if self.registered:
            self.engine.replace_adapter(ADAPTER, sites)
        else:
            self.engine.add_adapter(ADAPTER, sites)
            self.registered = True

    def draw(self, prompts: list[Prompt], step: int) -> list[Prompt]:
        """Each prompt with its group of completions (or conversations) sampled under the factors
        last pushed."""
        o = self.objective
        policy = _draw(self.engine, ADAPTER, o.stops, o.temperature)
        if o.turns > 1:
            # the base: no adapter
            user = _draw(self.user_engine or self.engine, None, o.user.stops, o.temperature)
            groups = converse(
                Side(policy, self.tokenizer, o.stops, o.max_sequence),
                Side(user, self.user_tokenizer, o.user.stops, o.user.max_position),
                prompts,
                o.group_size,
                o.turns,
                o.max_new_tokens,
                o.seed,
                step,
            )
            return [replace(p, conversations=tuple(g)) for p, g in zip(prompts, groups)]
        drawn = policy(
            [list(p.ids) for p in prompts for _ in range(o.group_size)],
            [
                completion_seed(o.seed, step, p.index, j)
                for p in prompts
                for j in range(o.group_size)
            ],
            [o.max_new_tokens] * (len(prompts) * o.group_size),
        )
        return [
            replace(
                p,
                completions=tuple(
                    tuple(c) for c in drawn[i * o.group_size : (i + 1) * o.group_size]
                ),
            )
            for i, p in enumerate(prompts)
        ]

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.user_engine is not None:
                self.user_engine.close()


def _engine(
    group,
    checkpoint,
    tokenizer,
    settings,
    stops: frozenset[int],
    running: int,
    kv_cache_memory: int | None,
):
    """A token engine over `group` holding `checkpoint`, its requests ended by `stops` as in-process
    rollouts end."""
    from ster_dist.config.load import model_config
    from ster_dist.engine.loop import EngineConfig, TokenEngine
    from ster_dist.workers.group import load_on

    load_on(group, checkpoint, settings.precision, settings.device)
    # weights a tuning step changes are never packed: each step would leave the copies stale
    config = EngineConfig(kv_cache_memory=kv_cache_memory, max_running=running, pack_weights="off")
    return TokenEngine(group, model_config(checkpoint), tokenizer, tuple(sorted(stops)), config)


def _draw(engine, adapter: str | None, stops: frozenset[int], temperature: float) -> Draw:
    """Rows' continuations drawn by `engine`, all submitted at once (under `adapter`, or the base
    for None)."""

    def draw(rows: list[list[int]], seeds: list[int], limits: list[int]) -> list[list[int]]:
        streams = [
            engine.submit(
                list(row), sampling_params(seed, limit, temperature, stops), adapter=adapter
            )
            for row, seed, limit in zip(rows, seeds, limits)
        ]
        return [list(s.result().token_ids) for s in streams]

    return draw

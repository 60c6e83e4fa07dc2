"""GRPO's groups sampled by the token engine on a worker group of its own (`tune grpo --rollout engine`).

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

The groups go to the training ranks with the step (Prompt.completions); rewards, advantages and the
loss are computed there as for in-process rollouts.
"""

from __future__ import annotations

from dataclasses import replace

from ster_dist.tune.lora import global_factors
from ster_dist.tune.rollout import Prompt, completion_seed, sampling_params

ADAPTER = "policy"


class EngineRollouts:
    """A token engine over `group` (already opened: tp ranks, in this process or on the Ray cluster) sampling
    the groups of a GRPO plan; close() stops the engine, the caller closes the group."""

    def __init__(self, group, plan, kv_cache_memory: int | None = None):
        from ster_dist.config_load import model_config
        from ster_dist.engine.loop import EngineConfig, TokenEngine
        from ster_dist.tokenizer import Tokenizer
        from ster_dist.workers.group import load_on

        s, objective = plan.settings, plan.objective
        self.plan, self.objective = plan, objective
        load_on(group, plan.checkpoint, s.precision, s.device)
        cfg = model_config(plan.checkpoint)
        tokenizer = Tokenizer.from_directory(plan.checkpoint.directory)
        # every completion of a step runs at once; the stops end a completion as in-process rollouts end it
        config = EngineConfig(kv_cache_memory=kv_cache_memory, max_running=max(1, s.step_examples)
                              * objective.group_size)
        self.engine = TokenEngine(group, cfg, tokenizer, tuple(sorted(objective.stops)), config)
        self.registered = False

    def refresh(self, factors: dict) -> None:
        """The policy's factors as they stand ("a.i", "b.j": f32 global values) pushed to the engine."""
        scale = self.plan.settings.scale
        sites = [{"param": site.param, "a": a, "b": b, "scale": scale}
                 for site, (a, b) in zip(self.plan.sites, global_factors(factors, self.plan.sites))]
        if self.registered:
            self.engine.replace_adapter(ADAPTER, sites)
        else:
            self.engine.add_adapter(ADAPTER, sites)
            self.registered = True

    def draw(self, prompts: list[Prompt], step: int) -> list[Prompt]:
        """Each prompt with its group of completions sampled under the factors last pushed."""
        o = self.objective
        streams = [[self.engine.submit(list(p.ids), sampling_params(completion_seed(o.seed, step, p.index, j),
                                                                   o.max_new_tokens, o.temperature, o.stops),
                                       adapter=ADAPTER)
                    for j in range(o.group_size)] for p in prompts]
        return [replace(p, completions=tuple(tuple(s.result().token_ids) for s in group))
                for p, group in zip(prompts, streams)]

    def close(self) -> None:
        self.engine.close()

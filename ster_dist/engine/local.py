"""Prompts through a token engine in one call, for tests and benchmarks: the engine is the only way
to generate, so a check that wants a batch's token ids runs one over a group (a LocalGroup holding a
model this process loaded, or any loaded group) and reads each request's ids."""

from __future__ import annotations

from ster_dist.config.load import model_config
from ster_dist.engine.loop import EngineConfig, TokenEngine
from ster_dist.engine.sampling import SamplingParams
from ster_dist.load import LoadedModel
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup


def engine_token_ids(
    source,
    prompts: list[list[int]],
    params: SamplingParams,
    eos: tuple[int, ...] = (),
    config: EngineConfig = EngineConfig(),
    checkpoint=None,
) -> list[list[int]]:
    """Each prompt's new token ids (the EOS that ends one included), every prompt in flight at once.
    `source`: a LoadedModel of this process (run on a LocalGroup holding it, closed after), or a
    group whose ranks have loaded `checkpoint`."""
    if isinstance(source, LoadedModel):
        group, checkpoint = LocalGroup.holding(source), source.checkpoint
    else:
        group = source
    try:
        with TokenEngine(
            group,
            model_config(checkpoint),
            Tokenizer.from_directory(checkpoint.directory),
            tuple(eos),
            config,
        ) as engine:
            streams = [engine.submit(p, params) for p in prompts]
            return [s.result().token_ids for s in streams]
    finally:
        if group is not source:
            group.close()

"""The token engine as the tests drive it: one engine over a local group (or a loaded group), the
greedy tokens each prompt gets from it, the independent reference it must equal (a whole re-read per
token, no cache), and the engine against `ster generate`."""

from __future__ import annotations

import torch

from ster_dist.config.load import model_config
from ster_dist.engine.local import engine_token_ids
from ster_dist.engine.loop import EngineConfig, TokenEngine
from ster_dist.engine.sampling import SamplingParams
from ster_dist.resolve import resolve
from ster_dist.tokenizer import Tokenizer
from ster_dist.workers.group import LocalGroup


def group_cfg(checkpoint):
    return model_config(checkpoint)


def open_engine(directory, group=None, dtype: str = "f32", **config) -> TokenEngine:
    """An engine over `group` (a fresh local one by default) after it loads `directory`."""
    checkpoint = resolve(str(directory))
    if group is None:
        group = LocalGroup()
    group.call("load", checkpoint, dtype, "cpu")
    cfg = group_cfg(checkpoint)
    return TokenEngine(
        group,
        cfg,
        Tokenizer.from_directory(checkpoint.directory),
        cfg.eos_token_ids or (2,),
        EngineConfig(**{"kv_cache_memory": 4 << 20, "block_size": 4, **config}),
    )


def engine_tokens(
    source, prompts: list[list[int]], max_new_tokens: int, eos=(), checkpoint=None, **config
) -> list[list[int]]:
    """Each prompt's greedy tokens (the EOS that ends one included) from a TokenEngine over the
    paged cache, every prompt in flight at once (engine/local.py). `source`: a one-rank LoadedModel
    a test built (its weights left unpacked, as the test reads it after), or a group whose ranks
    have loaded `checkpoint`."""
    config = EngineConfig(
        **{"kv_cache_memory": 16 << 20, "block_size": 4, "pack_weights": "off", **config}
    )
    return engine_token_ids(
        source, prompts, SamplingParams(max_tokens=max_new_tokens), tuple(eos), config, checkpoint
    )


def alone(model, prompt: list[int], n: int, eos=()) -> list[int]:
    """The greedy tokens of `prompt` read whole at every step (no cache): what the engine must give
    it."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.inference_mode():
            token = int(model(torch.tensor([ids]), last_only=True)[0, -1].argmax())
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


def check_engine_answers_as_generate(
    directory, prompts: list[str], new_tokens: int, max_step_tokens: int
) -> None:
    """The engine under a small step budget (prompts read in chunks, batched) answers each prompt as
    `ster generate` answers it alone."""
    from tests.cli_run import cli_generate

    want = [
        cli_generate(
            f"--model={directory}",
            f"--prompt={p}",
            "--chat-template=off",
            f"--max-new-tokens={new_tokens}",
            "--ignore-eos",
        )["text"]
        for p in prompts
    ]
    tokenizer = Tokenizer.from_directory(directory)
    with open_engine(directory, max_step_tokens=max_step_tokens) as engine:
        streams = [
            engine.submit(
                tokenizer.encode(p), SamplingParams(max_tokens=new_tokens, ignore_eos=True)
            )
            for p in prompts
        ]
        assert [s.result().text for s in streams] == want

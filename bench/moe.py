"""Mixture-of-experts decode: ster_dist at EP=1 and EP=2 against Transformers, and the bytes the
all-to-all dispatch moves per token against an all-gather of the hidden states.

    python bench/moe.py --quick          # 8 experts, hidden 256, 4 layers: about a minute
    python bench/moe.py                  # 16 experts top-2, hidden 512, 6 layers, f32
    python bench/moe.py --threads 1 --ab-only   # only the grouped/loop A/B below

The checkpoint is a random Qwen3-MoE (every layer sparse, top-2, renormalised) built by
Transformers. Decode tokens/s is measured the same way for every engine through its public
generate (ster_dist's: its token engine, engine/local.py): (batch x (N - 1)) / (time of N new tokens
- time of 1 new token), so the prefill
cancels out; best of --repeats after a warm-up, engines alternating. EP=1 runs in this process
with --threads threads; EP=2 runs two spawned ranks (gloo) with threads / 2 each, so both use
the same cores. Transformers runs model.generate in this process with --threads threads.

`ster_ep1_compiled` is ster_ep1 loaded again with its steps compiled (model/compiled.py: the router,
the dispatch and the experts' kernel inside each layer's graph); `ster_ep2_compiled` is the EP=2
ranks with theirs compiled (each MoE layer one operator, run eagerly inside: moe/layer.py's
moe_layer), switched on and off run by run (tests/moe_probe.py's CompiledSwitch); "compiled over
eager" is also timed in pairs, for both.

The experts' A/B, in this process: `ster_ep1_loop` is ster_ep1 with Experts.forward swapped for the
per-expert Python loop it ran before the grouped computation (loop_forward below, kept as the
reference), timed alternately with the engines, so "grouped over loop" is a same-process decode
ratio. Then the experts alone, per step over --layers stacks of cold weights at decode rows (1, 2,
4, 8 tokens x top-k) and prefill rows (256 tokens x top-k): the loop, the grouped computation, and
the other candidate for few rows, gathering the selected experts' weights into one bmm (`gathered`,
decode rows only: it copies a matrix per row), the experts kernel (`kernel`, kernels/experts.cpp,
where it takes the experts), and which of them Experts.forward picks there (ster_ep1 runs it).

Bytes per token per MoE layer (measured at EP=2 from the ranks' dispatch counts, and projected
to larger EP from the EP=1 routing decisions of the same decode):
- all-to-all: every (token, expert) pair whose expert lives on another rank crosses twice (the
  hidden state there, the expert's output back): 2 x pairs away x hidden x bytes, plus the
  per-expert counts exchanged first;
- the gather of the token shares ster_dist does after the layer (its residual is replicated
  over the expert-parallel group): each token's output reaches ep - 1 ranks;
- the all-gather alternative: every rank takes every token's hidden state ((ep - 1) x hidden x
  bytes per token) and sends its experts' partial outputs back in a reduce-scatter (the same
  again).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/common.py: thread setting, timing, tokenizer)

from ster_dist.config import MoEConfig  # noqa: E402
from ster_dist.engine.local import engine_token_ids  # noqa: E402
from ster_dist.engine.loop import EngineConfig  # noqa: E402
from ster_dist.engine.sampling import SamplingParams  # noqa: E402
from ster_dist.load import load_model  # noqa: E402
from ster_dist.moe.experts import Experts  # noqa: E402
from ster_dist.parallel.ctx import ParallelCtx  # noqa: E402
from ster_dist.resolve import resolve  # noqa: E402
from tests.moe_probe import CompiledSwitch, DispatchProbe  # noqa: E402  (rank extensions: counts, compiled on/off)


def build(directory: Path, args) -> None:
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.expert_width,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(common.DTYPES[args.dtype]).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    common.write_wordlevel_tokenizer(directory, args.vocab)


def decode_rates(runs: dict, batch: int, new_tokens: int, repeats: int) -> dict:
    """name -> (decode tokens/s, the tokens of its last long run), from generate() timings: the time
    of new_tokens tokens minus the time of one, best of `repeats`, the engines alternating run by
    run so load from other processes hits them alike."""
    best = {name: [float("inf"), float("inf"), None] for name in runs}
    for run in runs.values():  # warm-up
        run(2)
    for _ in range(repeats):
        for name, run in runs.items():
            long, tokens = _timed(lambda run=run: run(new_tokens))
            short, _ = _timed(lambda run=run: run(1))
            best[name] = [min(best[name][0], long), min(best[name][1], short), tokens]
    return {
        name: (batch * (new_tokens - 1) / max(long - short, 1e-9), tokens)
        for name, (long, short, tokens) in best.items()
    }


def paired_decode_ratio(base, other, new_tokens: int, repeats: int) -> float:
    """The median over repeats of other's decode rate over base's, each repeat timing the two back
    to back (N tokens minus one token, as decode_rates does): on a shared machine the best-of rates
    can come from quiet moments of different lengths, a pair shares its moment."""
    ratios = []
    for _ in range(repeats):
        seconds = []
        for run in (base, other):
            long, _ = _timed(lambda run=run: run(new_tokens))
            short, _ = _timed(lambda run=run: run(1))
            seconds.append(max(long - short, 1e-9))
        ratios.append(seconds[0] / seconds[1])
    return statistics.median(ratios)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def projected_pairs_away(
    ids_per_step: list[torch.Tensor], experts: int, ep: int
) -> tuple[float, float]:
    """(pairs crossing ranks per token, fraction) if these routing decisions ran over ep ranks."""
    owner = torch.arange(experts) * ep // experts  # contiguous blocks (balanced when ep divides)
    away = tokens = 0
    for ids in ids_per_step:  # [tokens, top_k] of one layer's forward
        n = ids.shape[0]
        share = torch.tensor(
            [next(r for r in range(ep) if t < (r + 1) * n // ep) for t in range(n)]
        )
        away += int((owner[ids] != share.unsqueeze(1)).sum())
        tokens += n
    pairs = sum(ids.numel() for ids in ids_per_step)
    return away / max(tokens, 1), away / max(pairs, 1)


def record_routing(model) -> list[torch.Tensor]:
    """Wrap every router of an in-process model so its choices are kept."""
    from ster_dist.moe.layer import MoE

    seen: list[torch.Tensor] = []
    for block in model.layers:
        if isinstance(block.mlp, MoE):
            router = block.mlp.router
            original = router.forward

            def forward(x, hashed=None, original=original):
                weights, ids = original(x, hashed)
                seen.append(ids.clone())
                return weights, ids

            router.forward = forward
    return seen


# ---- the experts' A/B: the per-expert loop, the grouped computation, gathered weights ------------


def loop_forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Experts.forward as it was before the grouped computation: a Python loop over experts, one
    F.linear per expert per projection, after a bincount(...).tolist() host sync."""
    out = x.new_empty((x.shape[0], self.down.shape[1]))
    if x.shape[0] == 0:
        return out
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=self.local).tolist()
    grouped = x[order]
    results = torch.empty_like(out)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = grouped[start : start + count]
            gate = F.linear(
                rows, self.gate[e], None if self.gate_bias is None else self.gate_bias[e]
            )
            up = F.linear(rows, self.up[e], None if self.up_bias is None else self.up_bias[e])
            if self.clamped:
                gate = gate.clamp(max=self.limit)
                h = (up.clamp(-self.limit, self.limit) + 1) * (
                    gate * torch.sigmoid(gate * self.alpha)
                )
            else:
                h = self.act(gate) * up
            bias = self.down_bias[e] if self.down_bias is not None and self.add_down_bias else None
            results[start : start + count] = F.linear(h, self.down[e], bias)
            start += count
    out[order] = results
    return out


def _held(gather_bytes: int, few_rows: int, kernel_rows: int):
    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        saved = self.gather_bytes, self.few_rows, self.kernel_rows
        self.gather_bytes, self.few_rows, self.kernel_rows = gather_bytes, few_rows, kernel_rows
        try:
            return Experts.forward(self, x, local_ids)
        finally:
            self.gather_bytes, self.few_rows, self.kernel_rows = saved

    return forward


# Experts.forward held to one branch: grouped_mm at every row count, each row's expert weights
# gathered (copied)
# into one bmm per projection at every row count, or the experts kernel (kernels/experts.cpp) at
# every row count
grouped_forward = _held(0, 0, 0)
gathered_forward = _held(1 << 62, 0, 0)
kernel_forward = _held(0, 0, 1 << 62)


class loop_experts:
    """Within the block every Experts module runs loop_forward (the class attribute is swapped)."""

    def __enter__(self):
        self.grouped = Experts.forward
        Experts.forward = loop_forward

    def __exit__(self, *exc):
        Experts.forward = self.grouped


def experts_ab(args, repeats: int) -> list[dict]:
    """Per step (every layer's experts once) at decode and prefill rows: ms of each variant (best of
    `repeats`) and the ratios to grouped (the median over repeats of each repeat's ratio: the
    variants run back to back within a repeat, so load from other processes hits a pair alike). The
    layers hold separate weights so each step streams them from memory as a decode step does."""
    dtype = common.DTYPES[args.dtype]
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.expert_width)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        experts = Experts(moe, args.hidden, "silu", ParallelCtx())
        with torch.no_grad():
            for p in experts.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        layers.append(experts.to(dtype))
    variants = {"loop": loop_forward, "grouped": grouped_forward, "gathered": gathered_forward}
    if layers[0].kernel_takes():
        variants["kernel"] = kernel_forward
    table = []
    for tokens in (1, 2, 4, 8, 256):
        rows = tokens * args.top_k
        x = torch.randn(rows, args.hidden, generator=gen).to(dtype)
        ids = torch.randint(0, args.experts, (rows,), generator=gen)
        chosen = {k: f for k, f in variants.items() if k != "gathered" or tokens <= 8}
        times: dict[str, list[float]] = {name: [] for name in chosen}
        with torch.inference_mode():
            reference = loop_forward(layers[0], x, ids)
            for name, forward in chosen.items():
                torch.testing.assert_close(
                    forward(layers[0], x, ids), reference, rtol=2e-2, atol=2e-2
                )
            for _ in range(repeats if tokens <= 8 else max(1, repeats // 2)):
                for name, forward in chosen.items():
                    start = time.perf_counter()
                    for layer in layers:
                        forward(layer, x, ids)
                    times[name].append(time.perf_counter() - start)
        over = {
            name: statistics.median(a / g for a, g in zip(t, times["grouped"]))
            for name, t in times.items()
        }
        rule = "kernel" if layers[0].fused(x) else layers[0].branch(x)
        table.append(
            {
                "tokens": tokens,
                "rows": rows,
                "rule": rule,
                "ms": {k: min(t) * 1e3 for k, t in times.items()},
                "loop_over_grouped": over["loop"],
                "gathered_over_grouped": over.get("gathered"),
                "kernel_over_grouped": over.get("kernel"),
            }
        )
    return table


def print_experts_ab(table: list[dict], layers: int) -> None:
    print(
        f"experts alone, ms per step ({layers} layers, best of repeats; ratios: median of paired repeats):"
    )
    print(
        f"  {'tokens':>6} {'rows':>5} {'loop':>9} {'grouped':>9} {'gathered':>9} {'kernel':>9} {'loop/grouped':>13} "
        f"{'gathered/grouped':>17} {'kernel/grouped':>15}  Experts.forward picks"
    )
    for r in table:
        ms, g, k = r["ms"], r["gathered_over_grouped"], r.get("kernel_over_grouped")
        print(
            f"  {r['tokens']:>6} {r['rows']:>5} {ms['loop']:>9.2f} {ms['grouped']:>9.2f} "
            f"{ms.get('gathered', float('nan')):>9.2f} {ms.get('kernel', float('nan')):>9.2f} "
            f"{r['loop_over_grouped']:>13.2f} {'-' if g is None else f'{g:.2f}':>17} "
            f"{'-' if k is None else f'{k:.2f}':>15}  {r['rule']}"
        )


def report_ab(
    args,
    results: dict,
    paired: float,
    compiled_paired: float,
    table: list[dict],
    load_before: float,
) -> int:
    """--ab-only's report: the decode rates and ratios, the experts-alone table; fails if the greedy
    decodes differ."""
    loop, grouped, compiled = (
        results["ster_ep1_loop"],
        results["ster_ep1"],
        results["ster_ep1_compiled"],
    )
    print(
        f"decode tok/s (batch {args.batch}, {args.new_tokens} new tokens, {args.threads} threads), best of repeats"
    )
    print(
        f"  ster_ep1_loop     {loop[0]:9.1f}\n  ster_ep1          {grouped[0]:9.1f}   x{grouped[0] / loop[0]:.2f} grouped over loop"
    )
    print(
        f"  ster_ep1_compiled {compiled[0]:9.1f}   x{compiled[0] / grouped[0]:.2f} compiled over eager"
    )
    print(f"  grouped over loop, median of {args.repeats} paired repeats: x{paired:.2f}")
    print(f"  compiled over eager, median of {args.repeats} paired repeats: x{compiled_paired:.2f}")
    print_experts_ab(table, args.layers)
    equal = loop[1] == grouped[1] == compiled[1]
    print(f"greedy tokens equal, grouped, loop and compiled: {equal}")
    print(f"1-minute load average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    print(
        json.dumps(
            {
                "shape": {
                    k: getattr(args, k)
                    for k in (
                        "experts",
                        "top_k",
                        "hidden",
                        "expert_width",
                        "layers",
                        "dtype",
                        "batch",
                        "new_tokens",
                        "threads",
                    )
                },
                "decode_tok_s": {
                    "ster_ep1_loop": loop[0],
                    "ster_ep1": grouped[0],
                    "ster_ep1_compiled": compiled[0],
                },
                "grouped_over_loop_decode": grouped[0] / loop[0],
                "grouped_over_loop_decode_paired": paired,
                "compiled_over_eager_decode_paired": compiled_paired,
                "experts_ab": table,
                "greedy_tokens_equal": equal,
            }
        )
    )
    return 0 if equal or args.dtype != "f32" else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--dtype", choices=tuple(common.DTYPES), default="f32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--quick", action="store_true", help="8 experts, hidden 256, 4 layers, 12 new tokens"
    )
    p.add_argument(
        "--model-dir", type=Path, default=None, help="reuse (or build once) a checkpoint directory"
    )
    p.add_argument(
        "--ab-only",
        action="store_true",
        help="only the experts' A/B: ster_ep1 grouped against its per-expert loop, then the experts alone",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.experts, args.hidden, args.expert_width, args.layers, args.new_tokens = (
            8,
            256,
            256,
            4,
            12,
        )
    common.set_threads(args.threads)
    directory = args.model_dir or Path(tempfile.mkdtemp(prefix="moe-bench-"))
    if not (directory / "config.json").is_file():
        build(directory, args)
    checkpoint = resolve(str(directory))
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, args.vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    load_before = os.getloadavg()[0]

    # ---- engines ------------------------------------------------------------------------------
    one = load_model(checkpoint, args.dtype)
    config = EngineConfig(kv_cache_memory=64 << 20)

    def generate(source, n):  # the token engine, every prompt in flight at once, no EOS
        return engine_token_ids(
            source, prompts, SamplingParams(max_tokens=n), (), config, checkpoint
        )

    def run_ep1(n):
        return generate(one, n)

    def run_ep1_loop(n):
        with loop_experts():
            return generate(one, n)

    # the same checkpoint again, its steps compiled (model/compiled.py): the experts inside each
    # layer's graph
    compiled = load_model(checkpoint, args.dtype)
    if (reason := compiled.model.compile_layers()) is not None:
        raise SystemExit(f"ster_ep1_compiled: the model stays eager ({reason})")

    def run_ep1_compiled(n):
        return generate(compiled, n)

    if args.ab_only:
        results = decode_rates(
            {
                "ster_ep1_loop": run_ep1_loop,
                "ster_ep1": run_ep1,
                "ster_ep1_compiled": run_ep1_compiled,
            },
            args.batch,
            args.new_tokens,
            args.repeats,
        )
        paired = paired_decode_ratio(run_ep1_loop, run_ep1, args.new_tokens, args.repeats)
        compiled_paired = paired_decode_ratio(
            run_ep1, run_ep1_compiled, args.new_tokens, args.repeats
        )
        return report_ab(
            args, results, paired, compiled_paired, experts_ab(args, args.repeats), load_before
        )

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=common.DTYPES[args.dtype]
    ).eval()
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run_hf(n):
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[:, ids.shape[1] :].tolist()

    from ster_dist.workers.spawn import SpawnGroup

    with SpawnGroup(2, threads=max(1, args.threads // 2), ep=2) as group:
        group.call("load", checkpoint, args.dtype, "cpu")

        def run_ep2(n, compiled=False):
            assert group.on(CompiledSwitch).use(compiled) == [None, None]
            return generate(group, n)

        # each rank compiles its graphs (the MoE layers one operator: moe/layer.py)
        run_ep2(2, compiled=True)
        results = decode_rates(
            {
                "transformers": run_hf,
                "ster_ep1_loop": run_ep1_loop,
                "ster_ep1": run_ep1,
                "ster_ep1_compiled": run_ep1_compiled,
                "ster_ep2": run_ep2,
                "ster_ep2_compiled": lambda n: run_ep2(n, compiled=True),
            },
            args.batch,
            args.new_tokens,
            args.repeats,
        )
        ep2_paired = paired_decode_ratio(
            run_ep2, lambda n: run_ep2(n, compiled=True), args.new_tokens, args.repeats
        )
        # traffic of one decode run at EP=2, counted by the ranks
        group.on(DispatchProbe).reset()
        run_ep2(args.new_tokens)
        traffic = group.on(DispatchProbe).traffic()
    routing = record_routing(one.model)
    run_ep1(args.new_tokens)

    # ---- bytes per token per MoE layer
    # ------------------------------------------------------------
    item = common.DTYPES[args.dtype].itemsize
    row = args.hidden * item
    # token-layer visits, summed over the ranks' shares
    tokens = sum(t["tokens"] for t in traffic)
    away = sum(t["pairs_sent_away"] for t in traffic)
    forwards = traffic[0]["forwards"]  # per rank: MoE layer forwards of the run
    # each rank's per-expert counts, once per forward
    counts_bytes = 2 * forwards * (args.experts * 8)
    a2a = (2 * away * row + counts_bytes) / tokens
    measured = {
        "ep": 2,
        "all_to_all": a2a,
        "share_gather": 1 * row,
        "all_gather_alternative": 2 * 1 * row,
        "pairs_away_per_token": away / tokens,
    }
    projected = []
    for ep in (2, 4, 8, 16):
        if ep > args.experts:
            break
        per_token, fraction = projected_pairs_away(routing, args.experts, ep)
        projected.append(
            {
                "ep": ep,
                "pairs_away_fraction": fraction,
                "all_to_all": 2 * per_token * row,
                "share_gather": (ep - 1) * row,
                "all_gather_alternative": 2 * (ep - 1) * row,
            }
        )

    ab = experts_ab(args, args.repeats)
    compiled_paired = paired_decode_ratio(run_ep1, run_ep1_compiled, args.new_tokens, args.repeats)
    tokens_equal = (
        results["ster_ep1"][1]
        == results["ster_ep2"][1]
        == results["transformers"][1]
        == results["ster_ep1_compiled"][1]
        == results["ster_ep2_compiled"][1]
    )
    report = {
        "shape": {
            k: getattr(args, k)
            for k in (
                "experts",
                "top_k",
                "hidden",
                "expert_width",
                "layers",
                "vocab",
                "dtype",
                "batch",
                "prompt_len",
                "new_tokens",
                "threads",
            )
        },
        "decode_tok_s": {name: rate for name, (rate, _) in results.items()},
        "ratio_over_transformers": {
            name: results[name][0] / results["transformers"][0]
            for name in (
                "ster_ep1_loop",
                "ster_ep1",
                "ster_ep1_compiled",
                "ster_ep2",
                "ster_ep2_compiled",
            )
        },
        "grouped_over_loop_decode": results["ster_ep1"][0] / results["ster_ep1_loop"][0],
        "compiled_over_eager_decode_paired": compiled_paired,
        "ep2_compiled_over_eager_decode_paired": ep2_paired,
        "experts_ab": ab,
        "greedy_tokens_equal": tokens_equal,
        "bytes_per_token_per_moe_layer": {"measured": measured, "projected": projected},
        "loadavg_before_after": [load_before, os.getloadavg()[0]],
    }
    print(
        f"decode tok/s (batch {args.batch}, {args.new_tokens} new tokens, {args.threads} threads in all)"
    )
    for name, (rate, _) in results.items():
        print(
            f"  {name:17s} {rate:9.1f}   x{rate / results['transformers'][0]:.2f} of Transformers"
        )
    print(
        f"grouped experts over the per-expert loop, ster_ep1 decode: "
        f"x{results['ster_ep1'][0] / results['ster_ep1_loop'][0]:.2f}"
    )
    print(f"compiled steps over eager, ster_ep1 decode, paired runs: x{compiled_paired:.2f}")
    print(f"compiled steps over eager, ster_ep2 decode, paired runs: x{ep2_paired:.2f}")
    print_experts_ab(ab, args.layers)
    print(f"greedy tokens equal across the six: {tokens_equal}")
    print("bytes per token per MoE layer (hidden x dtype = %d B):" % row)
    print(
        f"  {'ep':>3} {'pairs away':>10} {'all-to-all':>11} {'share gather':>13} {'all-gather alt.':>16}"
    )
    m = measured
    print(
        f"  {2:>3} {m['pairs_away_per_token']:>10.2f} {m['all_to_all']:>11.0f} {m['share_gather']:>13.0f} "
        f"{m['all_gather_alternative']:>16.0f}   (measured)"
    )
    for r in projected:
        print(
            f"  {r['ep']:>3} {r['pairs_away_fraction'] * args.top_k:>10.2f} {r['all_to_all']:>11.0f} "
            f"{r['share_gather']:>13.0f} {r['all_gather_alternative']:>16.0f}   (projected)"
        )
    print(f"1-minute load average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    print(json.dumps(report))
    return 0 if tokens_equal or args.dtype != "f32" else 1


if __name__ == "__main__":
    sys.exit(main())

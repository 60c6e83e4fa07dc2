"""The one prepared device check: every Triton kernel against its torch reference on CUDA (max
error), greedy parity of tiny models under each `--kernels` choice, decode throughput of a
SmolLM2-sized Llama (f32, bf16; batch 1, 8, 64) against the HBM roofline, and the FP8 block GEMM's
TFLOP/s against bf16's. One JSON report on stdout (and in --output). TP=1, one GPU; meant to finish
in a few minutes on one H100 (bench/README.md says how to run it there).

`--dry-run` runs every step on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set here) on
small shapes and reports no timings: it checks that the script and every path it drives work before
a GPU is lent (tests/kernels/test_gpu_check.py runs it).

CUDA graphs for decode steps are not built yet: the decode step reports `"cuda_graphs": "not
built"`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/gpu_check.py` from the repository root
    sys.path.insert(0, str(REPO))

HBM_BYTES_PER_S = 3.35e12  # H100 SXM's HBM3


def _max_error(got, want) -> float:
    return float((got.float().cpu() - want.float().cpu()).abs().max())


def kernel_checks(device: str, dry: bool) -> dict:
    """Each kernel on `device` against its torch reference (on the CPU, in f32): max abs error and
    whether it is within the dtype's tolerance. Shapes: small ones in a dry run, model-sized ones on
    a GPU."""
    import torch

    from ster_dist.kernels.triton import decode, extend, fp8, mla, moe, reference as ref

    g = torch.Generator().manual_seed(0)
    out = {}
    page = 16
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        heads, kv, d, lengths = (4, 2, 16, [3, 40]) if dry else (32, 8, 128, [1, 700, 4000, 33])
        blocks = sum(-(-n // page) for n in lengths) + 1
        keys = torch.randn(blocks, page, kv, d, generator=g).to(dtype)
        values = torch.randn(blocks, page, kv, d, generator=g).to(dtype)
        width = max(-(-n // page) for n in lengths)
        table, at = [], 1
        for n in lengths:
            need = -(-n // page)
            table.append(list(range(at, at + need)) + [0] * (width - need))
            at += need
        table = torch.tensor(table)
        end = torch.tensor(lengths)
        first = (end - 24).clamp(min=0)
        q = torch.randn(len(lengths), heads, d, generator=g).to(dtype)
        sinks = torch.randn(heads, generator=g)
        on = [t.to(device) for t in (q, keys, values, table, first, end, sinks)]
        got = decode.paged_decode(*on[:6], 0.1, 30.0, on[6])
        err = _max_error(
            got, ref.paged_decode_reference(q, keys, values, table, first, end, 0.1, 30.0, sinks)
        )
        out[f"paged_decode_{str(dtype)[6:]}"] = {"max_error": err, "ok": err < tol}
        queries = 20 if dry else 256
        starts = (end - queries).clamp(min=0)
        short = [i for i, n in enumerate(lengths) if n >= queries]
        qx = torch.randn(len(short), heads, queries, d, generator=g).to(dtype)
        sel = torch.tensor(short)
        got = extend.paged_extend(
            qx.to(device), on[1], on[2], on[3][sel.to(device)], starts[sel].to(device), 0, 0.1
        )
        err = _max_error(
            got, ref.paged_extend_reference(qx, keys, values, table[sel], starts[sel], 0, 0.1)
        )
        out[f"paged_extend_{str(dtype)[6:]}"] = {"max_error": err, "ok": err < tol}
        mh, rank, rope = (20, 64, 16) if dry else (128, 512, 64)
        lat = torch.randn(blocks, page, 1, rank, generator=g).to(dtype)
        rot = torch.randn(blocks, page, 1, rope, generator=g).to(dtype)
        ql = (torch.randn(len(lengths), mh, rank, generator=g) / 8).to(dtype)
        qr = torch.randn(len(lengths), mh, rope, generator=g).to(dtype)
        got = mla.mla_decode(
            ql.to(device), qr.to(device), lat.to(device), rot.to(device), on[3], on[4], on[5], 0.05
        )
        err = _max_error(got, ref.mla_decode_reference(ql, qr, lat, rot, table, first, end, 0.05))
        out[f"mla_decode_{str(dtype)[6:]}"] = {"max_error": err, "ok": err < tol}
        tokens, experts, hidden, inner = (12, 4, 48, 32) if dry else (256, 64, 2048, 768)
        # the last: none
        ids = torch.stack([torch.randperm(experts - 1, generator=g)[:2] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, 2, generator=g), -1)
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        gate, up = (
            (torch.randn(experts, inner, hidden, generator=g) / hidden**0.5).to(dtype) for _ in "gu"
        )
        down = (torch.randn(experts, hidden, inner, generator=g) / inner**0.5).to(dtype)
        got = moe.fused_experts(*(t.to(device) for t in (x, ids, weights, gate, up, down)))
        want = ref.experts_reference(x, ids, weights, torch.cat((gate, up), 1), down)
        err = _max_error(got, want)
        out[f"fused_experts_{str(dtype)[6:]}"] = {
            "max_error": err,
            "ok": err < tol * max(1.0, float(want.abs().max())),
        }
    m, n, k = (5, 192, 256) if dry else (256, 4096, 7168)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(n, k, generator=g) / 4).to(fp8.FP8)
    s = torch.rand(-(-n // 128), k // 128, generator=g) / 8 + 0.01
    got = fp8.block_gemm(x.to(device), w.to(device), s.to(device), torch.float32)
    want = (
        ref.dequantize_blocks(*ref.quantize_groups_reference(x, 128), (1, 128))
        @ ref.dequantize_blocks(w, s, (128, 128)).T
    )
    err = _max_error(got, want)
    out["fp8_block_gemm"] = {"max_error": err, "ok": err < 1e-3 * max(1.0, float(want.abs().max()))}
    q8, s8 = fp8.quantize_groups(x.to(device), 128)
    want_q, want_s = ref.quantize_groups_reference(x, 128)
    out["fp8_quantize_groups"] = {
        "ok": bool(
            torch.equal(q8.cpu().view(torch.uint8), want_q.view(torch.uint8))
            and torch.equal(s8.cpu(), want_s)
        )
    }
    return out


def _generate(
    model: Path,
    device: str,
    kernels: str | None,
    prompts: list[str],
    tokens: int,
    precision: str = "f32",
) -> tuple[list[str], float]:
    """The answers of `ster generate` over these prompts (one engine batch) and its seconds, in this
    process."""
    from ster_dist import ops
    from ster_dist.cli import parse
    from ster_dist.session import Session

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps({"prompts": prompts}))
        argv = [
            "generate",
            f"--model={model}",
            f"--prompts={path}",
            f"--output={Path(tmp) / 'out.json'}",
            f"--max-new-tokens={tokens}",
            "--ignore-eos",
            "--chat-template=off",
            f"--device={device}",
            f"--precision={precision}",
            *([f"--kernels={kernels}"] if kernels else []),
        ]
        request = parse(argv)
        with contextlib.redirect_stderr(io.StringIO()), Session(request) as session:
            # the kernels' compiles and the engine's start, outside the clock
            ops.generate(session, request)
            started = time.perf_counter()
            ops.generate(session, request)
            seconds = time.perf_counter() - started
        answers = json.loads((Path(tmp) / "out.json").read_text())
    texts = [a["text"] for a in answers["results"]]
    return texts, seconds


def parity(device: str, dry: bool, root: Path) -> dict:
    """Greedy answers of a tiny llama and a tiny deepseek_v3 under each --kernels choice, against
    torch's."""
    from ster_dist.load.toy import make_toy_model

    choices = ["triton", "torch"] + (["native"] if device == "cpu" else [])
    out = {}
    for family in ("llama", "deepseek_v3"):
        model = root / family
        make_toy_model(model, family=family, layers=2, hidden=64, seed=0)
        texts = {
            c: _generate(model, device, c, ["the quick brown fox", "one two"], 6)[0]
            for c in choices
        }
        every = [t for c in choices for t in texts[c]]
        out[family] = {
            "equal": all(texts[c] == texts["torch"] for c in choices)
            and len(every) == 2 * len(choices)
            and all(every),
            "answers": texts,
        }
    return out


def decode(device: str, dry: bool, root: Path) -> dict:
    """Tokens/s of a SmolLM2-sized Llama (30 layers, hidden 576; the toy's small vocabulary) through
    the engine, per precision, batch and kernels, with the HBM roofline (weight bytes / 3.35 TB/s a
    step)."""
    from ster_dist.load.toy import make_toy_model

    model = root / "smollm2_sized"
    layers, hidden = (2, 64) if dry else (30, 576)
    make_toy_model(model, family="llama", layers=layers, hidden=hidden, seed=0)
    f32_bytes = (model / "model.safetensors").stat().st_size
    out = {"layers": layers, "hidden": hidden, "cuda_graphs": "not built", "runs": []}
    tokens = 4 if dry else 64
    for precision in ("f32", "bf16"):
        weight_bytes = f32_bytes if precision == "f32" else f32_bytes // 2
        for batch in (1, 2) if dry else (1, 8, 64):
            for kernels in ("triton", "torch"):
                _, seconds = _generate(
                    model, device, kernels, [f"prompt {i}" for i in range(batch)], tokens, precision
                )
                roofline = batch / (weight_bytes / HBM_BYTES_PER_S)
                rate = batch * tokens / seconds
                out["runs"].append(
                    {
                        "precision": precision,
                        "batch": batch,
                        "kernels": kernels,
                        "tokens_per_s": None if dry else round(rate, 1),
                        "roofline_tokens_per_s": round(roofline, 1),
                        "of_roofline": None if dry else round(rate / roofline, 3),
                    }
                )
    return out


def fp8_gemm(device: str, dry: bool) -> dict:
    """The FP8 block GEMM's TFLOP/s against torch's bf16 matmul on DeepSeek-V3-sized products."""
    import torch

    from ster_dist.kernels.triton import fp8

    m, n, k = (16, 128, 256) if dry else (4096, 7168, 7168)
    x = torch.randn(m, k, device=device).to(torch.bfloat16)
    w = torch.randn(n, k, device=device).to(fp8.FP8)
    s = torch.ones(-(-n // 128), k // 128, device=device)
    wb = w.to(torch.bfloat16)
    if dry:
        fp8.block_gemm(x, w, s, torch.bfloat16)
        return {"shape": [m, n, k], "fp8_tflops": None, "bf16_tflops": None}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / 10

    flops = 2 * m * n * k
    return {
        "shape": [m, n, k],
        "fp8_tflops": round(
            flops / timed(lambda: fp8.block_gemm(x, w, s, torch.bfloat16)) / 1e12, 1
        ),
        "bf16_tflops": round(flops / timed(lambda: x @ wb.T) / 1e12, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="on the CPU under Triton's interpreter, no timings"
    )
    parser.add_argument("--output", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; --dry-run checks the steps on the CPU")
    report: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name, step in (
            ("kernels", lambda: kernel_checks(device, args.dry_run)),
            ("parity", lambda: parity(device, args.dry_run, Path(tmp))),
            ("decode", lambda: decode(device, args.dry_run, Path(tmp))),
            ("fp8_gemm", lambda: fp8_gemm(device, args.dry_run)),
        ):
            step_started = time.perf_counter()
            try:
                report[name] = step()
            except Exception as error:  # one step's failure is reported beside the others' results
                report[name] = {
                    "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                }
            report[name + "_seconds"] = round(time.perf_counter() - step_started, 1)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["ok"] = (
        all(v.get("ok", True) for v in report["kernels"].values())
        if "error" not in report["kernels"]
        else False
    )
    report["ok"] = (
        report["ok"]
        and all("error" not in report[s] for s in ("parity", "decode", "fp8_gemm"))
        and all(p["equal"] for p in report["parity"].values())
    )
    text = json.dumps(report)
    if args.output:
        from ster_dist.atomic import replacing

        with replacing(args.output) as handle:
            handle.write(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()

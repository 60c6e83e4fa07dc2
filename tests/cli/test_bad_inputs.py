"""Bad inputs end in one refusal line with nothing written (issue 19): a corpus generated here.

* Chat templates that loop, grow a value, recurse or flood the output: refused within their time
  budget and a bounded memory peak, on the caller's thread or any other (no signals).
* GGUF files that lie about counts, lengths, types, offsets or metadata, and safetensors
  checkpoints cut short: `ster gguf-import` / `ster merge` exit 2 with one line, no output and no
  partial left.
* A disk that fills (a real EFBIG from RLIMIT_FSIZE in a subprocess, SIGXFSZ ignored) during
  gguf-import or merge: one line, exit 2, nothing left behind.
* An import killed with SIGKILL mid-write leaves a partial named after its pid; the next run
  writing the same output removes it once its writer is gone, never a live writer's.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from ster_dist import atomic
from ster_dist.tokenizer import template_limits as template_module
from ster_dist.cli import main
from ster_dist.errors import Refusal
from ster_dist.tokenizer import Tokenizer
from tests.cli_run import make_toy
from tests.gguf_fixtures import write_llama
from tests.steer.test_merge import ster_adapter
from tests.tiny_tokenizer import CHATML, build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
# seconds: the tests run hostile templates under a shorter budget than the default
SHORT_BUDGET = 2.0
SLACK = 3.0  # seconds past the budget a refusal may take on a loaded two-core machine
MEMORY_PEAK = 64 << 20  # bytes Python may allocate while a hostile template is refused


# ---- chat templates ------------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "three nested range(99999)": "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "nested loops over a repeated list": "{% set l = [0] * 90000 %}{% for a in l %}{% for b in l %}{% endfor %}"
    "{% endfor %}",
    "range(10**12)": "{% for a in range(10**12) %}x{% endfor %}",
    "'a' * 2000000000": "{{ 'a' * 2000000000 }}",
    "a list repeated 10**10 times": "{{ ([1] * 100000) * 100000 }}",
    "a string doubled by ~": "{% set a = 'x' * 1000000 %}"
    + "{% set a = a ~ a %}" * 20
    + "{{ a|length }}",
    "a namespace doubled by +": "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "a macro calling itself": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a macro calling itself twice": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}x"
    "{% endmacro %}{{ f(40) }}",
    "a recursive loop": "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "str.center": "{{ 'a'.center(2000000000) }}",
    "the center filter": "{{ 'a'|center(2000000000) }}",
    "a %-format width": "{{ '%2000000000d' % 1 }}",
    "a %-format * width": "{{ '%*d' % (2000000000, 1) }}",
    "a str.format width": "{{ '{:>2000000000}'.format(1) }}",
    "a nested str.format width": "{{ '{:>{w}}'.format(1, w=2000000000) }}",
    "str.join of a repeated list": "{% set s = 'x' * 1000000 %}{{ '-'.join([s] * 10000) }}",
    "str.replace of the empty string": "{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}",
    "a literal list of large strings": "{% set s = 'x' * 3000000 %}{{ [s, s, s, s, s, s, s, s, s, s] }}",
    "2 ** 10000000000": "{{ 2 ** 10000000000 }}",
    "an integer squared 64 times": "{% set ns = namespace(x=3) %}{% for i in range(64) %}"
    "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    "batch padded to 10**9": "{{ [1]|batch(1000000000, 'x')|list|length }}",
    "slice into 10**9 lists": "{{ [1]|slice(1000000000)|list|length }}",
    "lipsum(10**7)": "{{ lipsum(10000000) }}",
    "expandtabs": "{% set s = '\t' * 1000000 %}{{ s.expandtabs(1000000) }}",
    "indent of many lines": "{% set s = '\n' * 1000000 %}{{ s|indent(1000000) }}",
    "wordwrap with a long wrapstring": "{% set s = 'a ' * 1000000 %}{{ s|wordwrap(1, wrapstring='x' * 1000000) }}",
    "str.translate to long strings": "{% set s = 'a' * 1000000 %}{{ s.translate({97: 'b' * 1000000}) }}",
    "tojson with a huge indent": "{{ messages|tojson(indent=1000000000) }}",
    "an output flood": "{% set s = 'x' * 1000000 %}{% for i in range(99999) %}{{ s }}{% endfor %}",
    "division by zero": "{{ 1 / 0 }}",
    "raise_exception": "{{ raise_exception('no system messages here') }}",
    "a template that does not parse": "{% for %}",
}


def _template_dir(root: Path, name: str, template: str) -> Path:
    directory = root / name.replace(" ", "_").replace("/", "_").replace("*", "x")
    build_tiny_tokenizer(directory, chat_template=template)
    return directory


def _refused_in_bounds(tok: Tokenizer, budget: float) -> str:
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(Refusal) as refusal:
            tok.render_chat(MESSAGES)
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(refusal.value)
    assert "\n" not in message and len(message) < 400, message
    assert elapsed < budget + SLACK, (elapsed, message)
    assert peak < MEMORY_PEAK, (peak, message)
    return message


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_refused_in_time_and_memory(name, tmp_path, monkeypatch):
    monkeypatch.setattr(template_module, "TEMPLATE_SECONDS", SHORT_BUDGET)
    tok = Tokenizer.from_directory(_template_dir(tmp_path, name, HOSTILE_TEMPLATES[name]))
    message = _refused_in_bounds(tok, SHORT_BUDGET)
    assert "chat template" in message and (
        "--chat-template off" in message or "rejected" in message
    )
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_the_default_budget_stops_three_nested_ranges_on_another_thread(tmp_path):
    # the token engine and the server render on their own threads: no signal can reach them there
    tok = Tokenizer.from_directory(
        _template_dir(tmp_path, "nested", HOSTILE_TEMPLATES["three nested range(99999)"])
    )
    found = {}
    thread = threading.Thread(
        target=lambda: found.setdefault(
            "message", _refused_in_bounds(tok, template_module.TEMPLATE_SECONDS)
        )
    )
    thread.start()
    thread.join(template_module.TEMPLATE_SECONDS + 2 * SLACK)
    assert not thread.is_alive()
    assert f"ran past its {template_module.TEMPLATE_SECONDS:g} s budget" in found["message"]


def test_an_ordinary_template_renders_as_before_and_a_long_conversation_fits(tmp_path):
    tok = Tokenizer.from_directory(_template_dir(tmp_path, "chatml", CHATML))
    assert (
        tok.render_chat(MESSAGES)
        == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in MESSAGES)
        + "<|im_start|>assistant\n"
    )
    # a conversation larger than the fixed floor: the size budget grows with the messages
    long = [
        {"role": "user", "content": "y" * (3 << 20)},
        {"role": "assistant", "content": "z" * (3 << 20)},
    ]
    assert len(tok.render_chat(long)) > 6 << 20


# ---- GGUF files ----------------------------------------------------------------------------------


def _s(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def _framed(
    n_tensors: int, kvs: list[bytes], infos: list[bytes] = (), tail: int = 64, version: int = 3
) -> bytes:
    return (
        b"GGUF"
        + struct.pack("<IQQ", version, n_tensors, len(kvs))
        + b"".join(kvs)
        + b"".join(infos)
        + bytes(tail)
    )


def _kv_str(key: bytes, value: bytes, length: int | None = None) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(value, length)


def _set_u32(raw: bytes, key: bytes, value: int) -> bytes:
    at = raw.index(_s(key) + struct.pack("<I", 4)) + len(_s(key)) + 4
    return raw[:at] + struct.pack("<I", value) + raw[at + 4 :]


def _architecture_as_a_list(raw: bytes) -> bytes:
    """general.architecture "llama" (type, length, 5 bytes) rewritten as a one-item uint8 array,
    which takes the same 17 bytes, so every later offset stays where it was."""
    old = struct.pack("<I", 8) + _s(b"llama")
    new = struct.pack("<IIQ", 9, 0, 1) + b"l"
    assert len(old) == len(new)
    return raw.replace(_s(b"general.architecture") + old, _s(b"general.architecture") + new)


def _gguf_corpus(real: bytes) -> dict[str, bytes]:
    nested = struct.pack("<IQ", 9, 1) * 9 + struct.pack("<IQ", 0, 0)
    tensor = _s(b"token_embd.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 64, 10)
    merges_at = real.index(b"h e")
    return {
        "an empty file": b"",
        "a text file": b"hello, I am not a model\n",
        "the magic alone": b"GGUF",
        "a cut header": real[:30],
        "version 99": _framed(0, [], version=99),
        "a string of 2**60 bytes": _framed(0, [_kv_str(b"general.architecture", b"llama", 2**60)]),
        "a key of 2**64-1 bytes": _framed(0, [_s(b"k", 2**64 - 1)]),
        "an array of 2**60 floats": _framed(
            0, [_s(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**60)]
        ),
        "an array of 2**60 strings": _framed(
            0, [_s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**60)]
        ),
        "2**60 tensors": b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0) + bytes(64),
        "arrays nested ten deep": _framed(0, [_s(b"deep") + struct.pack("<I", 9) + nested]),
        "an unknown value type": _framed(0, [_s(b"odd") + struct.pack("<I", 77) + bytes(8)]),
        "a key that is not UTF-8": _framed(0, [_kv_str(b"\xff\xfe", b"x")]),
        "a tensor of seven dimensions": _framed(
            1, [], [_s(b"t") + struct.pack("<I", 7) + bytes(56) + bytes(12)]
        ),
        "an unknown tensor type": _framed(1, [], [tensor + struct.pack("<IQ", 1000, 0)]),
        "tensor data past the end": _framed(1, [], [tensor + struct.pack("<IQ", 0, 0)], tail=100),
        "a real file cut in its data": real[:-100],
        "an architecture llama.cpp has but ster_dist does not read": real.replace(
            _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama"),
            _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"bloom"),
        ),
        "an architecture that is a list": _architecture_as_a_list(real),
        "zero attention heads": _set_u32(real, b"llama.attention.head_count", 0),
        "a block count of 2**32-1": _set_u32(real, b"llama.block_count", 2**32 - 1),
        "a merge naming tokens the vocabulary lacks": real[:merges_at]
        + b"q q"
        + real[merges_at + 3 :],
        "an alignment that is no power of two": _framed(
            0, [_s(b"general.alignment") + struct.pack("<II", 4, 3)]
        ),
    }


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "real.gguf"
    write_llama(path, layers=1, hidden=32, heads=2, kv_heads=1, inter=64)
    return path.read_bytes()


def _leftovers(directory: Path, output: Path) -> list[str]:
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.name == output.name or p.name.startswith(f".{output.name}.")
    )


def _refused_by_cli(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err, err
    return err[-1]


def test_bad_gguf_files_are_refused_with_nothing_written(real_gguf, tmp_path, capsys):
    refusals = {}
    for name, data in _gguf_corpus(real_gguf).items():
        source = tmp_path / f"{len(refusals)}.gguf"
        source.write_bytes(data)
        for safetensors in (False, True):
            out = tmp_path / f"out{len(refusals)}"
            line = _refused_by_cli(
                ["gguf-import", str(source), str(out)] + ["--safetensors"] * safetensors, capsys
            )
            assert "Traceback" not in line and len(line) < 400, (name, line)
            assert _leftovers(tmp_path, out) == [], name
        refusals[name] = line
    assert len(set(refusals.values())) == len(refusals), refusals  # each names its own problem


# ---- safetensors checkpoints cut short -----------------------------------------------------------


@pytest.fixture(scope="module")
def merge_inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("merge")
    base = Path(make_toy(tmp_path_factory))
    # for copies too
    ster_adapter(root / "adapter.safetensors", base, ["query", "down"], [0, 1], model=None)
    return base, root / "adapter.safetensors"


def _cut_copy(base: Path, target: Path, cut) -> Path:
    shutil.copytree(base, target)
    weights = target / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(cut(raw))
    return target


SAFETENSORS_CUTS = {
    "cut inside the length prefix": lambda raw: raw[:5],
    "cut inside the header": lambda raw: raw[: 8 + struct.unpack("<Q", raw[:8])[0] // 2],
    "cut inside the data": lambda raw: raw[: len(raw) - 1000],
    "a length prefix past the end": lambda raw: struct.pack("<Q", len(raw) * 4) + raw[8:],
    "a header that is not JSON": lambda raw: (
        raw[:8]
        + b"{" * struct.unpack("<Q", raw[:8])[0]
        + raw[8 + struct.unpack("<Q", raw[:8])[0] :]
    ),
}


@pytest.mark.parametrize("name", list(SAFETENSORS_CUTS))
def test_a_truncated_safetensors_base_is_refused_by_merge_with_nothing_written(
    name, merge_inputs, tmp_path, capsys
):
    base, adapter = merge_inputs
    broken = _cut_copy(base, tmp_path / "base", SAFETENSORS_CUTS[name])
    out = tmp_path / "merged"
    line = _refused_by_cli(
        ["merge", "--model", str(broken), "--adapter", str(adapter), "--output", str(out)], capsys
    )
    assert "model.safetensors" in line and "Traceback" not in line, line
    assert _leftovers(tmp_path, out) == []


# ---- a full disk: a real EFBIG from RLIMIT_FSIZE
# ---------------------------------------------------


def _file_size_limit(limit: int):
    def apply():
        # the write fails with EFBIG instead of killing
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def _ster(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ster_dist.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
        **kwargs,
    )


def test_a_full_disk_during_gguf_import_is_one_line_and_leaves_nothing(tmp_path):
    write_llama(tmp_path / "m.gguf", hidden=64, layers=2)
    out = tmp_path / "out"
    done = _ster(
        ["gguf-import", str(tmp_path / "m.gguf"), str(out), "--safetensors"],
        preexec_fn=_file_size_limit(40_000),
    )
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert (
        line.startswith(f"a file size limit was reached writing {out} (") and "bytes needed" in line
    ), line
    assert "choose another --output" in line
    assert _leftovers(tmp_path, out) == []


def test_a_full_disk_during_merge_is_one_line_and_leaves_nothing(merge_inputs, tmp_path):
    base, adapter = merge_inputs
    out = tmp_path / "merged"
    done = _ster(
        ["merge", "--model", str(base), "--adapter", str(adapter), "--output", str(out)],
        preexec_fn=_file_size_limit(20_000),
    )
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    assert (
        f"a file size limit was reached writing {out} (" in line
        and "choose another --output" in line
    ), line
    assert _leftovers(tmp_path, out) == []  # nor the .merged.merging work directory


# ---- a killed import's partial -------------------------------------------------------------------

# the import, held (not mocked) at the moment it opens its safetensors file, so the test can kill it
# there
HELD_IMPORT = """
import sys, time
def hold(event, args):
    if event == "open" and str(args[0]).endswith("model.safetensors") and ".partial-" in str(args[0]):
        open(sys.argv[-1], "w").close()
        time.sleep(120)
sys.addaudithook(hold)
from ster_dist.cli import main
main(sys.argv[1:-1])
"""


def test_a_killed_imports_partial_is_removed_by_the_next_run(tmp_path):
    write_llama(tmp_path / "m.gguf", hidden=64, layers=2)
    out, holding = tmp_path / "out", tmp_path / "holding"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HELD_IMPORT,
            "gguf-import",
            str(tmp_path / "m.gguf"),
            str(out),
            "--safetensors",
            str(holding),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not holding.exists():
        assert writer.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert f"partial-{writer.pid}@" in partial.name and (partial / "config.json").is_file()
    # a partial of a writer still running (this process) is never removed, however old
    alive = tmp_path / f"{atomic.partial_prefix(out)}alive"
    alive.mkdir()
    old = time.time() - 10 * atomic.STALE_AFTER_S
    for path in [partial, *partial.iterdir(), alive]:
        os.utime(path, (old, old))  # some minutes later
    assert main(["gguf-import", str(tmp_path / "m.gguf"), str(out), "--safetensors"]) == 0
    assert not partial.exists() and alive.exists()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert sorted(p.name for p in out.iterdir()) == [
        ".ster-made.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_fresh_partial_of_a_dead_writer_waits_its_minutes(tmp_path):
    # the writer's pid may be gone only in this pid namespace: an untouched partial is removed later
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    partial = (
        tmp_path / f".out.partial-{int(dead.stdout)}@{atomic.partial_prefix('x').split('@')[1]}abc"
    )
    partial.mkdir()
    assert atomic.sweep_stale(tmp_path / "out") == [] and partial.exists()
    old = time.time() - atomic.STALE_AFTER_S - 1
    os.utime(partial, (old, old))
    assert atomic.sweep_stale(tmp_path / "out") == [partial] and not partial.exists()

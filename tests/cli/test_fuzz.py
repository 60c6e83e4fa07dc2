"""Property-based fuzzing of the three parsers that take untrusted input (issue 19).

A safetensors header, a config.json and a job spec come from files or clients ster_dist does not
control: whatever they hold, the parser answers with a value or a one-line Refusal, never another
exception and never a hang. Examples per test stay modest so this file runs in well under a minute
on two cores; `--hypothesis-seed` reproduces a failure hypothesis reports.
"""

from __future__ import annotations

import os

import atexit
import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ster_dist.config import from_hf  # noqa: E402
from ster_dist.config.ranges import INTS, PER_LAYER, POSITIVE, FINITE  # noqa: E402
from ster_dist.errors import Refusal  # noqa: E402
from ster_dist.protocol import names, request_class, validate  # noqa: E402
from ster_dist.shard.safetensors_header import DTYPES, entries, header_bytes, read_header  # noqa: E402
from ster_dist.shard.source import SafetensorsSource  # noqa: E402

# one deadline per example: a parser that loops over a stated size shows up as a deadline failure
# CI (CI=true) draws the same examples every run, so a red CI names a reproducible input; a
# developer's
# run draws new ones and may find new bugs
FUZZ = settings(
    max_examples=200,
    deadline=2000,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
# one scratch file for every example: pytest's tmp_path is per test, not per example
SCRATCH = Path(tempfile.mkdtemp(prefix="ster-fuzz-"))
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _file(data: bytes) -> Path:
    path = SCRATCH / "fuzz.safetensors"
    path.write_bytes(data)
    return path


def _framed(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _read_all(path: Path) -> None:
    """read_header, entries and a full read; a header that passes must describe readable data."""
    size = path.stat().st_size
    found = entries(path)
    spans = sorted((e.offset, e.offset + e.nbytes) for e in found if e.nbytes)
    for (_, end), (begin, _) in zip(spans, spans[1:]):
        assert end <= begin  # no two tensors share bytes
    for entry in found:
        assert read_header(path).data_start <= entry.offset and entry.offset + entry.nbytes <= size
        assert entry.nbytes == math.prod(entry.shape) * DTYPES[entry.dtype].itemsize
    source = SafetensorsSource([path])
    try:
        for name in source.names():
            source.read(name)
    finally:
        source.close()


def _refused_or_read(data: bytes) -> None:
    path = _file(data)
    try:
        _read_all(path)
    except Refusal as exc:
        assert "\n" not in str(exc)


# ---- (a) safetensors headers -----------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_are_read_or_refused(data):
    _refused_or_read(data)


@FUZZ
@given(st.binary(max_size=256), st.binary(max_size=64))
def test_a_framed_arbitrary_header_is_read_or_refused(header, data):
    _refused_or_read(_framed(header, data))


dtypes = st.sampled_from(sorted(DTYPES) + ["Q4", "f32", ""]) | json_values
shapes = st.lists(st.integers(min_value=-2, max_value=4), max_size=3) | json_values
offsets = st.lists(st.integers(min_value=-16, max_value=80), min_size=2, max_size=2) | json_values
entry_objects = st.fixed_dictionaries(
    {}, optional={"dtype": dtypes, "shape": shapes, "data_offsets": offsets}
)
headers = (
    st.dictionaries(st.text(max_size=6), entry_objects | json_values, max_size=4) | json_values
)
metadata = (
    st.dictionaries(st.text(max_size=4), st.text(max_size=4) | json_values, max_size=2)
    | json_values
)


@FUZZ
@given(
    headers,
    st.none() | metadata,
    st.integers(min_value=0, max_value=80),
    st.integers(min_value=0, max_value=7),
)
def test_a_structured_wrong_header_is_read_or_refused(header, meta, data_size, padding):
    if isinstance(header, dict) and meta is not None:
        header = {"__metadata__": meta, **header}
    raw = json.dumps(header).encode() + b" " * padding
    _refused_or_read(_framed(raw, bytes(data_size)))


tensors = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=8).filter(lambda n: n != "__metadata__"),
        st.sampled_from(sorted(DTYPES)),
        st.lists(st.integers(min_value=0, max_value=4), max_size=3).map(tuple),
    ),
    max_size=5,
    unique_by=lambda t: t[0],
)


@FUZZ
@given(tensors, st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
def test_a_valid_header_round_trips(specs, meta):
    raw = header_bytes(specs, meta)
    total = sum(math.prod(shape) * DTYPES[tag].itemsize for _, tag, shape in specs)
    path = _file(raw + bytes(total))
    header = read_header(path)
    assert header.metadata == (meta or {}) and header.data_start == len(raw)
    assert [(e.name, e.dtype, e.shape) for e in entries(path)] == [
        (n, t, tuple(s)) for n, t, s in specs
    ]
    _read_all(path)


# ---- (b) config.json normalisation -----------------------------------------------------------

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# every key a Llama config is read through, and the aliases and other families' keys config.py also
# reads
CONFIG_KEYS = sorted(
    set(TINY_LLAMA)
    | set(INTS)
    | set(PER_LAYER)
    | set(POSITIVE)
    | set(FINITE)
    | {
        "rope_scaling",
        "rope_parameters",
        "layer_types",
        "no_rope_layers",
        "layer_rope_theta",
        "head_dim",
        "partial_rotary_factor",
        "rotary_dim",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "attention_bias",
        "mlp_bias",
        "pad_token_id",
        "torch_dtype",
        "dtype",
        "hidden_activation",
        "activation_function",
        "ffn_act_fn",
        "model_type",
        "text_config",
        "architectures",
        "quantization_config",
    }
)
rope_objects = st.fixed_dictionaries(
    {
        "rope_type": st.sampled_from(
            ["default", "linear", "llama3", "longrope", "yarn", "dynamic", "ntk"]
        )
    },
    optional={
        key: json_scalars | st.floats(min_value=-4, max_value=64)
        for key in (
            "factor",
            "original_max_position_embeddings",
            "low_freq_factor",
            "high_freq_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "alpha",
            "rope_theta",
            "truncate",
            "partial_rotary_factor",
        )
    }
    | {"short_factor": json_values, "long_factor": json_values},
)


def _normalised_or_refused(raw: dict) -> None:
    try:
        from_hf(raw)
    except Refusal as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.sampled_from(CONFIG_KEYS), json_values)
def test_one_config_key_replaced_by_any_json_value(key, value):
    _normalised_or_refused({**TINY_LLAMA, key: value})


@FUZZ
@given(
    st.sampled_from(sorted(k for k in set(INTS) | set(PER_LAYER) if k not in ("model_type",))),
    st.integers(min_value=-(10**12), max_value=10**12) | st.floats(),
)
def test_one_size_replaced_by_any_number(key, value):
    _normalised_or_refused({**TINY_LLAMA, key: value})


@FUZZ
@given(st.sampled_from(["rope_scaling", "rope_parameters"]), rope_objects)
def test_any_rope_scaling_object(key, rope):
    _normalised_or_refused({**TINY_LLAMA, key: rope})


@FUZZ
@given(
    st.dictionaries(st.text(max_size=12) | st.sampled_from(CONFIG_KEYS), json_values, max_size=6)
)
def test_arbitrary_extra_keys(extra):
    _normalised_or_refused(
        {**extra, **TINY_LLAMA} if "model_type" in extra else {**TINY_LLAMA, **extra}
    )


# ---- (c) job specs ---------------------------------------------------------------------------

KINDS = ("generate", "extract", "merge")


def _spellings(kind: str) -> list[str]:
    fields = ["merges"] if kind == "merge" else []
    return sorted(names(request_class(kind, {}))) + fields + ["id", "priority", "kind"]


@st.composite
def job_specs(draw):
    kind = draw(st.sampled_from(KINDS))
    keys = st.sampled_from(_spellings(kind)) | st.text(max_size=10)
    spec = draw(st.dictionaries(keys, json_values, max_size=6))
    spec["kind"] = kind
    return spec


def _validated_or_refused(spec) -> None:
    try:
        validate(spec, check_model=False)
    except Refusal as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(job_specs())
def test_any_job_spec_of_a_known_kind_is_validated_or_refused(spec):
    _validated_or_refused(spec)


@FUZZ
@given(
    json_values
    | st.dictionaries(
        st.sampled_from(["kind", "id", "priority"]) | st.text(max_size=6),
        json_values | st.sampled_from(KINDS),
        max_size=4,
    )
)
def test_any_json_value_as_a_job_spec_is_validated_or_refused(spec):
    _validated_or_refused(spec)


# Mistral's params.json is put in the Transformers shape before from_hf reads it: fuzzed the same
# way
TINY_PARAMS = {
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 16,
    "hidden_dim": 128,
    "norm_eps": 1e-5,
    "vocab_size": 1000,
    "rope_theta": 10000.0,
    "sliding_window": [8, None],
}
PARAMS_KEYS = sorted(
    set(TINY_PARAMS)
    | {
        "moe",
        "multimodal",
        "yarn",
        "model_type",
        "vision_encoder",
        "llama_4_scaling",
        "max_seq_len",
        "tied_embeddings",
        "activation",
    }
)


@FUZZ
@given(
    st.sampled_from(PARAMS_KEYS), json_values | st.integers(min_value=-(10**12), max_value=10**12)
)
def test_one_params_json_key_replaced_by_any_json_value(key, value):
    from ster_dist.config.params import from_params

    try:
        from_params({**TINY_PARAMS, key: value})
    except Refusal as exc:
        assert "\n" not in str(exc)

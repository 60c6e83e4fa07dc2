"""Job specs and results (ster_dist.protocol): validation against each command's own flags and the
rules a queued job needs, msgpack, JSON and YAML. Every malformed spec of the corpus is refused
with one line naming its field, and a scheduler given it starts nothing and journals nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import pytest

from ster_dist import protocol
from ster_dist.errors import Refusal
from ster_dist.load.toy import make_toy_model

EXAMPLES = Path(__file__).resolve().parents[2] / "jobs" / "examples"


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    directory = tmp_path_factory.mktemp("toy") / "model"
    make_toy_model(directory, layers=2, hidden=64, seed=0)
    return directory


@pytest.fixture(scope="module")
def config_only(toy, tmp_path_factory):
    """The toy's config and tokenizer without its weights: a layer check must not need them."""
    directory = tmp_path_factory.mktemp("config_only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (toy / name).exists():
            shutil.copy(toy / name, directory / name)
    # present for the resolver, unreadable as weights
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def gen(**fields) -> dict:
    return {"kind": "generate", "model": "some/model", "prompt": "hello", **fields}


# (spec, the field the one-line refusal must name, a kind it needs registered or None)
CORPUS = [
    ({"kind": 5}, "'kind'", None),
    ({"kind": "fly", "model": "m"}, "'fly'", None),
    ({"model": "m", "prompt": "x"}, "'kind'", None),
    (gen(max_new_tokens="ten"), "'max_new_tokens'", None),
    (gen(max_new_tokens=-5), "'max_new_tokens'", None),
    (gen(max_new_tokens=3.5), "'max_new_tokens'", None),
    (gen(temperature=0.7), "'seed'", None),
    ({"kind": "generate", "prompt": "x"}, "'model'", None),
    (gen(max_tokens=8), "'max_tokens'", None),
    (gen(prompt=42), "'prompt'", None),
    (gen(precision="f64"), "'precision'", None),
    (gen(tp=0), "'tp'", None),
    (gen(tp=True), "'tp'", None),
    (gen(top_p=1.5), "'top_p'", None),
    (gen(priority="high"), "'priority'", None),
    (gen(id="bad id!"), "'id'", None),
    (gen(prompts="p.json", output="o.json"), "'prompt'", None),
    ({"kind": "generate", "model": "m", "prompts": "p.json"}, "'output'", None),
    (gen(address="127.0.0.1:6379"), "'address'", None),
    (gen(seed=-1, temperature=0.5), "'seed'", None),
    (gen(chat_template="maybe"), "'chat_template'", None),
    (gen(temperature="hot"), "'temperature'", None),
    (gen(model=""), "'model'", None),
    (gen(max_new_tokens=4, **{"max-new-tokens": 5}), "'max_new_tokens'", None),
    ({"kind": "parity", "model": "m", "json": 1}, "'json'", None),
    ({"kind": "parity", "model": "m", "tokens": -3}, "'tokens'", None),
    (["generate"], "mapping", None),
    (
        {
            "kind": "extract",
            "model": "TOY",
            "input": "p.json",
            "output": "h.safetensors",
            "layers": "7",
        },
        "'layers'",
        "extract",
    ),
    (
        {
            "kind": "extract",
            "model": "TOY",
            "input": "p.json",
            "output": "h.safetensors",
            "layers": "a..b",
        },
        "'layers'",
        "extract",
    ),
    ({"kind": "steer-train", "model": "m", "output": "v.json"}, "'pairs'", "steer-train"),
    ({"kind": "decide", "model": "m", "request": "-"}, "'request'", "decide"),
    (
        {
            "kind": "steer-evaluate",
            "model": "m",
            "pairs": "p.json",
            "vector": "v.json",
            "strengths": [True],
        },
        "'strengths'",
        "steer-evaluate",
    ),
    ({"kind": "merge", "merges": [{"model": "m", "adapter": "a"}]}, "'output'", "merge"),
    (
        {"kind": "merge", "merges": [{"model": "m", "adapter": "a", "output": "o"}] * 2},
        "'merges'",
        "merge",
    ),
    ({"kind": "merge", "merges": [], "address": "x"}, "'address'", "merge"),
]


@pytest.mark.parametrize("spec,field,needs", CORPUS, ids=[str(i) for i in range(len(CORPUS))])
def test_each_malformed_spec_is_refused_in_one_line_naming_its_field(
    spec, field, needs, config_only
):
    if needs is not None and needs not in protocol.available_kinds():
        pytest.skip(f"`ster {needs}` is not registered in this build")
    if isinstance(spec, dict) and spec.get("model") == "TOY":
        spec = {**spec, "model": str(config_only)}
    with pytest.raises(Refusal) as refused:
        protocol.validate(spec)
    message = str(refused.value)
    assert "\n" not in message and field in message, message


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 20


def test_a_scheduler_given_malformed_specs_starts_and_journals_nothing(tmp_path, config_only):
    from ster_dist.jobqueue.journal import read
    from ster_dist.jobqueue.queue import JobQueue

    with JobQueue(tmp_path / "state") as scheduler:
        for spec, _, needs in CORPUS:
            if needs is not None and needs not in protocol.available_kinds():
                continue
            if isinstance(spec, dict) and spec.get("model") == "TOY":
                spec = {**spec, "model": str(config_only)}
            with pytest.raises(Refusal):
                scheduler.submit(spec)
            with pytest.raises(Refusal):  # as msgpack, as it arrives at the actor
                scheduler.submit(msgpack.packb(spec))
        # one bad spec among good ones: none of them is accepted
        with pytest.raises(Refusal, match="'max_new_tokens'"):
            scheduler.submit_many([gen(), gen(max_new_tokens=-1)])
        stats = scheduler.stats()
    assert stats["group_starts"] == 0 and stats["jobs"] == {} and stats["queued"] == 0
    assert read(tmp_path / "state").entries == {}


def test_a_valid_spec_becomes_its_typed_request():
    from ster_dist.schema import GenerateRequest

    job = protocol.validate(
        {
            "kind": "generate",
            "model": "m",
            "prompt": "hi",
            "max-new-tokens": 7,
            "--temperature": 0.5,
            "seed": 3,
            "priority": 2,
            "id": "job-1",
        }
    )
    assert (job.id, job.kind, job.priority) == ("job-1", "generate", 2)
    request = job.request
    assert isinstance(request, GenerateRequest)
    assert (
        request.max_new_tokens,
        request.temperature,
        request.seed,
        request.top_p,
        request.tp,
    ) == (7, 0.5, 3, 1.0, 1)
    assert job.fields == {
        "model": "m",
        "prompt": "hi",
        "max_new_tokens": 7,
        "temperature": 0.5,
        "seed": 3,
    }
    assert protocol.validate(job.to_dict()).request == request


def test_a_list_field_takes_a_list_or_its_comma_text(toy):
    base = {"kind": "steer-evaluate", "model": "m", "pairs": "p.json", "vector": "v.json"}
    assert (
        protocol.validate({**base, "strengths": [-1, 0.5]}).request.strengths
        == protocol.validate({**base, "strengths": "-1,0.5"}).request.strengths
        == [-1.0, 0.5]
    )
    extract = {"kind": "extract", "model": str(toy), "input": "p.json", "output": "h.safetensors"}
    assert protocol.validate({**extract, "layers": [0, 1]}).request.layers == "0,1"
    assert protocol.validate({**extract, "layers": 1}).request.layers == "1"


def test_a_parsed_command_line_is_the_same_request_as_its_spec():
    from ster_dist.cli import parse

    request = parse(
        [
            "generate",
            "--model",
            "m",
            "--prompt",
            "hi",
            "--temperature",
            "0.5",
            "--max-new-tokens",
            "3",
        ]
    )
    assert request.given() == {
        "model": "m",
        "prompt": "hi",
        "temperature": 0.5,
        "max_new_tokens": 3,
    }
    # a queued job that samples states its seed
    spec = {"kind": "generate", **request.given(), "seed": 0}
    assert protocol.validate(spec).request.model_dump() == request.model_dump()
    with pytest.raises(Refusal, match="'seed'"):
        protocol.validate({"kind": "generate", **request.given()})
    with pytest.raises(Refusal, match="^--top-p must lie in"):  # the flag's words on a command line
        parse(["generate", "--model", "m", "--prompt", "hi", "--top-p", "2"])
    # the field's in a spec
    with pytest.raises(Refusal, match="^job spec field 'top_p' must lie in"):
        protocol.validate(gen(top_p=2.0))


def test_specs_and_results_travel_as_msgpack():
    spec = {"kind": "generate", "model": "m", "prompt": "hi", "id": "a"}
    assert protocol.validate(protocol.pack(spec)).fields == {"model": "m", "prompt": "hi"}
    with pytest.raises(Refusal, match="not valid msgpack"):
        protocol.validate(b"\xc1\x00garbage")
    record = protocol.make_result(
        protocol.validate(spec), "done", {"text": "x", "path": Path("/tmp/x")}
    )
    assert protocol.check_result(protocol.unpack(protocol.pack(record))) == {
        **record,
        "result": {"text": "x", "path": "/tmp/x"},
    }
    for bad, name in (
        ({**record, "status": "maybe"}, "status"),
        ({**record, "attempts": "1"}, "attempts"),
        ({**record, "status": "failed", "error": None}, "error"),
    ):
        with pytest.raises(Refusal, match=name):
            protocol.check_result(bad)


def test_a_layer_the_model_lacks_is_refused_from_its_config_alone(config_only):
    if "extract" not in protocol.available_kinds():
        pytest.skip("`ster extract` is not registered in this build")
    base = {
        "kind": "extract",
        "model": str(config_only),
        "input": "p.json",
        "output": "h.safetensors",
    }
    protocol.validate({**base, "layers": "0..2"})  # the weights file is empty: no weight was read
    with pytest.raises(Refusal, match=r"'layers'.*layer 2 is outside"):
        protocol.validate({**base, "layers": "1,2"})


def test_spec_files_in_json_and_yaml(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(gen()))
    (tmp_path / "many.yaml").write_text(
        "jobs:\n  - {kind: generate, model: m, prompt: a}\n  - kind: parity\n    model: m\n"
    )
    (tmp_path / "list.yml").write_text("- {kind: generate, model: m, prompt: b}\n")
    (tmp_path / "bad.yaml").write_text("kind: [generate\n")
    (tmp_path / "python.yaml").write_text("!!python/object/apply:os.system ['true']\n")
    assert [s["prompt"] for s in protocol.load_spec_file(str(tmp_path / "one.json"))] == ["hello"]
    assert [s["kind"] for s in protocol.load_spec_file(str(tmp_path / "many.yaml"))] == [
        "generate",
        "parity",
    ]
    assert protocol.load_spec_file(str(tmp_path / "list.yml"))[0]["prompt"] == "b"
    with pytest.raises(Refusal, match="not YAML"):
        protocol.load_spec_file(str(tmp_path / "bad.yaml"))
    with pytest.raises(Refusal, match="not YAML"):  # the safe loader: no object is ever constructed
        protocol.load_spec_file(str(tmp_path / "python.yaml"))
    with pytest.raises(Refusal, match="missing.json"):
        protocol.load_spec_file(str(tmp_path / "missing.json"))


def test_every_example_spec_validates_for_the_kinds_this_build_has():
    files = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".json", ".yaml"))
    kinds = set()
    for path in files:
        for spec in protocol.load_spec_file(str(path)):
            kinds.add(spec["kind"])
            protocol.validate(spec)
    assert kinds >= {
        "generate",
        "extract",
        "steer-train",
        "steer-evaluate",
        "decide",
        "merge",
        "parity",
    }


def test_spec_files_are_bounded(tmp_path):
    """A YAML alias bomb, a deeply nested spec and an oversized file end in one-line refusals,
    fast."""
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [
        f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}]"
        for i in range(1, 10)
    ]
    bomb.write_text("\n".join(lines) + "\nkind: generate\nmodel: m\nprompt: *a9\n")
    with pytest.raises(Refusal, match="YAML alias at line 2"):
        protocol.load_spec_file(str(bomb))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(Refusal, match="nests too deeply"):
        protocol.load_spec_file(str(deep))
    big = tmp_path / "big.json"
    with open(big, "wb") as handle:
        handle.truncate(protocol.MAX_SPEC_FILE_BYTES + 1)
    with pytest.raises(Refusal, match="more than the 16 MiB"):
        protocol.load_spec_file(str(big))

"""/v1/completions for lm-evaluation-harness (serve/echo.py, issue 60): `echo` with `logprobs`
returns the prompt's token log-probabilities (the first null), `max_tokens: 0` scores the prompt
alone, prompts come batched, as text or token ids; each log-probability is checked against
Transformers' on the same toy checkpoint."""

from __future__ import annotations

import functools
import json
import time

import httpx
import pytest
import torch

from tests.cli_run import make_toy
from tests.serve_process import ServeProcess


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy(tmp_path_factory)


@pytest.fixture(scope="module")
def server(toy):
    proc = ServeProcess("--model", toy)
    yield proc
    assert proc.stop() == 0, "".join(proc.stderr)[-2000:]


@functools.cache
def _transformers(toy: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()


def reference(toy: str, ids: list[int], top: int) -> tuple[list[float], list[dict[int, float]]]:
    """Transformers' log-probability of each token after the first, and the `top` likeliest
    there."""
    model = _transformers(toy)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
    values, indices = logprobs.topk(top, dim=-1)
    return chosen, [dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]


def test_echo_logprobs_are_the_prompts_own_as_transformers_scores_them(server, toy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy)
    texts = ["the sea is calm tonight", "a storm"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    url = f"{server.url}/v1/completions"
    for prompt, max_tokens in ((texts, 0), (ids, 1)):
        reply = httpx.post(
            url,
            timeout=120,
            json={
                "model": toy,
                "prompt": prompt,
                "echo": True,
                "logprobs": 2,
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        assert reply.status_code == 200, reply.text
        choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == 2
        for choice, text, row in zip(choices, texts, ids):
            logprobs = choice["logprobs"]
            assert choice["text"].startswith(text) and (max_tokens or choice["text"] == text)
            assert len(logprobs["tokens"]) == len(row) + max_tokens
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            want, want_top = reference(toy, row, 2)
            got = logprobs["token_logprobs"][1 : len(row)]
            assert got == pytest.approx(want, abs=1e-4)
            for top, expected in zip(logprobs["top_logprobs"][1 : len(row)], want_top):
                assert sorted(top.values()) == pytest.approx(sorted(expected.values()), abs=1e-4)
            assert logprobs["text_offset"][0] == 0 and "".join(
                logprobs["tokens"][: len(row)]
            ).endswith(text[-3:])


def test_echo_without_logprobs_and_what_it_refuses(server, toy):
    url = f"{server.url}/v1/completions"
    reply = httpx.post(
        url, timeout=60, json={"model": toy, "prompt": "hello", "echo": True, "max_tokens": 0}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hello"
    assert reply.json()["choices"][0]["logprobs"] is None
    refused = httpx.post(
        url, timeout=60, json={"model": toy, "prompt": "hello", "echo": True, "stream": True}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_tokenize_and_detokenize_as_transformers_does(server, toy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy)
    text = "the sea is calm tonight"
    reply = httpx.post(f"{server.url}/tokenize", timeout=60, json={"model": toy, "prompt": text})
    want = tokenizer(text)["input_ids"]
    assert (
        reply.status_code == 200
        and reply.json()["tokens"] == want
        and reply.json()["count"] == len(want)
    )
    assert reply.json()["max_model_len"] == 512
    bare = httpx.post(
        f"{server.url}/tokenize", timeout=60, json={"prompt": text, "add_special_tokens": False}
    )
    assert bare.json()["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    back = httpx.post(f"{server.url}/detokenize", timeout=60, json={"model": toy, "tokens": want})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(want)
    wrong = httpx.post(f"{server.url}/detokenize", timeout=60, json={"tokens": [10**9]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tokens"
    other = httpx.post(f"{server.url}/tokenize", timeout=60, json={"model": "gpt2", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


QUESTIONS = [
    {"question": "The sea is", "choices": [" calm", " loud", " green"], "answer": 0},
    {"question": "A storm comes", "choices": [" soon", " never"], "answer": 1},
    {"question": "hello there", "choices": [" friend", " world", " sea", " you"], "answer": 2},
]


def lm_eval_task(root) -> str:
    """A multiple-choice task and a generate_until task over a local JSON dataset, as lm-eval's
    YAML."""
    data = root / "questions.json"
    data.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "doc_to_text: '{{question}}'\n"
    )
    (root / "toy_mc.yaml").write_text(
        f"task: toy_mc\n{common}output_type: multiple_choice\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "toy_gen.yaml").write_text(
        f"task: toy_gen\n{common}output_type: generate_until\n"
        "doc_to_target: '{{choices[answer]}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    return str(root)


@pytest.mark.slow  # about a minute: lm-eval runs the two tasks twice, once through the server
def test_lm_eval_through_the_server_scores_as_its_hf_model(server, toy, tmp_path, monkeypatch):
    """lm-evaluation-harness's `local-completions` model against the server, and its `hf` model on
    the same checkpoint: the same per-sample loglikelihoods, and the same generations."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = TaskManager(include_path=lm_eval_task(tmp_path))
    samples = {}
    for name, args in (
        (
            "server",
            f"model={toy},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={toy},num_concurrent=1,max_retries=1,tokenized_requests=True",
        ),
        ("hf", f"pretrained={toy},dtype=float32,device=cpu"),
    ):
        started = time.monotonic()
        results = lm_eval.simple_evaluate(
            model="local-completions" if name == "server" else "hf",
            model_args=args,
            tasks=["toy_mc", "toy_gen"],
            task_manager=tasks,
            log_samples=True,
            batch_size=1,
        )
        samples[name] = {
            task: sorted(rows, key=lambda r: r["doc_id"])
            for task, rows in results["samples"].items()
        }
        print(f"lm-eval {name}: {time.monotonic() - started:.1f} s")
    server_mc, hf_mc = samples["server"]["toy_mc"], samples["hf"]["toy_mc"]
    assert len(server_mc) == len(hf_mc) == len(QUESTIONS)
    for ours, theirs in zip(server_mc, hf_mc):
        ours_ll = [resp[0][0] for resp in ours["resps"]]
        theirs_ll = [resp[0][0] for resp in theirs["resps"]]
        assert len(ours_ll) == len(theirs_ll) and all(ll < 0 for ll in ours_ll)
        assert ours_ll == pytest.approx(theirs_ll, abs=1e-3)
    generated = [[row["resps"] for row in samples[name]["toy_gen"]] for name in ("server", "hf")]
    assert generated[0] == generated[1] and any(resp[0] for resp in generated[0]), generated

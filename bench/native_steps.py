"""Native decode steps (model/native_stack.py) against the compiled graph they replace, in one
process, on random checkpoints shaped as small real ones of the families they newly take:

    python bench/native_steps.py                       # every shape, f32 and bf16, batch 1 and 4
    python bench/native_steps.py --shapes gemma3 --dtypes bf16 --rounds 4
    python bench/native_steps.py --shapes mistral --batches 4 --ragged   # rows of 32, 27, 22, 17
    tokens

- gemma3: Gemma 3 270M's layers (hidden 640, 18 layers, 4 query heads of 256 over 1 key head,
  feed-forward 2048, a window of 512 on five layers of six, each kind of layer its own rotation,
  norms over offsets before and after each sublayer, query and key heads normed, GELU(tanh)), its
  vocabulary cut to 32000 so that its 262144-row head does not hide the layers;
- mistral: a Mistral-shaped 16-layer model (hidden 1024, 16 heads of 64 over 4 key heads,
  feed-forward 2816) with a sliding window of 64, shorter than the context the steps reach, so every
  step reads a window;
- gemma2: a Gemma-2-shaped 12-layer model (hidden 768, 8 heads of 128 over 4 key heads, feed-forward
  3072), its attention logits soft-capped at 50 and every other layer windowed to 64, Gemma 2's
  sandwich norms and GELU;
- olmo2: an OLMo-2-shaped 12-layer model (hidden 1024, 16 heads of 64, feed-forward 2816): norms
  only after the sublayers, queries and keys normed over each whole projection.

The model is loaded once, its weights packed and its layers compiled as the token engine does. Each
round runs the same greedy decode (a prompt of 32 tokens, then --steps steps) twice, once with
native steps on and once with them off (the one-token graph at batch 1, the graph of several rows at
batch 4), alternating; a step's time is the fastest of each run's median, over the rounds. With
--ragged, row i of a batch keeps the last 32
- 5i tokens of
its prompt, left-padded to one width as generate() pads a ragged batch (before, such steps never
went native). The tokens of the two ways are compared: in f32 they are the
same bits, so the same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (thread setting, tokenizer)
from decode import SterEngine  # noqa: E402

SHAPES = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            vocab_size=32000,
            sliding_window=512,
            query_pre_attn_scalar=256,
            rope_local_base_freq=10000.0,
            max_position_embeddings=4096,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=2816,
            vocab_size=32000,
            sliding_window=64,
            max_position_embeddings=4096,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=32000,
            sliding_window=64,
            query_pre_attn_scalar=128,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=4096,
        ),
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        dict(
            hidden_size=1024,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=2816,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    ),
}


def build(spec: tuple[str, str, dict], directory: Path, tied: bool = False) -> None:
    """A random checkpoint of `spec` (Transformers' config and model class names, the config's
    sizes)."""
    import transformers

    config_name, model_name, sizes = spec
    config = getattr(transformers, config_name)(
        **sizes, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=tied
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory, safe_serialization=True)
    common.write_wordlevel_tokenizer(directory, sizes["vocab_size"])


@torch.inference_mode()
def prefill_ragged(ster: SterEngine, prompt: torch.Tensor, capacity: int):
    """SterEngine.prefill with row i cut to its last 32 - 5i tokens, left-padded as generate() pads
    them."""
    from ster_dist.model.cache import left_pad

    ids, positions, valid = left_pad([row[5 * i :].tolist() for i, row in enumerate(prompt)])
    cache = ster.model.new_cache(prompt.shape[0], capacity)
    logits = ster.model(ids, positions, valid, cache, last_only=True)[:, -1]
    return logits, (cache, positions[:, -1:] + 1)


def decode_once(ster: SterEngine, prompt: torch.Tensor, steps: int, ragged: bool = False):
    """Each step's seconds and the tokens picked."""
    prefill = (lambda *args: prefill_ragged(ster, *args)) if ragged else ster.prefill
    logits, state = prefill(prompt, prompt.shape[1] + steps + 1)
    token = ster.pick(logits)
    seconds, tokens = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits, state = ster.step(token, state)
        token = ster.pick(logits)
        seconds.append(time.perf_counter() - start)
        tokens.append(token.tolist())
    return seconds, tokens


def alternating(
    ster: SterEngine,
    prompt: torch.Tensor,
    steps: int,
    rounds: int,
    ways: dict,
    ragged: bool = False,
):
    """Each way's step seconds (the fastest of its runs' medians) and tokens: `ways` maps a name to
    what switches the model to it; the ways run in turn, rounds + 1 times, the first turn warming
    (and compiling) each."""
    times: dict[str, list[float]] = {way: [] for way in ways}
    tokens = {}
    for way in list(ways) * (rounds + 1):
        ways[way]()
        seconds, tokens[way] = decode_once(ster, prompt, steps, ragged)
        times[way].append(statistics.median(seconds))
    return {way: min(seen[1:]) for way, seen in times.items()}, tokens


def measure(
    shape: str,
    directory: Path,
    dtype: str,
    batches: list[int],
    steps: int,
    rounds: int,
    ragged: bool = False,
) -> list[dict]:
    from ster_dist.engine.runner import pack_model

    ster = SterEngine(common.load_ster(directory, dtype))
    pack_model(ster.model, "on")
    os.environ.pop("STER_ENFORCE_EAGER", None)
    assert ster.model.compile_layers() is None
    compiled = ster.model.compiled
    native = compiled.native
    if native is None:
        raise SystemExit(f"{shape} {dtype}: no native steps ({compiled.native_why_not})")
    rows = []
    for batch in batches:
        prompt = torch.randint(
            3, 32000, (batch, 32), generator=torch.Generator().manual_seed(batch)
        )
        fastest, tokens = alternating(
            ster,
            prompt,
            steps,
            rounds,
            {
                "native": lambda: setattr(compiled, "native", native),
                "graph": lambda: setattr(compiled, "native", None),
            },
            ragged,
        )
        compiled.native = native
        native_s, graph_s = fastest["native"], fastest["graph"]
        rows.append(
            {
                "shape": shape + (" ragged" if ragged else ""),
                "dtype": dtype,
                "batch": batch,
                "native_ms": 1e3 * native_s,
                "graph_ms": 1e3 * graph_s,
                "graph_over_native": graph_s / native_s,
                "same_tokens": tokens["native"] == tokens["graph"],
            }
        )
    return rows


def step_arguments(doc: str, shapes: dict, steps: int) -> argparse.ArgumentParser:
    """The options of a script that times decode steps of random checkpoints shaped as `shapes`
    says."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def main(argv=None) -> int:
    parser = step_arguments(__doc__, SHAPES, steps=48)
    parser.add_argument(
        "--ragged", action="store_true", help="rows of 32, 27, 22 ... tokens, left-padded"
    )
    args = parser.parse_args(argv)
    if args.ragged and max(args.batches) > 6:
        parser.error("--ragged cuts 5 tokens a row from 32: at most 6 rows")
    common.set_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for shape in args.shapes:
            directory = Path(root) / shape
            build(SHAPES[shape], directory)
            for dtype in args.dtypes:
                rows += measure(
                    shape, directory, dtype, args.batches, args.steps, args.rounds, args.ragged
                )
                print(f"{shape} {dtype}: done", file=sys.stderr)
    print(
        f"\nnative decode steps against the compiled graph, {args.threads} threads, median step of "
        f"{args.steps}, fastest of {args.rounds} rounds"
    )
    print(
        f"{'shape':15} {'dtype':5} {'batch':>5} {'native ms':>10} {'graph ms':>10} {'graph/native':>13} same tokens"
    )
    for row in rows:
        print(
            f"{row['shape']:15} {row['dtype']:5} {row['batch']:>5} {row['native_ms']:>10.2f} {row['graph_ms']:>10.2f}"
            f" {row['graph_over_native']:>12.2f}x {row['same_tokens']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

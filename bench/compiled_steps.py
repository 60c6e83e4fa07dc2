"""Compiled decode steps (model/compiled.py) against eager ones, in one process, for models whose
steps compile but do not run natively (model/native_stack.py), on random checkpoints shaped as small
real ones:

    python bench/compiled_steps.py                           # f32 and bf16, batch 1 and 4
    python bench/compiled_steps.py --dtypes bf16 --rounds 4

- gemma4_e: Gemma 4's E models' layers, narrowed (hidden 768, 12 layers, 4 query heads of 128 over 1
  key head, full layers' heads of 256, feed-forward 3072, a window of 512 on five layers of six),
  each layer's own input 128 wide added through its gate, the last 4 layers reading earlier layers'
  keys and values, a 32000-token vocabulary. Before 2026-12-07 such a model never compiled (its
  per-layer inputs and shared keys kept it eager).
- gemma3n_e: Gemma 3n's E models' layers, narrowed as gemma4_e is (a window on four layers of five,
  the last 4 layers shared), with four AltUp copies of the stream, Laurel's rank-64 side path and
  the first four layers' feed-forwards gated sparse; it compiles since the same day.

The model is loaded once and its weights packed as the token engine packs them; each round runs the
same greedy decode (a prompt of 32 tokens, then --steps steps) with the compiled layers and with the
eager ones, alternating; a step's time is the fastest of each way's medians over the rounds. The
tokens of the two ways are compared.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (thread setting, tokenizer)
from decode import SterEngine  # noqa: E402
from native_steps import alternating, build, step_arguments  # noqa: E402

_SLIDING, _FULL = "sliding_attention", "full_attention"
SHAPES = {
    "gemma4_e": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            global_head_dim=256,
            num_global_key_value_heads=1,
            intermediate_size=3072,
            vocab_size=32000,
            hidden_size_per_layer_input=128,
            vocab_size_per_layer_input=32000,
            num_kv_shared_layers=4,
            sliding_window=512,
            layer_types=([_SLIDING] * 5 + [_FULL]) * 2,
            final_logit_softcapping=30.0,
            enable_moe_block=False,
            max_position_embeddings=4096,
            rope_parameters={
                _SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                _FULL: {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                },
            },
        ),
    ),
    "gemma3n_e": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=32000,
            hidden_size_per_layer_input=128,
            vocab_size_per_layer_input=32000,
            num_kv_shared_layers=4,
            sliding_window=512,
            layer_types=([_SLIDING] * 4 + [_FULL]) * 2 + [_SLIDING, _FULL],
            activation_sparsity_pattern=[0.95] * 4 + [0.0] * 8,
            altup_num_inputs=4,
            laurel_rank=64,
            final_logit_softcapping=30.0,
            max_position_embeddings=4096,
        ),
    ),
}


def measure(
    shape: str, directory: Path, dtype: str, batches: list[int], steps: int, rounds: int
) -> list[dict]:
    from ster_dist.engine.runner import pack_model

    ster = SterEngine(common.load_ster(directory, dtype))
    pack_model(ster.model, "on")
    os.environ.pop("STER_ENFORCE_EAGER", None)
    if (why := ster.model.compile_layers()) is not None:
        raise SystemExit(f"{shape} {dtype}: its steps stay eager ({why})")
    compiled = ster.model.compiled
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
                "compiled": lambda: setattr(ster.model, "compiled", compiled),
                "eager": lambda: setattr(ster.model, "compiled", None),
            },
        )
        ster.model.compiled = compiled
        compiled_s, eager_s = fastest["compiled"], fastest["eager"]
        rows.append(
            {
                "shape": shape,
                "dtype": dtype,
                "batch": batch,
                "compiled_ms": 1e3 * compiled_s,
                "eager_ms": 1e3 * eager_s,
                "eager_over_compiled": eager_s / compiled_s,
                "same_tokens": tokens["compiled"] == tokens["eager"],
            }
        )
    return rows


def main(argv=None) -> int:
    args = step_arguments(__doc__, SHAPES, steps=32).parse_args(argv)
    common.set_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="compiled-steps-") as tmp:
        for shape in args.shapes:
            directory = Path(tmp) / shape
            build(SHAPES[shape], directory, tied=True)
            for dtype in args.dtypes:
                rows += measure(shape, directory, dtype, args.batches, args.steps, args.rounds)
    print(
        f"{'shape':<10} {'dtype':<5} {'batch':>5} {'compiled ms':>12} {'eager ms':>9} {'eager/compiled':>15} same tokens"
    )
    for r in rows:
        print(
            f"{r['shape']:<10} {r['dtype']:<5} {r['batch']:>5} {r['compiled_ms']:>12.2f} {r['eager_ms']:>9.2f} "
            f"{r['eager_over_compiled']:>15.2f} {r['same_tokens']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""merge: fold a LoRA adapter into a base checkpoint and write an ordinary checkpoint directory.

    ster merge --model M --adapter A --output DIR [--revision R] [--max-shard-size 5GB]

The merge streams the base tensor by tensor (ster_dist/adapters/merge.py); batches of merges
fan out over a Ray cluster through jobs/merge.py.
"""

from __future__ import annotations

from ster_dist.commands.common import model_args, progress


def cmd_merge(args) -> dict:
    from ster_dist.adapters.merge import merge

    progress(f"merging {args.adapter} into {args.model}")
    return merge(args.model, args.adapter, args.output, args.revision, args.max_shard_size, progress)


def register(sub) -> None:
    p = sub.add_parser("merge", help="merge a LoRA adapter (PEFT or Ster format) into a base checkpoint")
    model_args(p)
    p.add_argument("--adapter", required=True, help="a PEFT adapter directory or a Ster adapter .safetensors")
    p.add_argument("--output", required=True, help="the merged checkpoint directory (must not exist)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard, like 5GB or 500MB (default 5GB)")
    p.set_defaults(run=cmd_merge)

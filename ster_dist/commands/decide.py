"""`ster decide`: typed questions answered from the next-token distribution over option letters
(Ster's decisions page: request, response and refusals). The request is checked whole before any
weight is read."""

from __future__ import annotations

from pathlib import Path

from ster_dist.commands.common import model_args, progress, runtime_args, session, write_json_atomic
from ster_dist.commands.steer import adapted, adapter_arg
from ster_dist.errors import Refusal


def cmd_decide(args) -> dict:
    from ster_dist.decide.request import load_request
    from ster_dist.decide.run import decide
    from ster_dist.steer.text import chat_status

    permutations = getattr(args, "permutations", 0)
    if permutations is None or permutations < 0:
        raise Refusal(f"--permutations must be 0 (every order) or more, got {permutations}")
    output = getattr(args, "output", None)
    if output is not None and Path(output).is_dir():
        raise Refusal(f"--output {output} is a directory; name the JSON file to write")
    request = load_request(args.request)
    mode = getattr(args, "chat_template", "auto")
    with session(args) as run, adapted(run, args):
        chat = chat_status(run.tokenizer, mode)
        result = decide(run.group, run.tokenizer, run.cfg, request, permutations, mode,
                        bool(getattr(args, "explain", False)), run.tokenizer.pad_token_id or 0, progress)
        revision = run.checkpoint.model_revision
    response = {"model": args.model, "revision": revision, "chat_template": chat, "precision": args.precision,
                "temperature": 1.0, "calibration": None, "permutations": permutations, **result}
    if output is not None:
        write_json_atomic(Path(output), response)
    return response


def register(sub) -> None:
    p = sub.add_parser("decide", help="answer typed questions about a state from option-letter probabilities")
    model_args(p)
    runtime_args(p)
    p.add_argument("--request", required=True, help="the request JSON file, or - for standard input")
    p.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--permutations", type=int, default=0,
                   help="option orders per question: 0 shows every option under every letter; 1 is one pass")
    p.add_argument("--explain", action="store_true", help="add each order's letters and probabilities")
    p.add_argument("--output", default=None, help="also write the response to this file")
    adapter_arg(p)
    p.set_defaults(run=cmd_decide)

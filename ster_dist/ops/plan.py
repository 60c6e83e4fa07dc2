"""ster plan: how a model would sit on tp x ep x pp ranks over nodes, from its config.json and its
weights' headers alone (a local directory's .safetensors headers or its one .gguf's, whose tensors
count at their block types' bytes as stored, or a Hub repository's safetensors headers read by range
requests): each rank's parameter and read bytes from the real shard plan (shard/footprint.py), its
KV cache per token, how many tokens of KV fit beside its weights, where each rank runs, and a
one-line verdict. A directory holding a config.json and no weights is planned from the config alone:
each rank's meta-device decoder gives its parameters and KV cache, and the report says it is an
estimate.

A plan that does not fit is still an answer (exit status 0); only inputs that cannot be planned
(a placement that breaks a TP group across nodes, more ranks than GPUs, a config or checkpoint
that is not a model) are refused.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ster_dist.config import ModelConfig, from_hf
from ster_dist.config.file import load_raw_config
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.gguf.source import GGUFSource
from ster_dist.load import PRECISIONS, check_expert_parallel, check_weights
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.pipeline import check_pipeline
from ster_dist.resolve import local_names, local_weights
from ster_dist.schema.plan import PlanRequest
from ster_dist.shard.footprint import (
    RankFootprint,
    Tensor,
    estimated_footprint,
    rank_footprint,
    sort_tensors,
)
from ster_dist.shard.safetensors_header import DTYPES, entries

GIB = 1 << 30
# held back on every GPU before the KV cache is sized: the CUDA context, NCCL's buffers and one
# step's activations (a 256-token prefill chunk beside the decodes); stated in every plan
ACTIVATION_RESERVE = 4 * GIB
# how a quantization's weights are stored, as the verdict names it
# the layer kinds that keep nothing per sequence beyond keys and values
STATELESS_MIXERS = ("attention", "latent_attention", "none")
STORED = {"fp8": "FP8", "mxfp4": "MXFP4", "compressed-tensors": "FP8"}
ESTIMATED = (
    "estimated from the config: no weight files here, so each rank's parameters and KV cache come "
    "from its meta-device decoder and its read bytes assume the config's torch_dtype"
)


def plan(request: PlanRequest) -> dict:
    placement = place(request.tp, request.ep, request.nodes, request.gpus_per_node, request.pp)
    raw, tensors, where = read_model(request.model, request.revision)
    cfg = from_hf(raw, where)
    stage = request.tp * request.ep
    ctxs = [
        ParallelCtx(
            tp_rank=r % stage % request.tp,
            tp_size=request.tp,
            ep_rank=r % stage // request.tp,
            ep_size=request.ep,
            pp_rank=r // stage,
            pp_size=request.pp,
        )
        for r in range(stage * request.pp)
    ]
    check_expert_parallel(cfg, ctxs[0])
    check_pipeline(cfg, request.pp)
    check_weights(cfg, request.weights, request.model)
    dtype = PRECISIONS[request.precision]
    if tensors is None:
        return _estimate(request, cfg, ctxs, placement, dtype)
    checkpoint = sort_tensors(cfg, tensors)
    progress(
        f"planning {len(ctxs)} rank(s) of {cfg.family} over {len(tensors)} checkpoint tensors "
        "(a meta-device decoder and the shard plan per rank)"
    )
    matchers: dict = {}  # checkpoint names matched once for the ranks with the same parameter names
    ranks = [
        rank_footprint(
            cfg, checkpoint, ctx, dtype, r, keep_fp8=request.weights == "fp8", matchers=matchers
        )
        for r, ctx in enumerate(ctxs)
    ]
    return {
        "model": request.model,
        "family": cfg.family,
        "precision": request.precision,
        "weights": request.weights,
        "tp": request.tp,
        "ep": request.ep,
        "pp": request.pp,
        "world_size": len(ranks),
        "stages": [
            {"stage": s, "layers": list(ranks[s * stage].layers)} for s in range(request.pp)
        ],
        "quantization": checkpoint.method,
        "stored_types": _stored_types(tensors),
        "quantization_config": cfg.quant.summary() if cfg.quant else None,
        "fp8_weight_block_size": list(checkpoint.block) if checkpoint.block else None,
        "file_bytes": sum(t.nbytes for t in tensors.values()),
        "mtp_tensors": len(checkpoint.mtp),
        # never read by plain decoding
        "mtp_bytes": sum(tensors[name].nbytes for name in checkpoint.mtp),
        # compressed-tensors' activation scales: never read
        "activation_scale_tensors": len(checkpoint.unread),
        "read_bytes_all_ranks": sum(r.read_bytes for r in ranks),
        **_fitting(request, cfg, ranks, placement, quantized=STORED.get(checkpoint.method)),
    }


def _fitting(
    request: PlanRequest,
    cfg: ModelConfig,
    ranks: list[RankFootprint],
    placement: list,
    quantized: str | None = None,
    note: str = "",
) -> dict:
    """What fits beside each rank's weights: its KV cache and recurrent state, the sequences, the
    verdict."""
    memory = int(request.gpu_memory * GIB)
    max_len = request.max_model_len or cfg.max_position
    sequences = min(_sequences(memory, rank, max_len) for rank in ranks)
    kv = [_kv_tokens(memory, rank, sequences) for rank in ranks]
    tokens = min(kv)  # block ids are the same on every rank: the smallest cache bounds them all
    return {
        "gpu_memory_bytes": memory,
        "activation_reserve_bytes": ACTIVATION_RESERVE,
        "kv_cache": kv_summary(cfg, ranks, request.precision),
        "max_model_len": max_len,
        "recurrent_state": state_summary(
            cfg, max(ranks, key=lambda r: r.state_bytes_per_sequence), request.precision
        ),
        "kv_tokens": tokens,
        "max_model_len_sequences": sequences,
        "ranks": [
            {**_rank_json(rank, placement[rank.rank]), "kv_tokens": n} for rank, n in zip(ranks, kv)
        ],
        "nodes": _nodes(placement),
        "verdict": verdict(
            request, cfg, ranks, tokens, max_len, memory, quantized=quantized, sequences=sequences
        )
        + note,
    }


def _estimate(
    request: PlanRequest, cfg: ModelConfig, ctxs: list[ParallelCtx], placement: list, dtype
) -> dict:
    """The plan of a directory holding a config.json and no weights: each rank's meta-device
    decoder."""
    if request.weights == "fp8":
        raise Refusal(
            f"--weights fp8 counts the FP8 weights a checkpoint's headers state, and {request.model} "
            "holds a config and no weight files; plan it with --weights dequantize, or beside its weights"
        )
    progress(
        f"planning {len(ctxs)} rank(s) of {cfg.family} from its config alone (no weight files): "
        "a meta-device decoder per rank"
    )
    ranks = [estimated_footprint(cfg, ctx, dtype, r) for r, ctx in enumerate(ctxs)]
    stage = request.tp * request.ep
    return {
        "model": request.model,
        "family": cfg.family,
        "precision": request.precision,
        "weights": request.weights,
        "estimated": ESTIMATED,
        "tp": request.tp,
        "ep": request.ep,
        "pp": request.pp,
        "world_size": len(ranks),
        "stages": [
            {"stage": s, "layers": list(ranks[s * stage].layers)} for s in range(request.pp)
        ],
        "quantization": cfg.quant.method if cfg.quant else None,
        "quantization_config": cfg.quant.summary() if cfg.quant else None,
        "read_bytes_all_ranks": sum(r.read_bytes for r in ranks),
        **_fitting(request, cfg, ranks, placement, note=" (estimated from the config)"),
    }


def _stored_types(tensors: dict[str, Tensor]) -> dict[str, int] | None:
    """A GGUF checkpoint's block types, with how many tensors each stores (Q4_1: 210, F32: 61)."""
    if not any(t.stored_bytes is not None for t in tensors.values()):
        return None
    counts: dict[str, int] = {}
    for tensor in tensors.values():
        counts[tensor.dtype] = counts.get(tensor.dtype, 0) + 1
    return dict(sorted(counts.items()))


def place(tp: int, ep: int, nodes: int, gpus_per_node: int, pp: int = 1) -> list[tuple[int, int]]:
    """(node, GPU) of every rank: whole TP groups (tp consecutive ranks) packed into nodes, since a
    TP group all-reduces in every layer and must not cross the slower link between nodes; expert
    groups and pipeline stages fill the nodes after (a stage boundary sends one hidden state per
    token)."""
    world, gpus = tp * ep * pp, nodes * gpus_per_node
    if tp > gpus_per_node:
        raise Refusal(
            f"--tp {tp} is more than --gpus-per-node {gpus_per_node}: a tensor-parallel group must sit "
            f"inside one node; use --tp {gpus_per_node} or less and split the rest with --ep"
        )
    if world > gpus:
        raise Refusal(
            f"--tp {tp} x --ep {ep} x --pp {pp} is {world} ranks, more than --nodes {nodes} x "
            f"--gpus-per-node {gpus_per_node} = {gpus} GPUs; use --nodes {-(-world // gpus_per_node)} "
            "or a smaller --ep / --pp"
        )
    per_node = gpus_per_node // tp  # TP groups one node holds
    groups = ep * pp
    if groups > nodes * per_node:
        raise Refusal(
            f"{groups} TP groups of {tp} do not fit whole in {nodes} node(s) of {gpus_per_node} GPUs "
            f"({per_node} per node); use a --tp that divides {gpus_per_node}, or --nodes "
            f"{-(-groups // per_node)}"
        )
    return [((r // tp) // per_node, ((r // tp) % per_node) * tp + r % tp) for r in range(world)]


def read_model(model: str, revision: str | None) -> tuple[dict, dict[str, Tensor], str]:
    """(config, every tensor's header entry, where the config came from): a local directory's
    config.json and *.safetensors headers, else a Hub repository's through range requests."""
    directory = Path(model)
    if not directory.is_dir():
        return _read_hub(model, revision)
    config = directory / "config.json"
    if not config.is_file():
        raise Refusal(
            f"model config is missing: {config}; ster plan reads a checkpoint's config.json"
        )
    # the files generate would load (resolve's rule: not Mistral's consolidated*, no optimizer
    # state)
    names = local_names(directory)
    files = [directory / name for name in local_weights(directory, names, "safetensors")]
    raw = load_raw_config(config)
    if not files:
        return raw, _other_weights(directory, names, raw), str(config)
    tensors: dict[str, Tensor] = {}
    for path in files:
        # the header only, checked against the file's size; no data read
        for entry in entries(path):
            if entry.name in tensors:
                raise Refusal(
                    f"tensor {entry.name} appears in two weight files (the second is {path}); "
                    "remove the duplicate shard"
                )
            tensors[entry.name] = Tensor(entry.dtype, entry.shape)
    return raw, tensors, str(config)


def _other_weights(directory: Path, names: set[str], raw: dict) -> dict[str, Tensor] | None:
    """With no .safetensors: the tensors of the directory's one .gguf as its header states them
    (under Transformers names, each checked against the config by GGUFSource), or None for a
    directory that holds a config and no weights at all (planned from the config alone)."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if len(ggufs) > 1:
        raise Refusal(
            f"model directory {directory} contains {len(ggufs)} .gguf files; exactly one is read: "
            "keep one .gguf beside the config"
        )
    if ggufs:
        # the header and a memory map: no block is read
        source = GGUFSource(directory / ggufs[0], raw)
        try:
            return {name: Tensor(*_stored(source, name)) for name in source.names()}
        finally:
            source.close()
    pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    if pickled:
        raise Refusal(
            f"model directory {directory} holds only pickled weights ({', '.join(pickled)}), which "
            "ster_dist never reads; convert them to safetensors"
        )
    return None


def _stored(source: GGUFSource, name: str) -> tuple[str, tuple[int, ...], int]:
    block_type, nbytes = source.stored(name)
    return block_type, tuple(source.shape(name)), nbytes


def _read_hub(model: str, revision: str | None) -> tuple[dict, dict[str, Tensor], str]:
    """The config and every header of a Hub repository; huggingface_hub reads each header with a
    range request, so no weight is downloaded."""
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub.utils import (
            are_progress_bars_disabled,
            disable_progress_bars,
            enable_progress_bars,
        )

        quiet = are_progress_bars_disabled()
        disable_progress_bars()  # stderr carries JSON events only
        try:
            found = HfApi(endpoint=endpoint, token=token).get_safetensors_metadata(
                model, revision=revision
            )
            config = hf_hub_download(
                model, "config.json", revision=revision, endpoint=endpoint, token=token
            )
        finally:
            if not quiet:
                enable_progress_bars()
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise Refusal(
            f"failed to read the headers of {model} from {endpoint} ({type(exc).__name__}: {first}); "
            "check the model id, HF_ENDPOINT and HF_TOKEN, or pass a local directory"
        ) from None
    tensors = {
        name: Tensor(info.dtype, tuple(info.shape))
        for file in found.files_metadata.values()
        for name, info in file.tensors.items()
    }
    odd = sorted(name for name, t in tensors.items() if t.dtype not in DTYPES)
    if odd:
        raise Refusal(
            f"tensor {odd[0]} of {model} has dtype {tensors[odd[0]].dtype}, not one of {', '.join(DTYPES)}; "
            "ster plan cannot size it"
        )
    return load_raw_config(Path(config)), tensors, f"{model}/config.json"


def _free(memory: int, rank: RankFootprint) -> int:
    return max(0, memory - rank.parameter_bytes - ACTIVATION_RESERVE)


def _sequences(memory: int, rank: RankFootprint, max_len: int) -> int:
    """Sequences of max_len tokens the rank holds at once: each takes its keys and values for every
    position and, in a model with recurrent layers, one state slot (the engine takes slots from the
    same budget as blocks)."""
    each = max_len * rank.kv_bytes_per_token + rank.state_bytes_per_sequence
    return _free(memory, rank) // each if each else 0


def _kv_tokens(memory: int, rank: RankFootprint, sequences: int) -> int:
    """Tokens of KV cache beside the weights and the state slots of `sequences` sequences."""
    free = _free(memory, rank) - sequences * rank.state_bytes_per_sequence
    return max(0, free) // rank.kv_bytes_per_token if rank.kv_bytes_per_token else 0


def _indexer_keys(cfg: ModelConfig) -> str:
    """DeepSeek Sparse Attention's layers also cache their indexer's key (model/indexer.py)."""
    kinds = cfg.raw.get("indexer_types") or ()
    full = sum(kind == "full" for kind in kinds)
    return (
        f" and, on {full} layers, the indexer's key ({cfg.raw['index_head_dim']})" if full else ""
    )


def kv_summary(cfg: ModelConfig, ranks: list[RankFootprint], precision: str) -> dict:
    """The KV cache per token: the largest rank's at the top level (what sizes a GPU), and each
    rank's where they differ (3 key-value heads over --tp 2 leave rank 0 one head and rank 1
    two)."""
    rank = max(ranks, key=lambda r: r.kv_bytes_per_token)
    sliding = [i for i, w in enumerate(cfg.layer_window) if w is not None]
    if cfg.mla is not None:
        # Dots3-Note's sliding layers keep latents of their own rank
        latents = "/".join(
            str(r) for r in sorted({cfg.mla_of(i).kv_lora_rank for i in range(cfg.num_layers)})
        )
        what = (
            f"latent attention: per layer the normed latent ({latents}) and the rotated key "
            f"({cfg.mla.qk_rope_head_dim}){_indexer_keys(cfg)}, whole on every rank (not split by --tp)"
        )
    else:
        what = "per layer this rank's key-value heads x head_dim, keys and values"
    out = {
        "bytes_per_token_per_rank": rank.kv_bytes_per_token,
        "largest_on_rank": rank.rank,
        "dtype": precision,
        "layers": cfg.num_layers,
        "holds": what,
        "sliding_window_layers": len(sliding),
    }
    if len({r.kv_bytes_per_token for r in ranks}) > 1:
        out["bytes_per_token_by_rank"] = [r.kv_bytes_per_token for r in ranks]
    if sliding:
        windows = sorted({cfg.layer_window[i] for i in sliding})
        out["sliding_window"] = (
            f"{len(sliding)} of {cfg.num_layers} layers attend through a window of "
            f"{', '.join(map(str, windows))} tokens; the paged cache still keeps their "
            "positions in every block, so they are counted in full"
        )
    return out


def state_summary(cfg: ModelConfig, rank: RankFootprint, precision: str) -> dict | None:
    """A model with recurrent layers keeps, per running sequence, a state whose size does not grow
    with its length: the conv window and the scan state of every recurrent layer, this rank's
    share."""
    if not rank.state_bytes_per_sequence:
        return None
    recurrent = [kind for kind in cfg.mixers if kind not in STATELESS_MIXERS]
    kinds = sorted(set(recurrent))
    return {
        "bytes_per_sequence_per_rank": rank.state_bytes_per_sequence,
        "dtype": precision,
        "layers": len(recurrent),
        "kinds": kinds,
        "holds": "per sequence, whatever its length: each recurrent layer's conv window and scan state "
        "(this rank's channels or heads), one slot per running sequence",
    }


def _rank_json(rank: RankFootprint, where: tuple[int, int]) -> dict:
    return {
        "rank": rank.rank,
        "tp_rank": rank.tp_rank,
        "ep_rank": rank.ep_rank,
        "pp_rank": rank.pp_rank,
        "layers": list(rank.layers),
        "node": where[0],
        "gpu": where[1],
        "parameter_bytes": rank.parameter_bytes,
        "parameter_gib": round(rank.parameter_bytes / GIB, 2),
        "read_bytes": rank.read_bytes,
        "scale_bytes": rank.scale_bytes,
        "kv_bytes_per_token": rank.kv_bytes_per_token,
        "state_bytes_per_sequence": rank.state_bytes_per_sequence,
    }


def _nodes(placement: list[tuple[int, int]]) -> list[dict]:
    out: dict[int, list[int]] = {}
    for rank, (node, _) in enumerate(placement):
        out.setdefault(node, []).append(rank)
    return [{"node": node, "ranks": ranks} for node, ranks in sorted(out.items())]


def verdict(
    request: PlanRequest,
    cfg: ModelConfig,
    ranks: list[RankFootprint],
    tokens: int,
    max_len: int,
    memory: int,
    quantized: str | None = None,
    sequences: int | None = None,
) -> str:
    worst = max(ranks, key=lambda r: r.parameter_bytes)
    need = worst.parameter_bytes / GIB
    room = (memory - ACTIVATION_RESERVE) / GIB
    if memory <= ACTIVATION_RESERVE:
        return (
            f"does not fit: --gpu-memory {request.gpu_memory:g} GiB leaves nothing beside the "
            f"{ACTIVATION_RESERVE // GIB} GiB held for activations; give the GPUs' real memory"
        )
    if worst.parameter_bytes + ACTIVATION_RESERVE > memory:
        stored = ""
        # planned dequantized to --precision, as loaded
        if quantized and request.weights == "dequantize":
            stored = (
                f" (dequantized to {request.precision}; kept in {quantized} as stored they would take about "
                f"{worst.read_bytes / GIB:.1f} GiB)"
            )
        return (
            f"does not fit: rank {worst.rank} needs {need:.1f} GiB of weights{stored}, more than --gpu-memory "
            f"{request.gpu_memory:g} GiB less the {ACTIVATION_RESERVE // GIB} GiB reserve; "
            f"try {_more_ranks(request, cfg, math.ceil(need / max(room, 1e-9)))}"
        )
    sequences = tokens // max_len if sequences is None else sequences
    state = worst.state_bytes_per_sequence
    # every layer recurrent: no keys, a state per sequence
    if sequences < 1 and not worst.kv_bytes_per_token:
        return (
            f"does not fit: beside rank {worst.rank}'s {need:.1f} GiB of weights no sequence's recurrent state "
            f"({_size(state)}) fits; try {_more_ranks(request, cfg, 2)}"
        )
    if sequences < 1:
        length = (
            f"--max-model-len {max_len}"
            if request.max_model_len
            else f"one sequence of the config's {max_len} positions"
        )
        return (
            f"does not fit: beside rank {worst.rank}'s {need:.1f} GiB of weights the KV cache holds {tokens} "
            f"tokens, fewer than {length}; give a smaller --max-model-len, or "
            f"try {_more_ranks(request, cfg, 2)}"
        )
    nodes = len(
        {
            node
            for node, _ in place(
                request.tp, request.ep, request.nodes, request.gpus_per_node, request.pp
            )
        }
    )
    held = (
        f"KV cache for {tokens} tokens"
        if worst.kv_bytes_per_token
        else "no KV cache (every layer recurrent)"
    )
    states = f", a {_size(state)} recurrent state each" if state else ""
    return (
        f"fits: {len(ranks)} rank(s) on {nodes} node(s), at most {need:.1f} GiB of weights per rank "
        f"(rank {worst.rank}), {held} ({sequences} sequence(s) of {max_len}{states})"
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _more_ranks(request: PlanRequest, cfg: ModelConfig, factor: int) -> str:
    """Where the missing room would come from: experts over more EP ranks, or a wider TP group; an
    estimate (weights shrink about as the ranks grow), which the suggested plan then states
    exactly."""
    factor = max(factor, 2)
    options = []
    if cfg.moe is not None and request.ep * factor <= cfg.moe.num_experts:
        ep = request.ep * factor
        options.append(
            f"--ep {ep} ({request.tp * ep} GPUs, --nodes {-(-request.tp * ep // request.gpus_per_node)})"
        )
    tp = request.tp * factor
    if tp <= request.gpus_per_node:
        options.append(f"--tp {tp}")
    pp = request.pp * factor
    if pp <= cfg.num_layers:
        world = request.tp * request.ep * pp
        options.append(f"--pp {pp} ({world} GPUs, --nodes {-(-world // request.gpus_per_node)})")
    if not options:
        options.append("more --ep ranks over more nodes, or GPUs with more memory")
    return " / ".join(options)

"""FP8 block-quantized checkpoints as DeepSeek-V3 and Qwen3-FP8 publish them, dequantized while
loading.

Tiny deepseek_v3 and qwen3_moe checkpoints are quantized here with the real scheme (per block: scale
= amax / 448, q = w / scale as float8_e4m3fn, beside <name>_scale_inv), in blocks that straddle the
tensor-parallel boundaries and do not divide every shape. The reference is the same bytes
dequantized here, saved as float32 and run by Transformers: logits compared at TP=1, TP=2 and EP=2
over real gloo groups, and each rank's bytes read equal its planned share of the FP8 weights plus
the scale blocks that cover it. The DeepSeek-V3 checkpoint carries a multi-token-prediction layer
(num_nextn_predict_layers), which is skipped at load as Transformers skips it. Refusals: per-tensor
FP8, fmt e5m2, a merge onto FP8.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ster_dist.config.load import model_config
from ster_dist.errors import Refusal
from ster_dist.load import load_model
from ster_dist.model.decoder import meta_decoder
from ster_dist.ops.tools import inspect_model
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.parallel.linear import module_shards
from ster_dist.parity import compare
from ster_dist.resolve import resolve
from ster_dist.schema.tools import InspectModelRequest
from ster_dist.shard.plan import build_plan
from ster_dist.shard.safetensors_header import DTYPES, read_header
from tests.tiny_models import make_tiny

E4M3_MAX = 448.0
# blocks that straddle tensor-parallel splits (DeepSeek's q_b_proj rows split at 24, Qwen's q_proj
# at 32)
# and leave partial blocks (kv_a_proj_with_mqa's 20 rows, a hidden size of 48 in blocks of 20
# columns)
BLOCKS = {"deepseek_v3": (16, 16), "qwen3_moe": (24, 20)}
IDS = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block of its last two dimensions)."""
    *lead, rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = F.pad(w.float(), (0, nc * b1 - cols, 0, nr * b0 - rows))
    blocks = padded.reshape(*lead, nr, b0, nc, b1)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / E4M3_MAX
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :rows, :cols]
    return q.contiguous().to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    full = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    return q.float() * full


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """As published: every projection; norms, embeddings, router gates and heads stay BF16."""
    if (
        t.dim() < 2
        or "norm" in name
        or "embed_tokens" in name
        or "lm_head" in name
        or "shared_head.head" in name
    ):
        return False
    return not name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))


def mtp_tensors(
    tensors: dict[str, torch.Tensor], layers: int, hidden: int, vocab: int
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's multi-token-prediction layer as published (layer 61 of 61): the last decoder
    layer's tensors under the next index, plus its embedding, enorm / hnorm, eh_proj and shared
    head."""
    gen = torch.Generator().manual_seed(7)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    out = {mtp + n[len(last) :]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    for name, shape in (
        ("embed_tokens.weight", (vocab, hidden)),
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)),
        ("shared_head.head.weight", (vocab, hidden)),
    ):
        out[mtp + name] = torch.randn(shape, generator=gen) * 0.05
    return out


def write_fp8(
    tensors: dict[str, torch.Tensor],
    block,
    source: Path,
    fp8_dir: Path,
    ref_dir: Path,
    config: dict,
) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint (with its quantization_config) and its float32 twin holding the same bytes
    dequantized; returns the twin's tensors."""
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if is_quantized(name, t):
            q, scale = quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale, block)
        else:
            fp8[name] = t.to(torch.bfloat16)
            dequantized[name] = fp8[name].float()
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
    }
    for directory, weights, cfg in (
        (fp8_dir, fp8, {**config, "quantization_config": quant}),
        (ref_dir, dequantized, config),
    ):
        directory.mkdir()
        for path in source.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
                shutil.copy(path, directory / path.name)
        (directory / "config.json").write_text(json.dumps(cfg))
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors")
        )
    return dequantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (FP8 directory, float32 twin directory, Transformers on the twin)."""
    import transformers

    out = {}
    for variant in ("deepseek_v3", "qwen3_moe"):
        root = tmp_path_factory.mktemp(variant)
        model = make_tiny(variant, root / "source")
        tensors = load_file(str(root / "source" / "model.safetensors"))
        config = json.loads((root / "source" / "config.json").read_text())
        if variant == "deepseek_v3":  # as published: one MTP layer after the decoder's
            config["num_nextn_predict_layers"] = 1
            tensors.update(
                mtp_tensors(
                    tensors,
                    config["num_hidden_layers"],
                    config["hidden_size"],
                    config["vocab_size"],
                )
            )
        write_fp8(tensors, BLOCKS[variant], root / "source", root / "fp8", root / "ref", config)
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            root / "ref", dtype=torch.float32
        ).eval()
        assert type(reference) is type(model)
        out[variant] = (root / "fp8", root / "ref", reference)
    return out


def expected_bytes(directory: Path, ctx: ParallelCtx) -> int:
    """What one rank must read: its planned window of every tensor, in the stored dtype, and for an
    FP8 tensor the scale entries of every block its window touches."""
    checkpoint = resolve(str(directory))
    cfg = model_config(checkpoint)
    stored = {}
    for path in checkpoint.weight_files:
        for name, info in read_header(path).tensors.items():
            stored[name] = (DTYPES[info["dtype"]], tuple(info["shape"]))
    shapes = {n: s for n, (_, s) in stored.items() if not n.endswith("_scale_inv")}
    plan = build_plan(cfg.spec, cfg, module_shards(meta_decoder(cfg, ctx)), shapes)
    block = cfg.quant.block
    total = 0
    for read in plan.reads:
        dtype, shape = stored[read.source]
        for piece in read.pieces:
            window = piece.window or (piece.rows or slice(None), piece.cols or slice(None))
            # a vector's columns: none
            window = (tuple(window) + (slice(None),) * len(shape))[: len(shape)]
            bounds = [w.indices(n)[:2] for w, n in zip(window, shape, strict=True)]
            total += math.prod(b - a for a, b in bounds) * dtype.itemsize
            if read.source + "_scale_inv" in stored:
                *lead, (r0, r1), (c0, c1) = bounds
                covering = (-(-r1 // block[0]) - r0 // block[0]) * (
                    -(-c1 // block[1]) - c0 // block[1]
                )
                total += math.prod(b - a for a, b in lead) * covering * 4
    return total


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    result = compare(ours, theirs)
    assert result["max_relative_error"] < 1e-4 and result["mean_cosine"] > 0.99999, result


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_fp8_loads_dequantized_and_matches_transformers_on_the_same_bytes(checkpoints, variant):
    fp8_dir, ref_dir, reference = checkpoints[variant]
    loaded = load_model(resolve(str(fp8_dir)), "f32")
    with torch.no_grad():
        theirs = reference(IDS).logits
        _close(loaded.model(IDS), theirs)
    assert loaded.bytes_read == expected_bytes(fp8_dir, ParallelCtx())
    # at bf16 the dequantized weights are rounded once more: close, not equal
    with torch.no_grad():
        assert (
            compare(load_model(resolve(str(fp8_dir)), "bf16").model(IDS), theirs)["mean_cosine"]
            > 0.99
        )
    # the float32 twin with its MTP layer: the unquantized release loads alike
    if variant == "deepseek_v3":
        with torch.no_grad():
            _close(load_model(resolve(str(ref_dir)), "f32").model(IDS), theirs)


@pytest.mark.parametrize("variant", ["deepseek_v3", "qwen3_moe"])
def test_fp8_under_tp2_and_ep2_reads_its_share_of_weights_and_scales(
    checkpoints, tp2, ep2, variant
):
    fp8_dir, _, reference = checkpoints[variant]
    checkpoint = resolve(str(fp8_dir))
    with torch.no_grad():
        theirs = reference(IDS).logits
    for group, ctxs in (
        (tp2, [ParallelCtx(tp_rank=r, tp_size=2) for r in range(2)]),
        (ep2, [ParallelCtx(ep_rank=r, ep_size=2) for r in range(2)]),
    ):
        stats = group.call("load", checkpoint, "f32", "cpu")
        _close(group.call("logits", IDS)[0], theirs)
        assert [s["bytes_read"] for s in stats] == [expected_bytes(fp8_dir, ctx) for ctx in ctxs]


def _stacked_fp8(reference, block, source: Path, root: Path):
    """Qwen3-MoE with its experts stacked as Transformers 5 holds them (experts.gate_up_proj
    [experts, 2 x inner, hidden], experts.down_proj), quantized in blocks over each expert's matrix;
    returns Transformers holding the same bytes dequantized."""
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if "rotary_emb" not in k}
    config = json.loads((source / "config.json").read_text())
    dequantized = write_fp8(state, block, source, root / "fp8", root / "ref", config)
    twin = type(reference)(reference.config).eval()
    twin.load_state_dict(dequantized, strict=False)
    return twin


def test_stacked_fp8_experts_split_inside_blocks_under_tp2(checkpoints, tp2, tmp_path):
    fp8_dir, _, reference = checkpoints["qwen3_moe"]
    twin = _stacked_fp8(reference, BLOCKS["qwen3_moe"], fp8_dir, tmp_path)
    names = read_header(tmp_path / "fp8" / "model.safetensors").tensors
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in names
    checkpoint = resolve(str(tmp_path / "fp8"))
    with torch.no_grad():
        theirs = twin(IDS).logits
        _close(load_model(checkpoint, "f32").model(IDS), theirs)
    stats = tp2.call("load", checkpoint, "f32", "cpu")
    _close(tp2.call("logits", IDS)[0], theirs)
    assert [s["bytes_read"] for s in stats] == [
        expected_bytes(tmp_path / "fp8", ParallelCtx(tp_rank=r, tp_size=2)) for r in range(2)
    ]


def test_inspect_model_reports_the_quantization_and_the_mtp_layer(checkpoints):
    fp8_dir, _, _ = checkpoints["deepseek_v3"]
    config = inspect_model(InspectModelRequest(model=str(fp8_dir)))["config"]
    assert config["mtp_layers"] == 1
    assert config["quantization"] == {"method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}


def _with_config(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def _quant(fp8_dir: Path, **changes) -> dict:
    return {**json.loads((fp8_dir / "config.json").read_text())["quantization_config"], **changes}


def test_mtp_tensors_without_num_nextn_predict_layers_are_refused(checkpoints, tmp_path):
    fp8_dir, _, _ = checkpoints["deepseek_v3"]
    bare = _with_config(fp8_dir, tmp_path / "bare", num_nextn_predict_layers=0)
    with pytest.raises(
        Refusal, match=r"model\.layers\.3\..* is not mapped by the deepseek_v3 name map"
    ):
        load_model(resolve(str(bare)), "f32")


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"weight_block_size": None}, "per-tensor scales"),
        ({"fmt": "e5m2"}, "fmt e5m2"),
        ({"activation_scheme": "static"}, "activation_scheme static"),
    ],
)
def test_fp8_layouts_other_than_e4m3_blocks_are_refused_at_the_gate(
    checkpoints, tmp_path, changes, why
):
    fp8_dir, _, _ = checkpoints["qwen3_moe"]
    other = _with_config(
        fp8_dir, tmp_path / "other", quantization_config=_quant(fp8_dir, **changes)
    )
    with pytest.raises(Refusal) as refused:
        resolve(str(other))
    message = str(refused.value)
    assert "\n" not in message and why in message and "weight_block_size [rows, cols]" in message


def test_other_quantizations_keep_the_refusal(checkpoints, tmp_path):
    fp8_dir, _, _ = checkpoints["qwen3_moe"]
    other = _with_config(
        fp8_dir, tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4}
    )
    with pytest.raises(
        Refusal,
        match=r"is a quantized checkpoint \(quantization_config: awq\); ster_dist runs "
        "unquantized safetensors weights only",
    ):
        resolve(str(other))


def test_modules_to_not_convert_is_honoured(checkpoints, tmp_path):
    fp8_dir, _, reference = checkpoints["qwen3_moe"]
    # the head and the routers are stored in BF16, as the config says: loads
    kept = _with_config(
        fp8_dir,
        tmp_path / "kept",
        quantization_config=_quant(fp8_dir, modules_to_not_convert=["lm_head", "mlp.gate"]),
    )
    with torch.no_grad():
        _close(load_model(resolve(str(kept)), "f32").model(IDS), reference(IDS).logits)
    # a module the config keeps unquantized but the files quantize: the two disagree
    wrong = _with_config(
        fp8_dir,
        tmp_path / "wrong",
        quantization_config=_quant(fp8_dir, modules_to_not_convert=["self_attn.o_proj"]),
    )
    with pytest.raises(Refusal, match=r"o_proj\.weight is quantized .*modules_to_not_convert"):
        load_model(resolve(str(wrong)), "f32")


def test_a_merge_onto_an_fp8_base_is_refused_before_any_weight_is_read(checkpoints, tmp_path):
    from ster_dist.adapters.merge import prepare

    fp8_dir, _, _ = checkpoints["qwen3_moe"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 2,
                "lora_alpha": 4,
                "target_modules": ["o_proj"],
                "base_model_name_or_path": str(fp8_dir),
            }
        )
    )
    prefix = "base_model.model.model.layers.0.self_attn.o_proj"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(2, 64),
            f"{prefix}.lora_B.weight": torch.zeros(48, 2),
        },
        str(adapter / "adapter_model.safetensors"),
    )
    with pytest.raises(
        Refusal,
        match=r"is an FP8 checkpoint \(weight_block_size \[24, 20\]\); merge onto an FP8 "
        "checkpoint is not supported: merge into a BF16 export",
    ):
        prepare(str(fp8_dir), str(adapter), tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and not (tmp_path / ".merged.merging").exists()


@pytest.mark.parametrize(
    "tensors, why",
    [
        (
            {"w": torch.zeros(4, 4).to(torch.float8_e4m3fn)},
            "w is stored as torch.float8_e4m3fn without w_scale_inv",
        ),
        (
            {"w": torch.zeros(4, 4).to(torch.float8_e4m3fn), "w_scale_inv": torch.ones(2, 2)},
            r"w_scale_inv has shape \[2, 2\] but w \[4, 4\] in blocks of \[3, 4\] needs \[2, 1\]",
        ),
        ({"w_scale_inv": torch.ones(2, 1)}, "w_scale_inv scales no tensor"),
        (
            {"w": torch.zeros(4, 4, dtype=torch.bfloat16), "w_scale_inv": torch.ones(2, 1)},
            "not float8_e4m3fn",
        ),
    ],
)
def test_a_damaged_fp8_checkpoint_is_refused_naming_the_tensor(tmp_path, tensors, why):
    from ster_dist.config.quant import BlockFP8
    from ster_dist.shard.fp8 import Fp8Source
    from ster_dist.shard.source import SafetensorsSource

    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource([tmp_path / "model.safetensors"])
    with pytest.raises(Refusal, match=why):
        Fp8Source(source, BlockFP8((3, 4)), torch.float32)
    source.close()

"""A checkpoint's quantization_config, read once: which quantized layouts load, and the refusal for
the rest.

Three layouts load, each dequantized to --precision while it is read (shard/fp8.py, shard/mxfp4.py):
- FP8 with block scales as DeepSeek-V3/R1 and Qwen3-*-FP8 publish it (quant_method fp8, fmt e4m3,
  weight_block_size [rows, cols]): float8_e4m3fn weights beside `<name>_scale_inv`, one float32
  scale per block;
- MXFP4 as gpt-oss publishes it (quant_method mxfp4): expert matrices as `<name>_blocks` (uint8, two
  e2m1 values a byte, 32 values a block) beside `<name>_scales` (one e8m0 exponent a block);
- compressed-tensors FP8 (quant_method compressed-tensors, format float-quantized or
  naive-quantized, weights {num_bits 8, type float} with strategy channel, tensor or block):
  float8_e4m3fn weights beside
  `<name>_scale`. Activation schemes are not applied: such checkpoints run weight-only, as the note
  says.
Every other quantization keeps a one-line refusal naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ster_dist.errors import Refusal

SUPPORTED = "quant_method fp8 with fmt e4m3 and a weight_block_size [rows, cols] (as DeepSeek-V3 and Qwen3-FP8 publish)"
LOADED = "FP8 with block scales (quant_method fp8), MXFP4 (quant_method mxfp4) and compressed-tensors FP8 weights"
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_STRATEGIES = ("channel", "tensor", "block")


def _within(name: str, module: str) -> bool:
    """Whether `module` (dotted; a `*` part matches any one part) names a module holding tensor
    `name`."""
    parts, want = name.split("."), module.split(".")
    return any(
        all(w in ("*", p) for w, p in zip(want, parts[i : i + len(want)]))
        for i in range(len(parts) - len(want) + 1)
    )


@dataclass(frozen=True)
class BlockFP8:
    """FP8 weights scaled per block of `block` = (rows, cols); modules_to_not_convert are stored
    unquantized."""

    block: tuple[int, int]
    not_convert: tuple[str, ...] = ()
    method = "fp8"
    label = "an FP8 checkpoint"
    scale_suffix = "_scale_inv"

    def summary(self) -> dict:
        return {
            "method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(self.block),
            **({"modules_to_not_convert": list(self.not_convert)} if self.not_convert else {}),
        }

    def describe(self) -> str:
        return f"{self.label} (weight_block_size {list(self.block)})"

    def converts(self, name: str) -> bool:
        """False for a tensor of a module listed in modules_to_not_convert (matched on whole name
        parts)."""
        return not any(_within(name, module) for module in self.not_convert)


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4 matrices (gpt-oss's experts): 32 e2m1 values a block, packed two a byte, one e8m0
    exponent a block."""

    not_convert: tuple[str, ...] = ()
    method = "mxfp4"
    label = "an MXFP4 checkpoint"
    block = 32

    def summary(self) -> dict:
        return {
            "method": "mxfp4",
            "values": "e2m1",
            "scales": "e8m0",
            "block": self.block,
            **({"modules_to_not_convert": list(self.not_convert)} if self.not_convert else {}),
        }

    def describe(self) -> str:
        return f"{self.label} (e2m1 values in blocks of {self.block})"

    def converts(self, name: str) -> bool:
        return not any(_within(name, module) for module in self.not_convert)


@dataclass(frozen=True)
class CompressedFP8:
    """compressed-tensors FP8 weights: float8_e4m3fn, scaled per output channel, per tensor or per
    block (one strategy per config group; each tensor's scale shape says which is its own).
    `activations` names the activation schemes the config states, which load weight-only."""

    strategies: tuple[str, ...]
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    format: str = "float-quantized"
    activations: tuple[str, ...] = ()
    method = "compressed-tensors"
    label = "a compressed-tensors FP8 checkpoint"
    scale_suffix = "_scale"

    def summary(self) -> dict:
        return {
            "method": "compressed-tensors",
            "format": self.format,
            "weights": "fp8 e4m3",
            "strategies": list(self.strategies),
            **({"block_structure": list(self.block)} if self.block else {}),
            **({"ignore": list(self.ignore)} if self.ignore else {}),
            **({"activations_not_applied": list(self.activations)} if self.activations else {}),
        }

    def describe(self) -> str:
        return f"{self.label} (weights per {', '.join(self.strategies)})"

    def converts(self, name: str) -> bool:
        """False for a tensor of a module the config's `ignore` names (a module name, or `re:` and a
        pattern)."""
        module = name.rsplit(".", 1)[0]
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif _within(name, entry):
                return False
        return True


Quantization = BlockFP8 | Mxfp4 | CompressedFP8


def quantization(quant: object, model: str) -> Quantization | None:
    """The quantization a config states: None for none, the layout that loads; refuses the rest in
    one line."""
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    if method == "fp8":
        return _block_fp8(quant, model)
    if method == "mxfp4":
        return Mxfp4(_names(quant, "modules_to_not_convert", model))
    if method == "compressed-tensors":
        return _compressed(quant, model)
    raise Refusal(
        f"model {model} is a quantized checkpoint (quantization_config: {method}); "
        f"ster_dist runs unquantized safetensors weights only, besides {LOADED}: use a BF16, F16 or F32 export"
    )


def _names(quant: dict, key: str, model: str) -> tuple[str, ...]:
    found = quant.get(key) or []
    if not (isinstance(found, list) and all(isinstance(m, str) for m in found)):
        raise Refusal(f"model {model}'s quantization_config.{key} is not a list of module names")
    return tuple(found)


def _block_fp8(quant: dict, model: str) -> BlockFP8:
    fmt = quant.get("fmt") or "e4m3"
    block = quant.get("weight_block_size")
    scheme = quant.get("activation_scheme") or "dynamic"
    if fmt != "e4m3":
        why = f"fmt {fmt}"
    elif block is None:
        why = "per-tensor scales (no weight_block_size)"
    elif not _pair(block):
        why = f"weight_block_size {block}"
    elif scheme != "dynamic":
        why = f"activation_scheme {scheme}"
    else:
        return BlockFP8((block[0], block[1]), _names(quant, "modules_to_not_convert", model))
    raise Refusal(
        f"model {model} is a quantized checkpoint (quantization_config: fp8) with {why}; ster_dist "
        f"loads FP8 only as {SUPPORTED}: use such an export or a BF16 one"
    )


def _pair(block: object) -> bool:
    return (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )


def _compressed(quant: dict, model: str) -> CompressedFP8:
    """compressed-tensors: every config group's weights must be symmetric 8-bit floats in a strategy
    that loads."""

    def refuse(why: str) -> Refusal:
        return Refusal(
            f"model {model} is a compressed-tensors checkpoint with {why}; ster_dist loads "
            f"compressed-tensors only as FP8 weights ({' or '.join(CT_FORMATS)}, num_bits 8, type float, "
            f"strategy {', '.join(CT_STRATEGIES)}): use such an export or a BF16 one"
        )

    top = quant.get("format") or "float-quantized"
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse("no config_groups")
    if quant.get("kv_cache_scheme"):
        raise refuse("a kv_cache_scheme (quantized KV cache)")
    sparsity = quant.get("sparsity_config") or {}
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise refuse(f"sparsity_config format {sparsity.get('format')}")
    strategies, blocks, activations = [], set(), []
    for group_name, group in sorted(groups.items()):
        fmt = (group.get("format") if isinstance(group, dict) else None) or top
        weights = group.get("weights") if isinstance(group, dict) else None
        if fmt not in CT_FORMATS:
            raise refuse(f"format {fmt} (config group {group_name})")
        if not isinstance(weights, dict):
            raise refuse(f"no weights scheme in config group {group_name}")
        bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
        if (bits, kind) != (8, "float"):
            raise refuse(f"weights num_bits {bits} type {kind} (config group {group_name})")
        if strategy not in CT_STRATEGIES:
            raise refuse(f"weights strategy {strategy} (config group {group_name})")
        if weights.get("symmetric") is False:
            raise refuse(f"asymmetric weights (config group {group_name})")
        if strategy == "block":
            block = weights.get("block_structure")
            # older releases write "128x128"
            if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):
                block = [int(b) for b in block.split("x")]
            if not _pair(block):
                raise refuse(f"block_structure {block} (config group {group_name})")
            blocks.add((block[0], block[1]))
        if strategy not in strategies:
            strategies.append(strategy)
        for key in ("input_activations", "output_activations"):
            scheme = group.get(key)
            if scheme and not isinstance(scheme, dict):
                raise refuse(f"{key} {scheme!r} (config group {group_name})")
            if scheme:
                what = f"{key} {'dynamic' if scheme.get('dynamic') else 'static'}"
                if what not in activations:
                    activations.append(what)
    ignore = _names(quant, "ignore", model)
    for entry in ignore:
        try:
            re.compile(entry[3:]) if entry.startswith("re:") else None
        except re.error:
            raise Refusal(
                f"model {model}'s quantization_config.ignore entry {entry!r} is not a valid pattern"
            ) from None
    if len(blocks) > 1:
        raise refuse(f"block_structures {sorted(blocks)} (one per checkpoint loads)")
    return CompressedFP8(
        tuple(strategies), next(iter(blocks), None), ignore, top, tuple(activations)
    )

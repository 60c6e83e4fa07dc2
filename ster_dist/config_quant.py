"""A checkpoint's quantization_config, read once: which quantized layouts load, and the refusal for the rest.

The one layout that loads is FP8 with block scales as DeepSeek-V3/R1 and Qwen3-*-FP8 publish it
(quant_method fp8, fmt e4m3, weight_block_size [rows, cols]): each quantized weight is stored as
float8_e4m3fn beside `<name>_scale_inv`, one float32 scale per block, and is dequantized while it is
read (shard/fp8.py). Every other quantization keeps the quantized-checkpoint refusal.
"""

from __future__ import annotations

from dataclasses import dataclass

from ster_dist.errors import Refusal

SUPPORTED = 'quant_method fp8 with fmt e4m3 and a weight_block_size [rows, cols] (as DeepSeek-V3 and Qwen3-FP8 publish)'


@dataclass(frozen=True)
class BlockFP8:
    """FP8 weights scaled per block of `block` = (rows, cols); modules_to_not_convert are stored unquantized."""

    block: tuple[int, int]
    not_convert: tuple[str, ...] = ()

    def summary(self) -> dict:
        return {"method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                **({"modules_to_not_convert": list(self.not_convert)} if self.not_convert else {})}

    def converts(self, name: str) -> bool:
        """False for a tensor of a module listed in modules_to_not_convert (matched on whole name parts)."""
        parts = name.split(".")
        for module in self.not_convert:
            want = module.split(".")
            if any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
                return False
        return True


def quantization(quant: object, model: str) -> BlockFP8 | None:
    """The quantization a config states: None for none, BlockFP8 for the layout that loads; refuses the rest."""
    if not quant:
        return None
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    if method != "fp8":
        raise Refusal(f"model {model} is a quantized checkpoint (quantization_config: {method}); "
                      "ster_dist runs unquantized safetensors weights only: use a BF16, F16 or F32 export")
    fmt = quant.get("fmt") or "e4m3"
    block = quant.get("weight_block_size")
    scheme = quant.get("activation_scheme") or "dynamic"
    if fmt != "e4m3":
        why = f"fmt {fmt}"
    elif block is None:
        why = "per-tensor scales (no weight_block_size)"
    elif not (isinstance(block, list) and len(block) == 2
              and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        why = f"weight_block_size {block}"
    elif scheme != "dynamic":
        why = f"activation_scheme {scheme}"
    else:
        not_convert = quant.get("modules_to_not_convert") or []
        if not (isinstance(not_convert, list) and all(isinstance(m, str) for m in not_convert)):
            raise Refusal(f"model {model}'s quantization_config.modules_to_not_convert is not a list of module names")
        return BlockFP8((block[0], block[1]), tuple(not_convert))
    raise Refusal(f"model {model} is a quantized checkpoint (quantization_config: fp8) with {why}; ster_dist "
                  f"loads FP8 only as {SUPPORTED}: use such an export or a BF16 one")

"""JSON text as Ster (Rust, serde_json) writes it: what makes a file ster_dist writes the file Ster
would have written, byte for byte.

serde_json prints a float with Ryu: the shortest digits that read back to the same value, in
plain decimal unless the exponent is far out (then `1.5e-7`, no `+`, no padded exponent), an
integral value with `.0`. Ster's vectors and scores are f32, so their shortest digits are the
f32's (0.14712493, not the f64 expansion 0.14712493121623993 Python's json would print). A value
wrapped in `F32` is formatted so; any other float as serde formats an f64. Compact output uses
`,` and `:`; pretty output is serde's `to_string_pretty` (two spaces, `": "`, `[]` and `{}` when
empty). Non-finite floats have no JSON form: they are refused before anything is written.
"""

from __future__ import annotations

import json
import math

import numpy as np


class F32(float):
    """A float Ster holds as f32: written with the f32's shortest digits."""


def _shortest(value: float, single: bool) -> tuple[str, int]:
    """(digits, exponent), value == int(digits) * 10**exponent: the fewest that round-trip."""
    text = np.format_float_scientific(
        np.float32(value) if single else np.float64(value), unique=True, trim="-"
    )
    mantissa, exp = text.split("e")
    digits = mantissa.replace(".", "").lstrip("-")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    digits = digits.rstrip("0") or "0"
    exponent = int(exp) - decimals + (len(mantissa.replace(".", "").lstrip("-")) - len(digits))
    return digits, exponent


def format_float(value: float, single: bool = False) -> str:
    """Ryu's `format32` / `format64` text of a finite value."""
    if not math.isfinite(value):
        raise ValueError(f"{value} has no JSON form")
    sign = "-" if math.copysign(1.0, value) < 0 else ""
    if value == 0:
        return sign + "0.0"
    digits, k = _shortest(abs(value), single)
    length = len(digits)
    kk = length + k  # 10^(kk-1) <= value < 10^kk
    wide, low = (13, -6) if single else (16, -5)
    if 0 <= k and kk <= wide:
        body = digits + "0" * k + ".0"
    elif 0 < kk <= wide:
        body = digits[:kk] + "." + digits[kk:]
    elif low < kk <= 0:
        body = "0." + "0" * -kk + digits
    elif length == 1:
        body = f"{digits}e{kk - 1}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + body


def dumps(value, pretty: bool = False) -> str:
    """`serde_json::to_string` (or `to_string_pretty`) of a JSON value, F32 floats as f32."""
    parts: list[str] = []
    _write(value, parts, "\n" if pretty else None, 0)
    return "".join(parts)


def _write(value, out: list[str], newline: str | None, depth: int) -> None:
    if value is None or isinstance(value, (bool, str, int)) and not isinstance(value, float):
        out.append(json.dumps(value, ensure_ascii=False))
    elif isinstance(value, float):
        out.append(format_float(value, single=isinstance(value, F32)))
    elif isinstance(value, dict):
        _container(
            "{",
            "}",
            [(json.dumps(str(k), ensure_ascii=False), v) for k, v in value.items()],
            out,
            newline,
            depth,
        )
    elif isinstance(value, (list, tuple)):
        _container("[", "]", [(None, v) for v in value], out, newline, depth)
    else:
        raise TypeError(f"{type(value).__name__} is not a JSON value")


def _container(
    open_: str, close: str, items: list, out: list[str], newline: str | None, depth: int
) -> None:
    out.append(open_)
    if not items:
        out.append(close)
        return
    inner = "" if newline is None else newline + "  " * (depth + 1)
    for index, (key, item) in enumerate(items):
        if index:
            out.append(",")
        out.append(inner)
        if key is not None:
            out.append(key + (": " if newline else ":"))
        _write(item, out, newline, depth + 1)
    if newline is not None:
        out.append(newline + "  " * depth)
    out.append(close)

"""GGUFSource: a llama.cpp .gguf file seen as a TensorSource under Transformers names.

Opening the source checks every tensor in the file against config.json (name rule, layer count,
storage type, shape) before any data is read. A read dequantizes only the rows asked for (and only
the blocks covering the columns asked for) and, for families llama.cpp converted with permuted q/k
rows, undoes that permutation, touching only the heads the asked rows fall in. `read_blocks` hands
out the stored bytes of a window instead (the loader keeping Q8_0/Q4_0/Q4_1 blocks as stored,
shard/ggml_kept.py), rows permuted alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from ster_dist.errors import Refusal
from ster_dist.gguf.dequant import SUPPORTED, dequantize_window, row_bytes, window_bytes
from ster_dist.gguf.layout import check_layout
from ster_dist.gguf.names import DERIVED, FAMILIES, GGUFFamily, Mapped, symbols, to_gguf, to_hf
from ster_dist.parallel.ggml import KINDS


@dataclass(frozen=True)
class _Entry:
    mapped: Mapped
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # Transformers orientation
    raw: np.ndarray  # uint8 [rows, row_bytes], a view of the file's memory map
    heads: int | None  # q/k head count when llama.cpp's row permutation must be undone


def open_reader(path: Path) -> GGUFReader:
    """GGUFReader over a file whose header check_layout has bounded (see gguf/layout.py)."""
    check_layout(path)
    try:
        return GGUFReader(path, "r")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise Refusal(f"cannot read GGUF file {path}: {' '.join(str(exc).split())[:300]}") from None


# what a metadata value may be, by the name field_value's `expect` gives it
_EXPECT = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int),
    "number": lambda v: isinstance(v, (int, float)),
    "bool": lambda v: isinstance(v, (bool, int)),
    "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "ints": lambda v: isinstance(v, list) and all(isinstance(x, int) for x in v),
    "numbers": lambda v: isinstance(v, list) and all(isinstance(x, (int, float)) for x in v),
}


def field_value(reader: GGUFReader, key: str, default=None, expect: str | None = None):
    """A metadata value (scalar, string or list), or default when the file lacks the key; with
    `expect` (a key of _EXPECT), a value of another kind is refused."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except (ValueError, IndexError, TypeError) as exc:
        raise Refusal(f"GGUF metadata {key} cannot be read ({exc}); the file is damaged") from None
    if expect is not None and not _EXPECT[expect](value):
        shown = repr(value)
        raise Refusal(
            f"GGUF metadata {key} is {shown[:60]}{'...' if len(shown) > 60 else ''}, not "
            f"{_EXPECT_NAMES[expect]}; the file is damaged or not a llama.cpp model"
        )
    return value


_EXPECT_NAMES = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "a boolean",
    "strs": "a list of strings",
    "ints": "a list of integers",
    "numbers": "a list of numbers",
}


def family_of(reader: GGUFReader, path: Path) -> GGUFFamily:
    return family_named(field_value(reader, "general.architecture"), path)


def family_named(arch, path: Path) -> GGUFFamily:
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise Refusal(
            f"GGUF file {path} has architecture {arch!r}; ster_dist reads GGUF files of "
            f"architecture {', '.join(FAMILIES)}; use the model's safetensors checkpoint"
        )
    return FAMILIES[arch]


class GGUFSource:
    """TensorSource over one .gguf file; `read` returns tensors at `precision`."""

    def __init__(
        self,
        path: Path,
        config: dict,
        precision: torch.dtype = torch.float32,
        *,
        reader: GGUFReader | None = None,
    ):
        self.path = Path(path)
        self.precision = precision
        self.bytes_read = 0  # bytes returned, as SafetensorsSource counts them
        self.raw_bytes_read = 0  # quantized bytes copied out of the file
        # An already-open reader may be passed in: parsing the metadata takes seconds. Without one,
        # the header
        # check_layout walks is all a load reads (gguf/layout.py), over a memory map of the file.
        self._reader = reader
        if reader is not None:
            self.family, tensors, self._data = (
                family_of(reader, self.path),
                reader.tensors,
                reader.data,
            )
        else:
            header = check_layout(self.path)
            # GGUFReader reads the other byte order's numbers; the walk does not
            if not header.little_endian:
                self._reader = open_reader(self.path)
                self.family, tensors, self._data = (
                    family_of(self._reader, path),
                    self._reader.tensors,
                    self._reader.data,
                )
            else:
                self.family = family_named(header.fields.get("general.architecture"), self.path)
                tensors, self._data = header.tensors, np.memmap(self.path, dtype=np.uint8, mode="r")
        self._entries: dict[str, _Entry] = {}
        sym = symbols(config)
        layers = config.get("num_hidden_layers")
        heads = {
            "attn_q": config.get("num_attention_heads"),
            "attn_k": config.get("num_key_value_heads") or config.get("num_attention_heads"),
        }
        for tensor in tensors:
            entry = self._check(tensor, sym, layers, heads)
            if entry.mapped.hf in self._entries:
                raise Refusal(
                    f"GGUF file {self.path} lists tensor {tensor.name} twice; the file is damaged"
                )
            self._entries[entry.mapped.hf] = entry
        if config.get("tie_word_embeddings") is False and "lm_head.weight" not in self._entries:
            raise Refusal(
                f"config.json says tie_word_embeddings is false but {self.path.name} has no "
                "output.weight (the model ties lm_head to the embedding); set "
                "tie_word_embeddings to true"
            )

    def _check(self, tensor, sym: dict, layers: int | None, heads: dict) -> _Entry:
        name = tensor.name
        if name in DERIVED:
            raise Refusal(
                f"GGUF tensor {name} in {self.path.name} carries {DERIVED[name]}, which "
                "ster_dist cannot read back into config.json; use the model's "
                "safetensors checkpoint"
            )
        mapped = to_hf(self.family, name)
        if mapped is None:
            raise Refusal(
                f"GGUF tensor {name} in {self.path.name} has no Transformers name for "
                f"architecture {self.family.arch}; use the model's safetensors checkpoint"
            )
        if mapped.layer is not None and layers is not None and mapped.layer >= layers:
            raise Refusal(
                f"GGUF tensor {name} is in layer {mapped.layer} but the config has "
                f"num_hidden_layers {layers}; the .gguf and config.json describe "
                "different models"
            )
        qtype = GGMLQuantizationType(int(tensor.tensor_type))
        if qtype not in SUPPORTED:
            raise Refusal(
                f"GGUF tensor {name} is stored as {qtype.name}, which ster_dist cannot "
                f"dequantize; use a file quantized to one of "
                f"{', '.join(sorted(t.name for t in SUPPORTED))}"
            )
        # ggml lists dimensions innermost first (ne order); Transformers lists them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        expected = tuple(sym[s] for s in mapped.shape)
        if shape != expected:
            shown = "[" + ", ".join("?" if d is None else str(d) for d in expected) + "]"
            raise Refusal(
                f"GGUF tensor {name} ({mapped.hf}) has shape "
                f"[{', '.join(map(str, shape))}] but the config says {shown}; "
                "the .gguf and config.json describe different models"
            )
        n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
        width = row_bytes(qtype, n_cols)
        offset = int(tensor.data_offset)
        raw = self._data[offset : offset + n_rows * width].reshape(n_rows, width)
        n_heads = heads.get(mapped.base) if self.family.permute_qk else None
        if n_heads is not None and (shape[0] % n_heads or (shape[0] // n_heads) % 2):
            raise Refusal(
                f"GGUF tensor {name} has {shape[0]} rows, not a whole number of "
                f"{n_heads} heads of even size; the .gguf and config.json describe "
                "different models"
            )
        return _Entry(mapped, qtype, shape, raw, n_heads)

    # -- TensorSource -------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        self._entry(name)
        return self.precision

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        entry = self._entry(name)
        want = np.arange(*(rows or slice(None)).indices(entry.shape[0]))
        if len(entry.shape) == 1:
            if cols is not None:
                raise ValueError(f"{name} is one-dimensional; it has no columns to slice")
            # A vector is stored as one row: its elements are that row's columns.
            out = self._window(entry, np.zeros(1, dtype=np.int64), self._stored_rows(entry, want))[
                0
            ]
        else:
            want_cols = np.arange(*(cols or slice(None)).indices(entry.shape[1]))
            out = self._window(entry, self._stored_rows(entry, want), want_cols)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def kept_kind(self, name: str) -> str | None:
        """The GGML kind `name` is stored in where its blocks can be kept as stored
        (parallel/ggml.py), else None."""
        entry = self._entry(name)
        return entry.qtype.name if entry.qtype.name in KINDS and len(entry.shape) == 2 else None

    def read_blocks(self, name: str, rows: slice | None, cols: slice | None) -> torch.Tensor:
        """The stored bytes of a window of whole blocks, uint8 [rows, blocks * block bytes]: a
        window whose columns start or end inside a block is refused, naming the block size."""
        entry = self._entry(name)
        want = self._stored_rows(entry, np.arange(*(rows or slice(None)).indices(entry.shape[0])))
        start, stop, _ = (cols or slice(None)).indices(entry.shape[1])
        block, size = GGML_QUANT_SIZES[entry.qtype]
        if start % block or (stop % block and stop != entry.shape[1]):
            raise Refusal(
                f"a rank's share of {name} holds columns {start}-{stop}, which cut {entry.qtype.name} "
                f"blocks of {block}; use a --tp whose split of {entry.shape[1]} columns is a multiple "
                f"of {block}, or import with --safetensors"
            )
        span = _span(want)
        raw = entry.raw[span.start : span.stop, start // block * size : -(-stop // block) * size]
        out = torch.from_numpy(np.array(raw, copy=True))
        if not _is_span(want, span):
            out = out[torch.from_numpy(want - span.start)]
        self.raw_bytes_read += out.numel()
        self.bytes_read += out.numel()
        return out

    def close(self) -> None:
        self._entries.clear()
        self._reader = self._data = None

    # -- helpers ------------------------------------------------------------

    def gguf_name(self, name: str) -> str | None:
        return to_gguf(self.family, name)

    def stored(self, name: str) -> tuple[str, int]:
        """(block type, bytes as stored) of one tensor, from the header: nothing is read."""
        entry = self._entry(name)
        return entry.qtype.name, int(entry.raw.nbytes)

    def quant_types(self) -> dict[str, int]:
        """How many tensors the file stores in each type, e.g. {"Q4_1": 210, "F32": 61}."""
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            counts[entry.qtype.name] = counts.get(entry.qtype.name, 0) + 1
        return counts

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            gguf = to_gguf(self.family, name)
            if gguf is None:
                raise Refusal(
                    f"no GGUF tensor name rule covers {name} for architecture {self.family.arch}"
                )
            raise Refusal(f"GGUF tensor {gguf} is not in {self.path.name} (asked for {name})")
        return entry

    @staticmethod
    def _stored_rows(entry: _Entry, want: np.ndarray) -> np.ndarray:
        """Where each asked (Transformers) row sits in the file.

        llama.cpp stores head h's row i*half + j (i in {0, 1}) at h*head_dim + 2*j + i
        (reshape(n_head, 2, half, ...).swapaxes(1, 2)). The map stays inside each
        head, so a window of whole heads reads exactly those heads' rows.
        """
        if entry.heads is None:
            return want
        head_dim = entry.shape[0] // entry.heads
        half = head_dim // 2
        head, within = np.divmod(want, head_dim)
        i, j = np.divmod(within, half)
        return head * head_dim + 2 * j + i

    def _window(self, entry: _Entry, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
        """Stored rows x stored columns: dequantizes their covering span, then gathers."""
        row_span, col_span = _span(rows), _span(cols)
        out = dequantize_window(entry.raw, entry.qtype, row_span, col_span, self.precision)
        self.raw_bytes_read += window_bytes(entry.qtype, row_span, col_span)
        # Gather only where the asked indices are not the span itself (permuted or stepped).
        if not _is_span(rows, row_span):
            out = out[torch.from_numpy(rows - row_span.start)]
        if not _is_span(cols, col_span):
            out = out[:, torch.from_numpy(cols - col_span.start)]
        return out


def _span(index: np.ndarray) -> range:
    return range(int(index.min()), int(index.max()) + 1) if len(index) else range(0)


def _is_span(index: np.ndarray, span: range) -> bool:
    if len(index) != len(span):
        return False
    return len(index) == 0 or (index[0] == span.start and bool(np.all(np.diff(index) == 1)))

"""A checkpoint's ModelConfig: config.json (or Mistral's params.json) read through config.py, with
the end-of-sequence ids generation_config.json (or the tokenizer config) states. Every process that
needs a model's config without its weights (the driver, the job queue's checks) reads it here."""

from __future__ import annotations

from ster_dist.checkpoint import Checkpoint
from ster_dist.config.model import ModelConfig, from_hf
from ster_dist.config.file import load_raw_config
from ster_dist.config.params import from_params
from ster_dist.errors import Refusal


def model_config(checkpoint: Checkpoint) -> ModelConfig:
    if checkpoint.weight_format == "mistral":
        # params.json states no token ids: the end of sequence is the tokenizer config's eos_token
        cfg = from_params(checkpoint.raw_config, str(checkpoint.config_path))
        eos = _generation_eos(checkpoint) or _tokenizer_eos(checkpoint)
    else:
        cfg = from_hf(checkpoint.raw_config, str(checkpoint.config_path))
        eos = _generation_eos(checkpoint)
    return cfg.with_eos(eos) if eos else cfg


def _tokenizer_eos(checkpoint: Checkpoint) -> tuple[int, ...]:
    """tokenizer_config.json's eos_token, as its id in tokenizer.json (read as Transformers reads
    them)."""
    from ster_dist.tokenizer import Tokenizer

    eos = Tokenizer.from_directory(checkpoint.tokenizer_path.parent).eos_token_id
    return () if eos is None else (eos,)


def _generation_eos(checkpoint: Checkpoint) -> tuple[int, ...]:
    """generation_config.json's eos_token_id: a file that is there is read whole, and a value the
    token engine could not stop on (a string, a float, a negative id) is refused, as config.json's
    is."""
    path = checkpoint.generation_config_path
    if not path.is_file():
        return ()
    try:
        eos = load_raw_config(path, "generation config").get("eos_token_id")
    except UnicodeDecodeError:
        raise Refusal(f"invalid generation config {path}: the file is not UTF-8 text") from None
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        shown = repr(eos) if len(repr(eos)) <= 60 else repr(eos)[:57] + "..."
        raise Refusal(
            f"invalid generation config {path}: eos_token_id is {shown}; it must be a token id or a "
            "list of token ids; correct it in generation_config.json (or re-download the checkpoint)"
        )
    return tuple(ids)

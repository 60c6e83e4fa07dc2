"""Model resolution: a --model string (and --revision) -> Checkpoint.

This module owns seeds/000's "Local directory" and "Hugging Face Hub" rules:
which config, tokenizer and weight files a checkpoint is made of, and the order
in which they are looked at. The architecture gate and the quantized refusal
(config_file.gate) run on the config before any weight file is listed for
loading or fetched, so a checkpoint ster_dist cannot run costs its config and
tokenizer, never its shards. Nothing here reads a tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ster_dist.config import file as config_file
from ster_dist.checkpoint import Checkpoint
from ster_dist.errors import Refusal
from ster_dist.tokenizer.files import OTHER_FILES, tokenizer_file

_PICKLED = (".bin", ".pt", ".pth")
_OPTIONAL_HUB_FILES = ("tokenizer_config.json", "generation_config.json")
_DEFAULT_ENDPOINT = "https://huggingface.co"


def resolve(model: str, revision: str | None = None) -> Checkpoint:
    """Resolve a local directory (never sent to the network) or else a Hub model id."""
    if os.path.isdir(model):
        return _resolve_local(model, revision)
    check_reference(model)
    # A missing path-looking string is not a missing directory: seeds/000 treats
    # it as a Hub id, so the refusal comes from the Hub and names the model.
    return _resolve_hub(model, revision)


def check_reference(model: str) -> None:
    """What can be said of a --model from this machine alone, refused before any network request: a
    path whose parent exists here but that names no directory, or a bare name (no owner/) that names
    no directory here, is a misspelling. Cheap (a directory listing), so the command line runs it
    before it starts anything."""
    if os.path.isdir(model):
        return
    _refuse_near_miss(model)
    _refuse_bare_name(model)


def _closest_directory(name: str, parent: str) -> str | None:
    import difflib

    try:
        entries = sorted(
            e.name for e in os.scandir(parent or ".") if e.is_dir() and not e.name.startswith(".")
        )
    except OSError:
        return None
    close = difflib.get_close_matches(name, entries, n=1, cutoff=0.6)
    return close[0] if close else None


def _refuse_near_miss(model: str) -> None:
    """A path whose parent directory exists here (models/smolm2 beside models/smollm2) is a
    misspelled directory far more often than a Hub id: say so before any network request, with the
    closest name the parent holds."""
    parent, name = os.path.split(os.path.normpath(model))
    if not parent or not name or not os.path.isdir(parent):
        return
    close = _closest_directory(name, parent)
    hint = f"did you mean {os.path.join(parent, close)}? " if close else ""
    raise Refusal(
        f"no directory {model}: {parent}/ exists here and holds no {name!r}; {hint}"
        f"(a Hub id whose owner is also a directory here is not fetched: run from another directory)"
    )


def _refuse_bare_name(model: str) -> None:
    """A name with no owner/ (toyy beside ./toy) is no Hub id the Hub resolves without a redirect,
    and no directory here: the closest directory here is named, and nothing is fetched."""
    name = os.path.normpath(model)
    if os.sep in name or "/" in name or not name.strip() or name in (".", ".."):
        return
    close = _closest_directory(name, "")
    hint = f"did you mean ./{close}? " if close else ""
    raise Refusal(
        f"no directory {model} here, and a Hub id names its owner (owner/name, e.g. "
        f"HuggingFaceTB/SmolLM2-135M-Instruct); {hint}give a model directory or an owner/name Hub id"
    )


def describe(checkpoint: Checkpoint) -> dict:
    """A JSON-able summary of a resolved checkpoint (for `ster resolve` and artifacts)."""
    return {
        "model": checkpoint.model,
        "model_revision": checkpoint.model_revision,
        "source": checkpoint.source,
        "directory": str(checkpoint.directory),
        "weight_format": checkpoint.weight_format,
        "files": [path.name for path in checkpoint.weight_files],
        "family": config_file.family_of(gate_view(checkpoint.raw_config, checkpoint.weight_format)),
    }


def gate_view(raw: dict, weight_format: str) -> dict:
    """The config the gate sees: Mistral's params.json states no model_type, so name its family.

    As vLLM reads it, latent attention or experts make params.json deepseek_v3 and
    a dense one mistral; its own `quantization` block counts as a quantization_config.
    """
    if weight_format != "mistral" or "model_type" in raw:
        return raw
    family = "deepseek_v3" if ("kv_lora_rank" in raw or "moe" in raw) else "mistral"
    quant = raw.get("quantization_config")
    if not quant and isinstance(raw.get("quantization"), dict):
        quant = {"quant_method": raw["quantization"].get("qformat_weight", "unknown")}
    return {**raw, "model_type": family, "quantization_config": quant}


def _read_config(path: Path) -> dict:
    # load_raw_config turns OSError and bad JSON into refusals; bytes that are not
    # UTF-8 raise UnicodeDecodeError (a ValueError) before JSON parsing.
    try:
        return config_file.load_raw_config(path)
    except UnicodeDecodeError:
        raise Refusal(f"invalid model config {path}: the file is not UTF-8 text") from None


# ---- file-name rules shared by both sources (pure: names in, names out) ----


def _config_name(names: set[str]) -> tuple[str, str] | None:
    """(config file, weight format) or None; params.json counts only with no config.json."""
    if "config.json" in names:
        return "config.json", "safetensors"
    if "params.json" in names:
        return "params.json", "mistral"
    return None


def _tokenizer_name(names: set[str], where: str, tokenizer_config: Callable[[], Path]) -> str:
    """The tokenizer file (tokenizer_files.tokenizer_file); `tokenizer_config()` gives the path of
    tokenizer_config.json, whose tokenizer_class is read only when no tokenizer.json decides it."""
    declared: object = None
    if (
        "tokenizer.json" not in names
        and names & set(OTHER_FILES)
        and "tokenizer_config.json" in names
    ):
        path = tokenizer_config()
        try:
            raw = config_file.load_raw_config(path)
        except (Refusal, UnicodeDecodeError):
            raise Refusal(
                f"failed to read tokenizer config {path}: it is not a JSON object, and its "
                "tokenizer_class names the class that reads the tokenizer file; correct it"
            ) from None
        declared = raw.get("tokenizer_class")
    return tokenizer_file(names, declared, where)


def _safetensors_names(names: set[str], weight_format: str) -> list[str]:
    """Sorted weights: consolidated* for Mistral's format, every other one for Transformers'."""
    mistral = weight_format == "mistral"
    return sorted(
        n
        for n in names
        if n.endswith(".safetensors")
        and n.startswith("consolidated") == mistral
        and "optimizer" not in n
        and "training_args" not in n
    )


def _format_hint(names: set[str], weight_format: str) -> str:
    """Why .safetensors files present are not this format's, when that is the case."""
    other = "safetensors" if weight_format == "mistral" else "mistral"
    if not _safetensors_names(names, other):
        return ""
    if weight_format == "mistral":
        return " (only Transformers-format files, which need a config.json)"
    return (
        " (consolidated*.safetensors are Mistral's format, read only beside params.json "
        "with no config.json)"
    )


# ---- local directory ----


def _resolve_local(model: str, revision: str | None) -> Checkpoint:
    directory = Path(model)
    names = local_names(directory)

    chosen = _config_name(names)
    if chosen is None:
        raise Refusal(
            f"model config is missing: {directory / 'config.json'}; "
            "place the model's config.json (or Mistral's params.json) in the directory"
        )
    config_name, weight_format = chosen
    config_path = directory / config_name
    raw = _read_config(config_path)
    config_file.gate(gate_view(raw, weight_format), model)
    tokenizer = _tokenizer_name(names, str(directory), lambda: directory / "tokenizer_config.json")

    weights = local_weights(directory, names, weight_format)
    if not weights:
        weights, weight_format = _local_fallback(directory, names, weight_format)
    return Checkpoint(
        model=model,
        directory=directory,
        config_path=config_path,
        tokenizer_path=directory / tokenizer,
        weight_files=tuple(directory / n for n in weights),
        weight_format=weight_format,
        model_revision=revision,  # metadata only for a local directory: recorded verbatim
        source="local",
        raw_config=raw,
    )


def local_names(directory: Path) -> set[str]:
    """The names of a directory's regular files (a link counts as what it points at)."""
    try:
        return {entry.name for entry in directory.iterdir() if entry.is_file()}
    except OSError as exc:
        raise Refusal(f"failed to list {directory}: {exc.strerror or exc}") from None


def local_weights(directory: Path, names: set[str], weight_format: str) -> list[str]:
    """The format's weight files among `names` (local_names). A weight name or .gguf that is no
    regular file (a link whose blob is gone, as an interrupted Hub download leaves, a directory, a
    FIFO) is refused, not skipped: skipped, its tensors would be reported missing (or the directory
    as holding no weights), and a FIFO would block its reader."""
    try:
        other = {entry.name for entry in directory.iterdir()} - names
    except OSError as exc:
        raise Refusal(f"failed to list {directory}: {exc.strerror or exc}") from None
    broken = _safetensors_names(other, weight_format) + sorted(
        n for n in other if n.endswith(".gguf")
    )
    if broken:
        raise Refusal(
            f"model weight file {directory / broken[0]} is not a regular file (a broken link, a directory "
            "or a FIFO); re-download it, or remove it if it is no weight file"
        )
    return _safetensors_names(names, weight_format)


def _local_fallback(directory: Path, names: set[str], weight_format: str) -> tuple[list[str], str]:
    """With no safetensors of the format: exactly one .gguf, or a refusal naming what is there."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs, "gguf"
    if ggufs:
        raise Refusal(
            f"model directory {directory} contains {len(ggufs)} .gguf files; "
            "exactly one is read: keep one .gguf beside the config and tokenizer"
        )
    pickled = sorted(n for n in names if n.endswith(_PICKLED))
    if pickled:
        raise Refusal(
            f"model directory contains no safetensors weights: {directory} holds only "
            f"pickled weights ({', '.join(pickled)}), which ster_dist never reads; "
            "convert them to safetensors"
        )
    raise Refusal(
        f"model directory contains no safetensors weights: {directory}"
        f"{_format_hint(names, weight_format)}; add the model's .safetensors files"
    )


# ---- Hugging Face Hub ----


def _resolve_hub(model: str, revision: str | None) -> Checkpoint:
    hub = _Hub(model)
    sha, names = hub.commit_files(revision or "main")
    chosen = _config_name(names)
    if chosen is None:
        raise Refusal(
            f"model config is missing: {model}/config.json at {sha}; "
            "the repository publishes neither config.json nor params.json"
        )
    config_name, weight_format = chosen
    config_path = hub.fetch(config_name, sha)
    tokenizer_path = hub.fetch("tokenizer.json", sha) if "tokenizer.json" in names else None
    raw = _read_config(config_path)
    config_file.gate(gate_view(raw, weight_format), model)  # before any weight file is fetched
    tokenizer = _tokenizer_name(
        names, f"{model}@{sha}", lambda: hub.fetch("tokenizer_config.json", sha)
    )
    if tokenizer_path is None:
        tokenizer_path = hub.fetch(tokenizer, sha)

    weights = _safetensors_names(names, weight_format)
    if not weights:
        hint = _format_hint(names, weight_format)
        if not hint and any(n.endswith(".gguf") for n in names):
            hint = " (GGUF is read only from a local directory)"
        raise Refusal(
            f"model {model} publishes no safetensors weights at {sha}{hint}; "
            "use a repository with .safetensors files"
        )
    for name in _OPTIONAL_HUB_FILES:
        if name in names:
            hub.fetch(name, sha)
    weight_files = tuple(hub.fetch(name, sha) for name in weights)
    directory = config_path.parent  # the snapshot directory of the resolved commit
    return Checkpoint(
        model=model,
        directory=directory,
        config_path=config_path,
        tokenizer_path=tokenizer_path,
        weight_files=weight_files,
        weight_format=weight_format,
        model_revision=sha,
        source="hub",
        raw_config=raw,
    )


class _Hub:
    """The huggingface_hub client for one repository, configured from the environment now.

    huggingface_hub freezes HF_ENDPOINT and HF_HOME into its constants when it is
    first imported, so endpoint, token and cache are read here and passed explicitly.
    Its calls raise HTTP, transport, validation and OS errors alike; each is caught
    at the call and turned into a one-line refusal.
    """

    def __init__(self, model: str):
        self.model = model
        self.endpoint = (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")
        # None lets the client fall back to its saved token file.
        self.token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
        try:
            from huggingface_hub import HfApi, hf_hub_download

            self._api = HfApi(endpoint=self.endpoint, token=self.token)
            self._download = hf_hub_download
        except Exception as exc:
            raise Refusal(
                f"failed to initialize Hugging Face Hub client: {_first_line(exc)}; "
                "reinstall huggingface_hub or pass a local directory"
            ) from None

    def commit_files(self, revision: str) -> tuple[str, set[str]]:
        """The commit SHA a revision resolves to, and the repository's top-level file names."""
        try:
            info = self._api.model_info(self.model, revision=revision)
        except Exception as exc:
            raise Refusal(
                f"failed to read model repository {self.model}: "
                f"{_hub_reason(exc, self.endpoint, revision)}"
            ) from None
        if not info.sha:
            raise Refusal(
                f"failed to read model repository {self.model}: {self.endpoint} returned "
                "no commit SHA; check that HF_ENDPOINT points at a Hugging Face Hub"
            )
        # Top-level files only, as for a local directory: the snapshot then reads the same way.
        return info.sha, {s.rfilename for s in (info.siblings or []) if "/" not in s.rfilename}

    def fetch(self, name: str, sha: str) -> Path:
        """Download one file at the resolved SHA, so every file lands in one snapshot."""
        try:
            return Path(
                self._download(
                    self.model,
                    name,
                    revision=sha,
                    endpoint=self.endpoint,
                    token=self.token,
                    cache_dir=_hub_cache_dir(),
                )
            )
        except Exception as exc:
            raise Refusal(
                f"failed to download {name}: {_hub_reason(exc, self.endpoint, sha)}"
            ) from None


def _hub_cache_dir() -> str:
    """huggingface_hub's precedence (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME), read now."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _hub_reason(exc: Exception, endpoint: str, revision: str) -> str:
    """A short reason and fix for a huggingface_hub failure, for a one-line refusal."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return "the repository is gated; accept its terms on the Hub and set HF_TOKEN"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (
            f"repository not found on {endpoint}; check the model id, "
            "or set HF_TOKEN for a private repository"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"revision {revision} not found; pass an existing branch, tag or commit SHA"
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return f"the file is not published at {revision}"
    if isinstance(exc, errors.HFValidationError):
        return (
            "neither an existing directory nor a valid Hub repository id; "
            "fix the path, or pass a Hub id like owner/name"
        )
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it, or pass a local directory"
    if isinstance(exc, errors.HfHubHTTPError) and exc.response is not None:
        return (
            f"HTTP {exc.response.status_code} from {endpoint}; "
            "retry later, or pass a local directory"
        )
    return (
        f"cannot reach {endpoint} ({type(exc).__name__}: {_first_line(exc)}); "
        "check the network and HF_ENDPOINT, or pass a local directory"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

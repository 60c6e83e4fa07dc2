"""Tokenizer: a checkpoint's tokenizer.json, tokenizer_config.json and chat template.

This module owns turning text and chat messages into token ids (and ids back into text) the way
`transformers.AutoTokenizer.from_pretrained(directory)` (Transformers 5) does:

* `encode(text)` equals `tok(text)["input_ids"]` (add_special_tokens=True by default),
* `decode(ids, skip_special_tokens=...)` equals `tok.decode(ids, skip_special_tokens=...)`,
* `render_chat` / `apply_chat_template` equal `tok.apply_chat_template(..., tokenize=False)` and
  its token ids (rendered with Transformers' sandboxed Jinja environment, then encoded with
  add_special_tokens=False).

What it reads: tokenizer.json (through the `tokenizers` library), or where there is none PLaMo's
tokenizer.jsonl or the tiktoken rank file tokenizer_config.json's class reads (GLM-4's
tokenizer.model, Kimi's tiktoken.model); tokenizer_files.py builds those into the same `tokenizers`
pipeline. Also tokenizer_config.json, special_tokens_map.json (only when Transformers would: no
added_tokens_decoder in the config), config.json (model_type / tokenizer_class, to pick the class
Transformers would build), and the chat template from chat_template.jinja +
additional_chat_templates/*.jinja, else tokenizer_config.json, else chat_template.json
(Transformers' AutoTokenizer ignores that last file; processors read it, so ster_dist uses it only
when nothing else names a template).

Rendering is bounded (ster_dist/template_limits.py): a template that loops, grows a value, recurses
or floods its output is refused in one line within a time budget, on any thread.

What it never does: execute remote code (an `auto_map` in the config is ignored; tokenizer.json is
the tokenizer), read pickles or SentencePiece .model files.

How Transformers 5 decides special tokens: with a tokenizer.json present it drops add_bos_token /
add_eos_token from the config and keeps tokenizer.json's post-processor (TokenizersBackend). Which
class it builds, and the two classes (LlamaTokenizer, GPTNeoXTokenizer) that rebuild the pipeline
because their output differs from tokenizer.json's, are tokenizer_classes.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as _BackendTokenizer

from ster_dist.tokenizer.chat_template import _compile_chat_template, render
from ster_dist.config.file import json_limit
from ster_dist.errors import Refusal
from ster_dist.tokenizer import classes as tokenizer_classes
from ster_dist.tokenizer import files as tokenizer_files

CHAT_TEMPLATE_MODES = ("auto", "on", "off")

# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the named special tokens, in this order.
SPECIAL_TOKENS_ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# The keys of a serialized tokenizers.AddedToken.
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refusal(f"failed to read {what} {path}: {exc}") from None
    # json.loads' limits: too deep, or an integer too long
    except (ValueError, RecursionError) as exc:
        raise Refusal(
            f"failed to read {what} {path}: {json_limit(exc)}; correct it or re-download it"
        ) from None


def _token_content(value: Any) -> str | None:
    """The text of a special token given as a string, an AddedToken or a {"content": ...} dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, AddedToken):
        return value.content
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    """An AddedToken with a serialized token's flags; a bare string gets `special`."""
    if isinstance(value, AddedToken):
        return value
    if isinstance(value, str):
        # As TokenizersBackend does: AddedToken(str, special=True), whose normalized is not special.
        return AddedToken(value, special=special)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value and value[k] is not None}
        fields.setdefault("special", special)
        return AddedToken(**fields)
    return None


def _read_chat_templates(directory: Path, config: dict) -> tuple[str | dict[str, str] | None, str]:
    """The chat template(s) and where they came from, in Transformers' order of precedence."""
    templates: dict[str, str] = {}
    jinja_file = directory / "chat_template.jinja"
    try:
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = directory / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Refusal(f"failed to read the chat template in {directory}: {exc}") from None
    if len(templates) == 1 and "default" in templates:
        return templates["default"], str(jinja_file)
    if templates:
        return templates, str(directory / "additional_chat_templates")

    source = str(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if template is None:
        legacy_file = directory / "chat_template.json"
        if legacy_file.is_file():
            template = (_read_json(legacy_file, "chat template") or {}).get("chat_template")
            source = str(legacy_file)
    if template is None:
        return None, ""
    if isinstance(template, (list, tuple)):
        # Stored as a list of {"name", "template"}; Transformers rebuilds the dict.
        try:
            template = {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError):
            raise Refusal(
                f"chat_template in {source} is a list but not of {{name, template}} entries"
            ) from None
    if isinstance(template, Mapping):
        template = {str(k): v for k, v in template.items()}
        if not all(isinstance(v, str) for v in template.values()):
            raise Refusal(f"chat_template in {source} has a template that is not a string")
        return template, source
    if not isinstance(template, str):
        raise Refusal(
            f"chat_template in {source} is a {type(template).__name__}, not a template string"
        )
    return template, source


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode and chat prompts, as Transformers' AutoTokenizer."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        directory: Path,
        special_tokens: dict[str, str],
        chat_template: str | dict[str, str] | None,
        chat_template_source: str = "",
        clean_up_tokenization_spaces: bool = False,
        backend_class: str = "TokenizersBackend",
    ):
        self._backend = backend
        self.directory = Path(directory)
        # Named special tokens (bos_token, ..., model-specific *_token): also template variables.
        self.special_tokens_map: dict[str, str] = dict(special_tokens)
        self.chat_templates: dict[str, str] = (
            dict(chat_template)
            if isinstance(chat_template, Mapping)
            else ({"default": chat_template} if isinstance(chat_template, str) else {})
        )
        self.chat_template: str | None = self.chat_templates.get("default")
        self.chat_template_source = chat_template_source
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.backend_class = backend_class  # the Transformers class whose behaviour was replicated

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_directory(cls, directory: Path) -> Tokenizer:
        directory = Path(directory)
        config_file = directory / "tokenizer_config.json"
        config = _read_json(config_file, "tokenizer config") if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise Refusal(f"failed to read tokenizer config {config_file}: not a JSON object")
        config = dict(config)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            return cls._from_rank_file(directory, config)
        try:
            text = tokenizer_file.read_text(encoding="utf-8")
            backend = _BackendTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001  (the Rust parser raises a bare Exception)
            detail = " ".join(str(exc)[:2000].split())[:300] or type(exc).__name__
            raise Refusal(f"failed to load tokenizer {tokenizer_file}: {detail}") from None

        model_config_file = directory / "config.json"
        model_config = (
            _read_json(model_config_file, "model config") if model_config_file.is_file() else {}
        )
        if not isinstance(model_config, dict):
            model_config = {}

        backend_class = tokenizer_classes.resolve_class(config, model_config, text)
        # tokenizer.json's padding names a pad token Transformers uses when the config names none.
        padding_pad_token = (backend.padding or {}).get("pad_token")

        # additional_special_tokens is the pre-v5 name of extra_special_tokens.
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        added_entries = _added_token_entries(directory, config, backend)

        # The class constructor's default special tokens fill keys the config does not have.
        for key, value in tokenizer_classes.CLASS_DEFAULT_TOKENS.get(backend_class, {}).items():
            config.setdefault(key, value)

        backend = tokenizer_classes.rebuilt(backend_class, text, config, backend)

        if padding_pad_token is not None and "pad_token" not in config:
            config["pad_token"] = padding_pad_token
        return cls._finish(backend, directory, config, added_entries, backend_class)

    @classmethod
    def _from_rank_file(cls, directory: Path, config: dict) -> Tokenizer:
        """PLaMo's tokenizer.jsonl, or a tiktoken rank file its tokenizer_config.json's class reads
        (tokenizer_files.py), in place of tokenizer.json; refused, naming the file, for any
        other."""
        names = {entry.name for entry in directory.iterdir() if entry.is_file()} - {
            "tokenizer.json"
        }
        if not names & set(tokenizer_files.OTHER_FILES):
            raise Refusal(
                f"failed to load tokenizer {directory / 'tokenizer.json'}: file not found (ster_dist "
                "reads tokenizer.json, PLaMo's tokenizer.jsonl, or the tiktoken file of GLM-4 or Kimi; "
                "save the tokenizer with Transformers' save_pretrained)"
            )
        name = tokenizer_files.tokenizer_file(names, config.get("tokenizer_class"), str(directory))
        declared = tokenizer_files.class_name(config.get("tokenizer_class"))
        if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
            config["extra_special_tokens"] = config.pop("additional_special_tokens")
        added_entries = _added_token_entries(directory, config, _BackendTokenizer(models.BPE()))
        if name == tokenizer_files.PLAMO_FILE:
            backend = tokenizer_files.plamo_backend(directory / name, config)
            return cls._finish(
                backend, directory, config, added_entries, declared or "PlamoTokenizer"
            )
        added = {i: _token_content(t) for i, t in added_entries if _token_content(t) is not None}
        backend = tokenizer_files.tiktoken_backend(
            directory / name, tokenizer_files.TIKTOKEN_CLASSES[declared], added
        )
        return cls._finish(backend, directory, config, added_entries, declared)

    @classmethod
    def _finish(
        cls,
        backend: _BackendTokenizer,
        directory: Path,
        config: dict,
        added_entries: list[tuple[int, Any]],
        backend_class: str,
    ) -> Tokenizer:
        """Special and added tokens registered as TokenizersBackend does, then the chat template."""
        special_tokens = _collect_special_tokens(config)
        _register_added_tokens(
            backend, added_entries, special_tokens, _extra_special_tokens(config)
        )

        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        # `tok(text)` neither pads nor truncates unless asked, whatever tokenizer.json says.
        backend.no_truncation()
        backend.no_padding()

        chat_template, template_source = _read_chat_templates(directory, config)
        clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        if (
            clean_up
            and isinstance(backend.model, models.BPE)
            and not config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
            )
        ):
            clean_up = False  # Transformers skips the clean-up for BPE: it corrupts the text
        return cls(
            backend,
            directory=directory,
            special_tokens={k: _token_content(v) for k, v in special_tokens.items()},
            chat_template=chat_template,
            chat_template_source=template_source,
            clean_up_tokenization_spaces=clean_up,
            backend_class=backend_class,
        )

    # ---- ids and text --------------------------------------------------------------------

    @property
    def backend(self) -> _BackendTokenizer:
        """The `tokenizers.Tokenizer` doing the work (added tokens and post-processor applied)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """How many ids the tokenizer can produce: 1 + the largest id, added tokens included.

        This is len(AutoTokenizer) for a contiguous vocabulary (Transformers' `vocab_size` leaves
        out added tokens); a model's embedding must have at least this many rows.
        """
        vocab = self._backend.get_vocab(with_added_tokens=True)
        largest = max(vocab.values(), default=-1)
        return max(self._backend.get_vocab_size(with_added_tokens=True), largest + 1)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None and name != "unk_token":
            return self.unk_token_id  # Transformers' convert_tokens_to_ids falls back to unk
        return token_id

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every token the backend treats as special (what decode skips)."""
        return sorted(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`tok(text, add_special_tokens=...)["input_ids"]`."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """One id list per text, unpadded."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`tok.decode(ids, skip_special_tokens=...)` (note the default here skips them)."""
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = (
                text.replace(" .", ".")
                .replace(" ?", "?")
                .replace(" !", "!")
                .replace(" ,", ",")
                .replace(" ' ", "'")
                .replace(" n't", "n't")
                .replace(" 'm", "'m")
                .replace(" 's", "'s")
                .replace(" 've", "'ve")
                .replace(" 're", "'re")
            )
        return text

    # ---- chat ----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def _template(self) -> str:
        if self.chat_template is not None:
            return self.chat_template
        if self.chat_templates:
            raise Refusal(
                f"{self.chat_template_source} has several chat templates and none named 'default' "
                f"({', '.join(sorted(self.chat_templates))}): add a chat_template.jinja or use "
                "--chat-template off"
            )
        raise Refusal(
            f"{self.directory} has no chat template (tokenizer_config.json chat_template, "
            "chat_template.jinja or chat_template.json): use --chat-template off (or auto) "
            "for a plain prompt"
        )

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """`tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.

        Extra keyword arguments (e.g. enable_thinking=False) become template variables and
        override the special tokens of the same name, as in Transformers.
        """

        template = self._compile(self._template())
        return render(
            template,
            str(self.directory),
            self.special_tokens_map,
            messages,
            tools,
            documents,
            add_generation_prompt,
            template_kwargs,
        )

    def _compile(self, source: str):
        import jinja2

        try:
            return _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise Refusal(
                f"the chat template in {self.chat_template_source} does not parse "
                f"(line {exc.lineno}: "
                f"{exc.message}): fix it or use --chat-template off"
            ) from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """`tok.apply_chat_template(messages, tokenize=True, return_dict=False, ...)`.

        The rendered text is encoded without special tokens: the template writes its own.
        """
        return self.encode(
            self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )

    def prompt_ids(self, prompt: str, system: str | None, chat_template: str) -> list[int]:
        """The ids for a user prompt (and optional system prompt) under a --chat-template mode.

        "auto": the chat template when the tokenizer has one, else a plain encode (special
        tokens added). "on": the chat template, refused when there is none. "off": plain encode.
        A system prompt only exists inside a chat template, so with none it is refused rather
        than dropped.
        """
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise Refusal(
                f"--chat-template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, "
                f"got {chat_template!r}"
            )
        use_template = chat_template == "on" or (chat_template == "auto" and self.has_chat_template)
        if not use_template:
            if system is not None:
                reason = (
                    "the chat template is off"
                    if chat_template == "off"
                    else f"{self.directory} has no chat template"
                )
                raise Refusal(
                    f"a system prompt (--system) needs a chat template, but {reason}: drop --system"
                    + (" or use --chat-template auto" if chat_template == "off" else "")
                )
            return self.encode(prompt, add_special_tokens=True)
        messages = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": prompt})
        return self.apply_chat_template(messages, add_generation_prompt=True)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.directory)!r}, vocab_size={self.vocab_size}, "
            f"class={self.backend_class}, "
            f"chat_template={'yes' if self.has_chat_template else 'no'})"
        )


def _added_token_entries(
    directory: Path, config: dict, backend: _BackendTokenizer
) -> list[tuple[int, Any]]:
    """The added tokens Transformers re-registers, by id; merges special_tokens_map.json in.

    tokenization_utils_base._from_pretrained: the config's added_tokens_decoder when it has one;
    otherwise (older saves) tokenizer.json's added_tokens, with special_tokens_map.json's entries
    overriding the config's.
    """
    config_file = directory / "tokenizer_config.json"
    if "added_tokens_decoder" in config:
        added_decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(added_decoder, Mapping):
            raise Refusal(f"added_tokens_decoder in {config_file} is not an object")
        try:
            return sorted(((int(i), t) for i, t in added_decoder.items()), key=lambda x: x[0])
        except ValueError:
            raise Refusal(
                f"added_tokens_decoder in {config_file} has a key that is not a token id"
            ) from None
    map_file = directory / "special_tokens_map.json"
    special_map = _read_json(map_file, "special tokens map") if map_file.is_file() else None
    if isinstance(special_map, dict):
        for key, value in special_map.items():
            if isinstance(value, Mapping) and key != "extra_special_tokens":
                config[key] = {**value, "special": True}  # the map's tokens are special
            elif key == "extra_special_tokens" and isinstance(value, list):
                existing = list(config.get("extra_special_tokens") or [])
                seen = {_token_content(t) for t in existing}
                config["extra_special_tokens"] = existing + [
                    t for t in value if _token_content(t) not in seen
                ]
            else:
                config[key] = value
    # tokenizer.json's own added tokens (what the Rust parser registered from "added_tokens").
    return sorted(backend.get_added_tokens_decoder().items(), key=lambda x: x[0])


def _collect_special_tokens(config: dict) -> dict[str, Any]:
    """Named special tokens, then model-specific *_token keys, as PreTrainedTokenizerBase does."""
    tokens: dict[str, Any] = {}
    for key in SPECIAL_TOKENS_ATTRIBUTES:
        if _token_content(config.get(key)) is not None:
            tokens[key] = config[key]
    for key, value in config.items():
        # add_bos_token and friends end in _token too: only string/token values are tokens.
        if key in SPECIAL_TOKENS_ATTRIBUTES or not key.endswith("_token"):
            continue
        if _token_content(value) is not None:
            tokens[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            if _token_content(value) is not None:
                tokens[str(key)] = value
    return tokens


def _extra_special_tokens(config: dict) -> list[Any]:
    """The unnamed special tokens (extra_special_tokens as a list)."""
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping) or "extra_special_tokens" not in config:
        # A dict of named tokens went into the named map; then, like PreTrainedTokenizerBase,
        # fall back to the old name (special_tokens_map.json may have set it).
        extra = config.get("additional_special_tokens")
    if not isinstance(extra, (list, tuple)):
        return []
    return [t for t in extra if _token_content(t)]


def _register_added_tokens(
    backend: _BackendTokenizer,
    added_entries: list[tuple[int, Any]],
    special_tokens: dict[str, Any],
    extra_special: list[Any],
) -> None:
    """TokenizersBackend.__init__'s token registration, call for call.

    Re-add the config's added tokens (their flags win; ids follow the vocabulary, not the
    config), then every special token the backend does not hold as an added token yet, as a
    special one: a special token that is plain vocabulary (or new) thereby becomes an added
    token, which changes how text containing it encodes.
    """
    named = {_token_content(v) for v in special_tokens.values()}
    to_add: list[AddedToken] = []
    for _, entry in added_entries:
        token = _added_token(entry, special=False)
        if token is None:
            continue
        if not token.special and token.content in named:
            token.special = True
        to_add.append(token)
    encoder = {t.content for t in backend.get_added_tokens_decoder().values()}
    encoder |= {t.content for t in to_add}
    for value in [*special_tokens.values(), *extra_special]:
        content = _token_content(value)
        if content is None or content in encoder:
            continue
        token = _added_token(value, special=True)
        if token is None:
            continue
        if not token.special and content in named:
            token.special = True
        to_add.append(token)
        encoder.add(content)
    if to_add:
        backend.add_tokens(to_add)


__all__ = ["CHAT_TEMPLATE_MODES", "SPECIAL_TOKENS_ATTRIBUTES", "Tokenizer"]

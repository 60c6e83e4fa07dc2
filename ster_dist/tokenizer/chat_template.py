"""Chat templates: compiled in Transformers' sandboxed Jinja environment and rendered under limits.

Rendering follows transformers/utils/chat_template_utils.py. The limits (time, size, nesting,
template_limits.py) are checked at the points the sandbox intercepts (calls, filters, operators,
attribute and item lookups, loop steps, output), never by signals, so a render is bounded on any
thread: a template that loops, grows a value, recurses or floods its output is refused in one line
within TEMPLATE_SECONDS.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ster_dist.errors import Refusal
from ster_dist.tokenizer.template_limits import TemplateLimit, budget_for, bounded_environment_class

# ---- Chat template rendering: transformers/utils/chat_template_utils.py, replicated ----------

_JINJA_MIN = (3, 1, 6)  # older jinja2 has sandbox escapes; Transformers refuses it too


def _jinja2_version_ok(version: str) -> bool:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= _JINJA_MIN


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str):
    """Compile `source` in the environment Transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils

    if not _jinja2_version_ok(jinja2.__version__):
        raise Refusal(
            f"chat templates need jinja2>=3.1.6 (this is {jinja2.__version__}, which has sandbox "
            "escapes): pip install -U jinja2"
        )

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for Transformers' masks;
        # rendering it is just its body, but templates that use it must still parse.
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Transformers' own filter: Jinja's escapes HTML characters, this one does not.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # dict() without exposing the dict type to the template.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # namespace() that refuses underscore attributes (no reaching CPython internals).
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}."
                )

    # Transformers' ImmutableSandboxedEnvironment, with the limits above
    env = bounded_environment_class()(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.bound_filters()
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain_template_data(value: Any) -> Any:
    """What the template sees, rebuilt from plain JSON types as Transformers does (sandboxing)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # subclasses (enums...) can carry methods: strip to the base type
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_template_data(k): _plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_template_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_template_data(v) for v in value)
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return _plain_template_data(item())  # numpy scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if callable(getattr(value, "model_dump", None)):
        return _plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


# A message's reasoning, under the names templates read; the first is the standard one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Any) -> list[dict]:
    """Transformers' message normalization: dicts only, None values dropped, reasoning aliased."""
    if isinstance(messages, Mapping) or not isinstance(messages, (list, tuple)):
        raise Refusal("chat messages must be a list of {'role': ..., 'content': ...} dicts")
    prepared = []
    for message in messages:
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise Refusal(
                f"chat messages must be dicts with 'role' and 'content', got {message!r:.80}"
            )
        # APIs send content=None / tool_calls=None; templates handle a missing key, not None.
        message = _plain_template_data({k: v for k, v in message.items() if v is not None})
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def render(
    template,
    where: str,
    special_tokens: dict,
    messages,
    tools,
    documents,
    add_generation_prompt: bool,
    template_kwargs: dict,
) -> str:
    """A compiled template rendered over the messages, held to the limits above; any failure a
    one-line Refusal naming the template (`where`)."""
    import jinja2

    variables = _plain_template_data({**special_tokens, **template_kwargs})
    inputs = dict(
        messages=_prepare_messages(messages),
        tools=_plain_template_data(tools),
        documents=_plain_template_data(documents),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    try:
        with budget_for(inputs) as budget:
            parts, size = [], 0
            for part in template.generate(**inputs):  # the output is held to the budget as it grows
                size += len(part)
                budget.size(size, "an output")
                parts.append(part)
            return "".join(parts)
    except TemplateLimit as exc:
        raise Refusal(
            f"the chat template of {where} {exc.detail}; fix the template or pass "
            "--chat-template off"
        ) from None
    except RecursionError:
        raise Refusal(
            f"the chat template of {where} recursed past Python's stack; fix the template "
            "or pass --chat-template off"
        ) from None
    except MemoryError:
        raise Refusal(
            f"the chat template of {where} ran out of memory; fix the template or pass "
            "--chat-template off"
        ) from None
    except (
        jinja2.TemplateError,
        TypeError,
        ValueError,
        LookupError,
        ArithmeticError,
        AttributeError,
    ) as exc:
        # raise_exception() in the template, or messages the template cannot handle (say a
        # list content concatenated to a string).
        detail = " ".join(str(exc)[:2000].split())[:300] or type(exc).__name__
        raise Refusal(f"the chat template of {where} rejected the messages: {detail}") from None

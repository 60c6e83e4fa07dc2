"""Chat templates: compiled in Transformers' sandboxed Jinja environment and rendered under limits.

Rendering follows transformers/utils/chat_template_utils.py. The limits (time, size, nesting) are
checked at the points the sandbox intercepts (calls, filters, operators, attribute and item
lookups, loop steps, output), never by signals, so a render is bounded on any thread: a template
that loops, grows a value, recurses or floods its output is refused in one line within
TEMPLATE_SECONDS.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ster_dist.errors import Refusal

# ---- Chat template limits: time, size and nesting, checked where the sandbox intercepts -------
# A chat template is code from the checkpoint. Rendering runs on the token engine's and the
# server's threads, so no signal can stop it: the clock and the sizes are checked inside the
# sandbox's interception points instead (every call, filter, operator, attribute and item
# lookup, every step of a for-loop, every output). Operations that can grow a value many times
# over in one step (repetition, padding, formatting widths, joins) are projected before they run.

TEMPLATE_SECONDS = 10.0                 # wall time one render may take
TEMPLATE_MIN_CHARS = 4 << 20            # any value or output may reach this many characters...
TEMPLATE_INPUT_FACTOR = 8               # ...or this many times the size of what it was given
TEMPLATE_MAX_DEPTH = 60                 # nested template calls (a macro calling itself)
TEMPLATE_MAX_INT_BITS = 1 << 16         # a number's size (Python prints at most 4300 digits anyway)
_SAFE_RANGE = 100_000                   # jinja2.sandbox.MAX_RANGE: a range's items at most
_CONTEXT_BUDGET: contextvars.ContextVar = contextvars.ContextVar("chat_template_budget", default=None)
_DIGIT_RUN = re.compile(r"\d+")
# filters that write out a whole value (a literal list of large strings, say): its size is checked first
_SERIALISING_FILTERS = frozenset({"string", "pprint", "urlencode", "xmlattr", "escape", "e", "forceescape",
                                  "safe", "list"})
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


class _TemplateLimit(Exception):
    """A render went past one of its limits; `detail` completes 'the chat template of M ...'."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def _weight(value: Any, limit: int, known: dict[int, int] | None = None) -> int:
    """About how many characters `value` would take rendered; stops counting past `limit`. `known`:
    weights already counted, by id, of containers that stay alive and unchanged meanwhile."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if known and id(item) in known:
            total += known[id(item)]
        elif isinstance(item, str):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() * 3 // 10 + 1
        elif isinstance(item, (dict, list, tuple, set, frozenset, Mapping)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend(item.items() if isinstance(item, (dict, Mapping)) else item)
        else:
            total += 8
    return total


def _int_arg(values, default: int = 0) -> int:
    ints = [abs(v) for v in values if isinstance(v, int)]
    return max(ints, default=default)


class _Budget:
    """One render's limits: the deadline, the size any value may reach, the call depth."""

    def __init__(self, inputs: dict):
        self.seconds = TEMPLATE_SECONDS
        self.deadline = time.monotonic() + TEMPLATE_SECONDS
        self.depth = 0
        # The inputs and their items (each message, each tool) are measured once: the render holds
        # them and the sandbox cannot change them, so a template passing `tools` to tojson costs nothing.
        self.known: dict[int, int] = {}
        for value in inputs.values():
            if isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, (dict, list, tuple)):
                        self.known[id(item)] = _weight(item, 1 << 62)
            if isinstance(value, (dict, list, tuple)):
                self.known[id(value)] = _weight(value, 1 << 62, self.known)
        self.chars = max(TEMPLATE_MIN_CHARS, TEMPLATE_INPUT_FACTOR * _weight(inputs, 1 << 62, self.known))

    def weight(self, value: Any) -> int:
        return _weight(value, self.chars, self.known)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"ran past its {self.seconds:g} s budget")

    def size(self, chars: int, what: str) -> None:
        if chars > self.chars:
            raise _TemplateLimit(f"would build {what} of {chars} characters or more, past its budget of "
                                 f"{self.chars} ({TEMPLATE_MIN_CHARS}, or {TEMPLATE_INPUT_FACTOR}x the messages "
                                 "when larger)")

    def value(self, value: Any, what: str) -> Any:
        if not isinstance(value, str) or len(value) > self.chars:
            self.size(self.weight(value), what)
        return value

    def formatting(self, fmt: str, args: list, star: bool) -> None:
        """`fmt % args` or `fmt.format(*args)`: every field could take the largest argument, padded
        to the largest width written in the format (or passed as an argument, with `star`)."""
        runs = _DIGIT_RUN.findall(fmt)
        widest = max((10 ** 12 if len(r) > 12 else int(r) for r in runs), default=0)
        if star:
            widest = max(widest, _int_arg(args))
        fields = fmt.count("%") + fmt.count("{")
        self.size(len(fmt) + fields * (max((self.weight(a) for a in args), default=0) + widest),
                  "a formatted string")


def _format_args(value: Any) -> list:
    if isinstance(value, Mapping):
        return list(value.values())
    return list(value) if isinstance(value, tuple) else [value]


def _project_str_method(budget: _Budget, text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str method call whose result would pass the budget; returns the args to call with."""
    values = list(args) + [v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")]
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.size(max(len(text), _int_arg(values[:1])), f"a string padded by {name}")
    elif name == "expandtabs":
        budget.size(len(text) + text.count("\t") * _int_arg(values[:1], 8), "a string with tabs expanded")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        count = text.count(old) if old else len(text) + 1
        budget.size(len(text) + count * max(0, len(new) - len(old)), "a string with replacements")
    elif name == "join" and args:
        items = list(args[0])
        budget.size(sum(budget.weight(i) for i in items) + len(text) * len(items), "a joined string")
        args = (items, *args[1:])
    elif name in ("format", "format_map"):
        budget.formatting(text, [v for a in values for v in _format_args(a)] if name == "format_map" else values,
                          bool(_NESTED_FIELD.search(text)))
    elif name == "translate" and args and isinstance(args[0], Mapping):
        budget.size(len(text) * (1 + max((budget.weight(v) for v in args[0].values()), default=0)),
                    "a translated string")
    return args


def _project_filter(budget: _Budget, name: str, value: Any, args: tuple, kwargs: dict) -> Any:
    """Refuse a filter whose result would pass the budget; returns the value to filter."""
    def arg(index: int, key: str, default=None):
        return args[index] if len(args) > index else kwargs.get(key, default)

    if name in _SERIALISING_FILTERS:
        budget.value(value, "a filtered value")
    if name == "center":
        budget.size(_int_arg([arg(0, "width", 80)]), "a centred string")
    elif name == "indent" and isinstance(value, str):
        width = arg(0, "width", 4)
        lines = value.count("\n") + 1
        budget.size(len(value) + lines * (len(width) if isinstance(width, str) else _int_arg([width])),
                    "an indented string")
    elif name == "wordwrap" and isinstance(value, str):
        budget.size(len(value) * (1 + budget.weight(arg(2, "wrapstring", "\n"))), "a wrapped string")
    elif name == "format" and isinstance(value, str):
        budget.formatting(value, list(args) + list(kwargs.values()), "*" in value)
    elif name == "replace" and isinstance(value, str):
        _project_str_method(budget, value, "replace", args[:2], {})
    elif name == "join":
        value = list(value) if not isinstance(value, (str, Mapping)) else value
        budget.size(budget.weight(value) + budget.weight(arg(0, "d", "")) * len(value),
                    "a joined string")
    elif name in ("batch", "slice"):
        fill = arg(1, "fill_with")
        budget.size(_int_arg([arg(0, "linecount" if name == "batch" else "slices", 0)])
                    * (2 + budget.weight(fill)), f"the lists of {name}")
    elif name == "tojson":
        budget.size(budget.weight(value) * (1 + _int_arg([arg(1, "indent", 0) or 0])), "a JSON string")
    return value


def _bounded_range(*args):
    budget = _CONTEXT_BUDGET.get()
    if budget is not None:
        budget.tick()
    numbers = range(*args)
    if len(numbers) > _SAFE_RANGE:
        raise _TemplateLimit(f"asked for a range of {len(numbers)} items, past the sandbox's {_SAFE_RANGE}")
    return numbers


def _bounded_lorem(n: int = 5, html: bool = True, min: int = 20, max: int = 100):
    import jinja2.utils

    budget = _CONTEXT_BUDGET.get()
    if budget is not None:
        budget.size(_int_arg([n]) * _int_arg([max]) * 12, "lorem ipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


@functools.lru_cache(maxsize=1)
def _bounded_environment_class():
    """ImmutableSandboxedEnvironment with the limits above at its interception points."""
    import jinja2
    import jinja2.nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        # `a ~ b` and every for-loop are compiled through the environment, where they are bounded.
        def visit_Concat(self, node, frame):
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def visit_For(self, node, frame):
            if not getattr(node, "bounded", False):
                node.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter],
                                              [], None, None).set_lineno(node.lineno)
                node.bounded = True
            super().visit_For(node, frame)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

        def __init__(self, **options):
            super().__init__(**options, finalize=self._output)
            self.globals["range"] = _bounded_range
            self.globals["lipsum"] = _bounded_lorem

        def _output(self, value):
            budget = _CONTEXT_BUDGET.get()
            if budget is not None:
                budget.tick()
                budget.value(value, "an output")
            return value

        def concat(self, parts):
            parts = list(parts)
            budget = _CONTEXT_BUDGET.get()
            if budget is not None:
                budget.tick()
                budget.size(sum(map(len, parts)), "a joined string")
            return "".join(parts)

        def bounded_join(self, parts):
            return self.concat([str(p) for p in parts])

        def bounded_iter(self, iterable):
            budget = _CONTEXT_BUDGET.get()
            if budget is None:
                yield from iterable
                return
            for item in iterable:
                budget.tick()
                yield item

        def call_binop(self, context, operator, left, right):
            budget = _CONTEXT_BUDGET.get()
            if budget is not None:
                budget.tick()
                _project_binop(budget, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            budget = _CONTEXT_BUDGET.get()
            if budget is None:
                return super().call(context, obj, *args, **kwargs)
            budget.tick()
            method = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                args = _project_str_method(budget, owner, getattr(method, "__name__", ""), args, kwargs)
            budget.depth += 1
            try:
                if budget.depth > TEMPLATE_MAX_DEPTH:
                    raise _TemplateLimit(f"nested calls deeper than {TEMPLATE_MAX_DEPTH} (a macro calling itself?)")
                result = super().call(context, obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            return budget.value(result, "a call's result")

        def getattr(self, obj, attribute):
            budget = _CONTEXT_BUDGET.get()
            if budget is not None:
                budget.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            budget = _CONTEXT_BUDGET.get()
            if budget is not None:
                budget.tick()
            return super().getitem(obj, argument)

        def bound_filters(self):
            for name, func in list(self.filters.items()):
                self.filters[name] = _bounded_filter(name, func)

    return BoundedEnvironment


def _project_binop(budget: _Budget, operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            _bits(left.bit_length() + right.bit_length())
        elif isinstance(right, int) and isinstance(left, str):
            budget.size(len(left) * max(right, 0), "a repeated value")
        elif isinstance(right, int) and isinstance(left, (list, tuple)):
            budget.size(budget.weight(left) * max(right, 0), "a repeated value")
        elif isinstance(left, int) and isinstance(right, (str, list, tuple)):
            budget.size(budget.weight(right) * max(left, 0), "a repeated value")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _bits(left.bit_length() * right)
    elif operator == "+":
        if isinstance(left, str) and isinstance(right, str):
            budget.size(len(left) + len(right), "a sum")
        elif not (isinstance(left, (int, float)) and isinstance(right, (int, float))):  # numbers add bits, not digits
            budget.size(budget.weight(left) + budget.weight(right), "a sum")
    elif operator == "%" and isinstance(left, str):
        budget.formatting(left, _format_args(right), "*" in left)


def _bits(bits: int) -> None:
    # one multiplication of numbers this long takes microseconds; of millions of bits, seconds
    if bits > TEMPLATE_MAX_INT_BITS:
        raise _TemplateLimit(f"would build a number of {bits} bits, past its limit of {TEMPLATE_MAX_INT_BITS}")


def _bounded_filter(name: str, func):
    """`func` with its result (and, for filters that can grow a value, its inputs) held to the budget;
    it takes the context, so Jinja never runs it at compile time, outside any budget."""
    import jinja2

    passed = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    def bounded(context, value, *args, **kwargs):
        budget = _CONTEXT_BUDGET.get()
        if budget is not None:
            budget.tick()
            value = _project_filter(budget, name, value, args, kwargs)
        lead = {"context": (context,), "eval_context": (context.eval_ctx,),
                "environment": (context.environment,)}.get(passed, ())
        result = func(*lead, value, *args, **kwargs)
        # a string result is measured (free); a container's items were measured going in
        if budget is not None and isinstance(result, str):
            budget.size(len(result), f"the {name} filter's result")
        return result

    return jinja2.pass_context(functools.wraps(func)(bounded))


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
    env = _bounded_environment_class()(
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


def render(template, where: str, special_tokens: dict, messages, tools, documents, add_generation_prompt: bool,
           template_kwargs: dict) -> str:
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
    budget = _Budget(inputs)
    token = _CONTEXT_BUDGET.set(budget)
    try:
        parts, size = [], 0
        for part in template.generate(**inputs):  # the output is held to the budget as it grows
            size += len(part)
            budget.size(size, "an output")
            parts.append(part)
        return "".join(parts)
    except _TemplateLimit as exc:
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
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError,
            AttributeError) as exc:
        # raise_exception() in the template, or messages the template cannot handle (say a
        # list content concatenated to a string).
        detail = " ".join(str(exc)[:2000].split())[:300] or type(exc).__name__
        raise Refusal(
            f"the chat template of {where} rejected the messages: {detail}"
        ) from None
    finally:
        _CONTEXT_BUDGET.reset(token)

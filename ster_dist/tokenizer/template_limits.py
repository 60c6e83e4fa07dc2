"""A chat template's limits: time, size and nesting, checked where Jinja's sandbox intercepts.

A chat template is code from the checkpoint. Rendering runs on the token engine's and the server's
threads, so no signal can stop it: the clock and the sizes are checked inside the sandbox's
interception points instead (every call, filter, operator, attribute and item lookup, every step of
a for-loop, every output). Operations that can grow a value many times over in one step (repetition,
padding, formatting widths, joins) are projected before they run. chat_template.py compiles
templates in `bounded_environment_class()` and renders each under
`budget_for(inputs)`; a limit reached raises TemplateLimit, which it refuses in one line.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Mapping
from typing import Any

TEMPLATE_SECONDS = 10.0  # wall time one render may take
TEMPLATE_MIN_CHARS = 4 << 20  # any value or output may reach this many characters...
TEMPLATE_INPUT_FACTOR = 8  # ...or this many times the size of what it was given
TEMPLATE_MAX_DEPTH = 60  # nested template calls (a macro calling itself)
TEMPLATE_MAX_INT_BITS = 1 << 16  # a number's size (Python prints at most 4300 digits anyway)
_SAFE_RANGE = 100_000  # jinja2.sandbox.MAX_RANGE: a range's items at most
_CONTEXT_BUDGET: contextvars.ContextVar = contextvars.ContextVar(
    "chat_template_budget", default=None
)
_DIGIT_RUN = re.compile(r"\d+")
# filters that write out a whole value (a literal list of large strings, say): its size is checked
# first
_SERIALISING_FILTERS = frozenset(
    {"string", "pprint", "urlencode", "xmlattr", "escape", "e", "forceescape", "safe", "list"}
)
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")


class TemplateLimit(Exception):
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
        # them and the sandbox cannot change them, so a template passing `tools` to tojson costs
        # nothing.
        self.known: dict[int, int] = {}
        for value in inputs.values():
            if isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, (dict, list, tuple)):
                        self.known[id(item)] = _weight(item, 1 << 62)
            if isinstance(value, (dict, list, tuple)):
                self.known[id(value)] = _weight(value, 1 << 62, self.known)
        self.chars = max(
            TEMPLATE_MIN_CHARS, TEMPLATE_INPUT_FACTOR * _weight(inputs, 1 << 62, self.known)
        )

    def weight(self, value: Any) -> int:
        return _weight(value, self.chars, self.known)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"ran past its {self.seconds:g} s budget")

    def size(self, chars: int, what: str) -> None:
        if chars > self.chars:
            raise TemplateLimit(
                f"would build {what} of {chars} characters or more, past its budget of "
                f"{self.chars} ({TEMPLATE_MIN_CHARS}, or {TEMPLATE_INPUT_FACTOR}x the messages "
                "when larger)"
            )

    def value(self, value: Any, what: str) -> Any:
        if not isinstance(value, str) or len(value) > self.chars:
            self.size(self.weight(value), what)
        return value

    def formatting(self, fmt: str, args: list, star: bool) -> None:
        """`fmt % args` or `fmt.format(*args)`: every field could take the largest argument, padded
        to the largest width written in the format (or passed as an argument, with `star`)."""
        runs = _DIGIT_RUN.findall(fmt)
        widest = max((10**12 if len(r) > 12 else int(r) for r in runs), default=0)
        if star:
            widest = max(widest, _int_arg(args))
        fields = fmt.count("%") + fmt.count("{")
        self.size(
            len(fmt) + fields * (max((self.weight(a) for a in args), default=0) + widest),
            "a formatted string",
        )


def _format_args(value: Any) -> list:
    if isinstance(value, Mapping):
        return list(value.values())
    return list(value) if isinstance(value, tuple) else [value]


def _project_str_method(budget: _Budget, text: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str method call whose result would pass the budget; returns the args to call
    with."""
    values = list(args) + [v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")]
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.size(max(len(text), _int_arg(values[:1])), f"a string padded by {name}")
    elif name == "expandtabs":
        budget.size(
            len(text) + text.count("\t") * _int_arg(values[:1], 8), "a string with tabs expanded"
        )
    elif (
        name == "replace"
        and len(args) >= 2
        and isinstance(args[0], str)
        and isinstance(args[1], str)
    ):
        old, new = args[0], args[1]
        count = text.count(old) if old else len(text) + 1
        budget.size(len(text) + count * max(0, len(new) - len(old)), "a string with replacements")
    elif name == "join" and args:
        items = list(args[0])
        budget.size(
            sum(budget.weight(i) for i in items) + len(text) * len(items), "a joined string"
        )
        args = (items, *args[1:])
    elif name in ("format", "format_map"):
        budget.formatting(
            text,
            [v for a in values for v in _format_args(a)] if name == "format_map" else values,
            bool(_NESTED_FIELD.search(text)),
        )
    elif name == "translate" and args and isinstance(args[0], Mapping):
        budget.size(
            len(text) * (1 + max((budget.weight(v) for v in args[0].values()), default=0)),
            "a translated string",
        )
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
        budget.size(
            len(value) + lines * (len(width) if isinstance(width, str) else _int_arg([width])),
            "an indented string",
        )
    elif name == "wordwrap" and isinstance(value, str):
        budget.size(
            len(value) * (1 + budget.weight(arg(2, "wrapstring", "\n"))), "a wrapped string"
        )
    elif name == "format" and isinstance(value, str):
        budget.formatting(value, list(args) + list(kwargs.values()), "*" in value)
    elif name == "replace" and isinstance(value, str):
        _project_str_method(budget, value, "replace", args[:2], {})
    elif name == "join":
        value = list(value) if not isinstance(value, (str, Mapping)) else value
        budget.size(
            budget.weight(value) + budget.weight(arg(0, "d", "")) * len(value), "a joined string"
        )
    elif name in ("batch", "slice"):
        fill = arg(1, "fill_with")
        budget.size(
            _int_arg([arg(0, "linecount" if name == "batch" else "slices", 0)])
            * (2 + budget.weight(fill)),
            f"the lists of {name}",
        )
    elif name == "tojson":
        budget.size(
            budget.weight(value) * (1 + _int_arg([arg(1, "indent", 0) or 0])), "a JSON string"
        )
    return value


def _bounded_range(*args):
    budget = _CONTEXT_BUDGET.get()
    if budget is not None:
        budget.tick()
    numbers = range(*args)
    if len(numbers) > _SAFE_RANGE:
        raise TemplateLimit(
            f"asked for a range of {len(numbers)} items, past the sandbox's {_SAFE_RANGE}"
        )
    return numbers


def _bounded_lorem(n: int = 5, html: bool = True, min: int = 20, max: int = 100):
    import jinja2.utils

    budget = _CONTEXT_BUDGET.get()
    if budget is not None:
        budget.size(_int_arg([n]) * _int_arg([max]) * 12, "lorem ipsum")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


@functools.lru_cache(maxsize=1)
def bounded_environment_class():
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
                node.iter = jinja2.nodes.Call(
                    jinja2.nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None
                ).set_lineno(node.lineno)
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
                args = _project_str_method(
                    budget, owner, getattr(method, "__name__", ""), args, kwargs
                )
            budget.depth += 1
            try:
                if budget.depth > TEMPLATE_MAX_DEPTH:
                    raise TemplateLimit(
                        f"nested calls deeper than {TEMPLATE_MAX_DEPTH} (a macro calling itself?)"
                    )
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
        # numbers add bits, not digits
        elif not (isinstance(left, (int, float)) and isinstance(right, (int, float))):
            budget.size(budget.weight(left) + budget.weight(right), "a sum")
    elif operator == "%" and isinstance(left, str):
        budget.formatting(left, _format_args(right), "*" in left)


def _bits(bits: int) -> None:
    # one multiplication of numbers this long takes microseconds; of millions of bits, seconds
    if bits > TEMPLATE_MAX_INT_BITS:
        raise TemplateLimit(
            f"would build a number of {bits} bits, past its limit of {TEMPLATE_MAX_INT_BITS}"
        )


def _bounded_filter(name: str, func):
    """`func` with its result (and, for filters that can grow a value, its inputs) held to the
    budget; it takes the context, so Jinja never runs it at compile time, outside any budget."""
    import jinja2

    passed = getattr(getattr(func, "jinja_pass_arg", None), "name", None)

    def bounded(context, value, *args, **kwargs):
        budget = _CONTEXT_BUDGET.get()
        if budget is not None:
            budget.tick()
            value = _project_filter(budget, name, value, args, kwargs)
        lead = {
            "context": (context,),
            "eval_context": (context.eval_ctx,),
            "environment": (context.environment,),
        }.get(passed, ())
        result = func(*lead, value, *args, **kwargs)
        # a string result is measured (free); a container's items were measured going in
        if budget is not None and isinstance(result, str):
            budget.size(len(result), f"the {name} filter's result")
        return result

    return jinja2.pass_context(functools.wraps(func)(bounded))


@contextlib.contextmanager
def budget_for(inputs: dict):
    """One render's budget over `inputs`, seen by every interception point on this thread (or task)
    meanwhile."""
    budget = _Budget(inputs)
    token = _CONTEXT_BUDGET.set(budget)
    try:
        yield budget
    finally:
        _CONTEXT_BUDGET.reset(token)

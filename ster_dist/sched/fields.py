"""How a job spec's fields are checked and converted: by the argparse action of the CLI flag
they stand for (its type, choices, nargs, switches), so a spec and a command line can never mean
different things. Used by ster_dist.protocol."""

from __future__ import annotations

import argparse
import json
import math

from ster_dist.errors import Refusal


def required(action: argparse.Action) -> bool:
    if action.option_strings:
        return bool(action.required)
    return action.nargs not in ("?", "*") and action.default is None


def check_value(kind: str, dest: str, action: argparse.Action, value) -> None:
    where = f"job spec field {dest!r}"
    if isinstance(action, argparse._CountAction):
        if not is_int(value) or value < 0:
            raise Refusal(f"{where} must be a count (an integer, zero or more), got {shown(value)}")
        return
    if action.nargs == 0:  # store_true / store_false / store_const / BooleanOptionalAction
        if not isinstance(value, bool):
            raise Refusal(f"{where} is a switch and must be true or false, got {shown(value)}")
        return
    if value is None:
        if action.default is None and not required(action):
            return
        raise Refusal(f"{where} may not be null; give a value or leave the field out")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and comma_list(action):
        return  # one number of a list flag: its text
    if isinstance(value, list) and comma_list(action):
        if not value or not all(isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
            raise Refusal(f"{where} must be a non-empty list of numbers or names, or their comma-separated text, "
                          f"got {shown(value)}")
        return
    many = action.nargs in ("*", "+") or isinstance(action.nargs, int) or isinstance(action, argparse._AppendAction)
    if many:
        if not isinstance(value, list):
            raise Refusal(f"{where} must be a list, got {shown(value)}")
        if action.nargs == "+" and not value:
            raise Refusal(f"{where} must list at least one value")
        if isinstance(action.nargs, int) and len(value) != action.nargs:
            raise Refusal(f"{where} must list exactly {action.nargs} values, got {len(value)}")
        for item in value:
            _check_scalar(where, action, item)
        return
    _check_scalar(where, action, value)


def _check_scalar(where: str, action: argparse.Action, value) -> None:
    kind = action.type
    if kind is int:
        if not is_int(value):
            raise Refusal(f"{where} must be an integer, got {shown(value)}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Refusal(f"{where} must be a finite number, got {shown(value)}")
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise Refusal(f"{where} must be a string, got {shown(value)}")
    else:  # a converting type (a path, a parser function): it takes the text the CLI would pass
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise Refusal(f"{where} must be a string, got {shown(value)}")
        try:
            kind(str(value) if not isinstance(value, str) else value)
        except Refusal as refusal:
            raise Refusal(f"{where}: {refusal}") from None
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise Refusal(f"{where} is not valid: {exc}") from None
    if action.choices is not None and convert(action, value) not in action.choices:
        raise Refusal(f"{where} must be one of {', '.join(map(str, action.choices))}, got {shown(value)}")


def comma_list(action: argparse.Action) -> bool:
    """A text flag that takes a comma-separated list (--layers 8,9 / --strengths=-1,0.5): a spec may
    give it as a list, joined with commas for the command."""
    return action.nargs is None and action.type in (None, str) and "comma" in (action.help or "")


def convert(action: argparse.Action, value):
    if isinstance(value, (list, int, float)) and not isinstance(value, bool) and comma_list(action):
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)
    if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse._StoreTrueAction) \
            and not isinstance(action, argparse._StoreFalseAction):
        return action.const if value else action.default
    if isinstance(action, argparse._StoreFalseAction):
        return not value
    if value is None or action.nargs == 0:
        return value
    kind = action.type
    one = (lambda v: v) if kind in (None, str, int) else (float if kind is float else kind)
    return [one(v) for v in value] if isinstance(value, list) else one(value)


def default(action: argparse.Action):
    default = action.default
    if isinstance(default, str) and action.type not in (None, str):
        return action.type(default)  # argparse converts string defaults through the type as well
    return default



def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def kind_of_value(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "null", bytes: "bytes"}.get(type(value), type(value).__name__)


def shown(value) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, bytes) else repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind_of_value(value)} {text}"

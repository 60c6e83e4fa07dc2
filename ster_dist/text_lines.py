"""`--text`: a command's JSON answer as `path: value` lines, one per leaf, for a person.

The path is the leaf's place in the document: object keys joined by `.`, list items as `[i]`
(`layers[0].norm: 1.0`). A value is printed as JSON would print it, a string without its quotes,
so the lines carry exactly the document's answer; an empty list or object is one line of its own
(`metadata: {}`) so that no field disappears.
"""

from __future__ import annotations

import json


def text_lines(document) -> list[str]:
    lines: list[str] = []
    _walk(document, "", lines)
    return lines


def _walk(value, path: str, lines: list[str]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _walk(item, f"{path}.{key}" if path else str(key), lines)
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            _walk(item, f"{path}[{index}]", lines)
    else:
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        lines.append(f"{path}: {shown}" if path else shown)

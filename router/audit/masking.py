"""OPA-style masking of audit events: values at given paths erased or replaced by their sha256
before the event is hashed and written, so masked data never enters the log."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

Rule = tuple[str, bool]
"""A path (``/input/args/card``; ``*`` matches any key or list index) and whether to hash (True)
or erase (False) the value there."""

ERASED = "[masked]"


def mask(document: dict[str, Any], rules: Sequence[Rule]) -> tuple[dict[str, Any], list[str]]:
    """``document`` with every rule applied (copied where changed), and the paths masked."""
    masked: list[str] = []
    for path, hashed in rules:
        document = _apply(document, path.strip("/").split("/"), hashed, "", masked)
    return document, masked


def _apply(value: Any, steps: list[str], hashed: bool, where: str, masked: list[str]) -> Any:
    if not steps:
        masked.append(where)
        if not hashed:
            return ERASED
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return "sha256:" + hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()
    step, rest = steps[0], steps[1:]
    if isinstance(value, dict):
        keys = list(value) if step == "*" else [step] if step in value else []
        if not keys:
            return value
        copy = dict(value)
        for key in keys:
            copy[key] = _apply(value[key], rest, hashed, f"{where}/{key}", masked)
        return copy
    if isinstance(value, list):
        indexes = range(len(value)) if step == "*" else [int(step)] if step.isdigit() and int(step) < len(value) else []
        if not indexes:
            return value
        items = list(value)
        for index in indexes:
            items[index] = _apply(value[index], rest, hashed, f"{where}/{index}", masked)
        return items
    return value

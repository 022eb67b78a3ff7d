"""Text that UTF-8 cannot hold: strings with lone surrogates (``"\\ud800"`` from a JSON escape, or an
undecodable file name decoded with ``surrogateescape``). Python strings can carry them; no file,
socket or hash input can. The audit log escapes them (deterministically, and says where); the
pipeline refuses them in what callers send, naming the field."""

from __future__ import annotations

from typing import Any

from router.errors import FieldProblem, InvalidCall

__all__ = ["check_text", "encodable", "escape_invalid_text", "first_invalid_text", "json_escape"]


def check_text(value: Any, field: str) -> None:
    """Refuse text UTF-8 cannot hold in what a caller sent (no tool, policy or log could take it).

    Raises:
        InvalidCall: naming the first field that holds such text, and the fix.
    """
    where = first_invalid_text(value, field)
    if where is not None:
        raise InvalidCall(
            f"{where} holds a lone surrogate, which is not Unicode text: send valid UTF-8 "
            "(binary data as base64, or as an input file)",
            [FieldProblem(where, "not valid Unicode text")],
        )


def first_invalid_text(value: Any, path: str = "") -> str | None:
    """The JSON path of the first string or key in ``value`` that UTF-8 cannot encode, else None.
    Iterative: a value nested deeper than the recursion limit is walked too. Linear: each node
    keeps its parent and its step from it, and only the path found is spelled out (a path per
    node would cost the square of the depth)."""
    steps: list[tuple[int, Any, bool]] = []  # (parent's index, key or list index, whether a key)
    stack: list[tuple[Any, int]] = [(value, -1)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and not encodable(item):
                return _spelled(steps, at, path) or "$"
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not key.isascii() and not encodable(key):
                    where = _spelled(steps, at, path)
                    return f"{where}.{key!r}" if where else repr(key)
                steps.append((at, key, True))
                stack.append((child, len(steps) - 1))
        elif isinstance(item, (list, tuple)):
            for i, child in enumerate(item):
                steps.append((at, i, False))
                stack.append((child, len(steps) - 1))
    return None


def _spelled(steps: list[tuple[int, Any, bool]], at: int, path: str) -> str:
    """The path of node ``at`` (see `first_invalid_text`), from ``path``: ``a.b[0]``."""
    chain = []
    while at >= 0:
        at, step, is_key = steps[at][0], steps[at][1], steps[at][2]
        chain.append((step, is_key))
    where = path
    for step, is_key in reversed(chain):
        where = (f"{where}.{step}" if where else str(step)) if is_key else f"{where}[{step}]"
    return where


def encodable(text: str) -> bool:
    """Whether UTF-8 can hold ``text`` (it holds no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def escape_invalid_text(value: Any, path: str, escaped: list[str]) -> Any:
    """``value`` with every string and key that UTF-8 cannot encode (lone surrogates) replaced by
    its backslash escape; the JSON path of each appended to ``escaped``. The value itself when
    nothing needed escaping, so the common case allocates nothing."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode()
        except UnicodeEncodeError:
            escaped.append(path or "$")
            return value.encode("utf-8", "backslashreplace").decode()
        return value
    if isinstance(value, dict):
        changed: dict[str, Any] | None = None
        for key, item in value.items():
            new_key = escape_invalid_text(key, f"{path}.{key!r}" if path else repr(key), escaped)
            new_item = escape_invalid_text(item, f"{path}.{new_key}" if path else new_key, escaped)
            if changed is None and (new_key is not key or new_item is not item):
                changed = dict(list(value.items())[: list(value).index(key)])
            if changed is not None:
                changed[new_key] = new_item
        return value if changed is None else changed
    if isinstance(value, list):
        items = [escape_invalid_text(item, f"{path}[{i}]", escaped) for i, item in enumerate(value)]
        return value if all(new is old for new, old in zip(items, value, strict=True)) else items
    return value


def json_escape(char: str) -> str:
    """``char`` as a JSON escape (``\\u202e``; a surrogate pair beyond the BMP, as JSON writes it):
    how a human is shown a character that would hide, reorder or fake text around it."""
    code = ord(char)
    if code > 0xFFFF:
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"

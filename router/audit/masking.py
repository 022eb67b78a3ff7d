"""OPA-style masking of audit events: values at given paths erased or replaced by a keyed hash
before the event is hashed and written, so masked data never enters the log.

A rule's path is a JSON Pointer (RFC 6901: ``~1`` is a ``/`` inside a key, ``~0`` a ``~``) into the
event, where a ``*`` step matches any key or list index. A hashed value is ``hmac-sha256:<hex>``,
HMAC-SHA256 under the log's masking key (`load_or_create_key`, kept beside its signing key, off the
log's volume): equal values give equal hashes within one log, so events can still be joined on them,
but no one holding the log alone can test guesses against them (a 4-digit PIN has 10,000). The paths
masked are recorded as JSON Pointers too (`masked_paths`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

__all__ = [
    "ERASED",
    "Rule",
    "load_or_create_key",
    "mask",
    "masked_paths",
    "pointer_problem",
    "pointer_steps",
]

Rule = tuple[str, bool]
"""A path (``/input/args/card``; ``*`` matches any key or list index) and whether to hash (True)
or erase (False) the value there."""

ERASED = "[masked]"
_KEY_BYTES = 32
_KEY_TEXT = re.compile(r"[0-9a-f]{64}\n?")
_INDEX = re.compile(r"0|[1-9][0-9]*")  # RFC 6901 array index: no sign, no leading zero


def pointer_steps(path: str) -> list[str]:
    """The reference tokens of a JSON Pointer (``/input/args/a~1b`` -> input, args, a/b), unescaped."""
    return [token.replace("~1", "/").replace("~0", "~") for token in path.split("/")[1:]]


def pointer_problem(path: str) -> str | None:
    """Why a mask rule's path can never match anything (None: it can). A ``~`` not followed by 0
    or 1 is no JSON Pointer; ``-`` names the item after a list's last one, which never exists; and
    a list index counts from 0, so ``-1`` would only ever name a key called "-1", never the last item."""
    for step in path.split("/")[1:]:
        if re.search(r"~(?![01])", step):
            return f"{step!r} holds a '~' that is not '~0' (a '~') or '~1' (a '/'): RFC 6901"
        if step == "-":
            return "'-' names the item after a list's last one, which never exists: name the index, or '*'"
        if re.fullmatch(r"-[0-9]+", step):
            return f"{step!r} is no list index (they count from 0, no negative ones): name the index, or '*'"
    return None


def _escaped(key: str) -> str:
    """One step of a recorded path: RFC 6901's escapes, then ``%`` and ``,`` percent-encoded (as in
    a pointer's URI fragment form, RFC 6901 §6), so the list of paths splits on ``,``."""
    return key.replace("~", "~0").replace("/", "~1").replace("%", "%25").replace(",", "%2C")


def masked_paths(label: str) -> list[str]:
    """The JSON Pointers a ``labels.masked`` value names: split on ``,``, each percent-decoded."""
    return [unquote(path) for path in label.split(",") if path]


def mask(document: dict[str, Any], rules: Sequence[Rule], key: bytes | None = None) -> tuple[dict[str, Any], list[str]]:
    """``document`` with every rule applied (copied where changed), and the paths masked, each a JSON
    Pointer with ``%`` and ``,`` percent-encoded (`masked_paths` reads them back). ``key``: the log's
    masking key, which hashed values are an HMAC under; without one they are a plain sha256, which
    anyone can test guesses against (only for callers that predate the key)."""
    masked: list[str] = []
    for path, hashed in rules:
        document = _apply(document, pointer_steps(path), hashed, key, "", masked)
    return document, masked


def _hashed(value: Any, key: bytes | None) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    data = text.encode(errors="surrogatepass")
    if key is None:
        return "sha256:" + hashlib.sha256(data).hexdigest()
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


def _apply(value: Any, steps: list[str], hashed: bool, key: bytes | None, where: str, masked: list[str]) -> Any:
    if not steps:
        masked.append(where)
        return _hashed(value, key) if hashed else ERASED
    step, rest = steps[0], steps[1:]
    if isinstance(value, dict):
        keys = list(value) if step == "*" else [step] if step in value else []
        if not keys:
            return value
        copy = dict(value)
        for name in keys:
            copy[name] = _apply(value[name], rest, hashed, key, f"{where}/{_escaped(name)}", masked)
        return copy
    if isinstance(value, list):
        wanted = range(len(value)) if step == "*" else [int(step)] if _INDEX.fullmatch(step) else []
        indexes = [i for i in wanted if i < len(value)]
        if not indexes:
            return value
        items = list(value)
        for index in indexes:
            items[index] = _apply(value[index], rest, hashed, key, f"{where}/{index}", masked)
        return items
    return value


def load_or_create_key(path: Path) -> bytes:
    """The log's masking key: 32 random bytes, kept hex-encoded at ``path`` (mode 0600; made on first
    use, in a 0700 directory if the directory is new), beside the signing key and off the log's volume:
    whoever reads the log must not hold it, or hashed values are as easy to guess as plain sha256.

    Raises:
        ValueError: the key file is readable by group or others, or holds no key (naming the fix).
        OSError: it cannot be read or made.
    """
    from router.audit.checkpoint import create_private_file  # noqa: PLC0415  (only where keys are made)

    path = Path(path)
    if not path.exists():
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.parent.chmod(0o700)  # mkdir's mode is filtered by the umask
        # Two processes making it at once end up sharing the one written first.
        create_private_file(path, secrets.token_hex(_KEY_BYTES).encode() + b"\n")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ValueError(
            f"audit masking key {path} is accessible by group or others (mode {mode:04o}); run `chmod 600 {path}`"
        )
    text = path.read_text(encoding="ascii", errors="replace")
    if not _KEY_TEXT.fullmatch(text):
        raise ValueError(
            f"audit masking key {path} does not hold 64 hex characters; restore it from a backup (a new key "
            "makes new hashes: values hashed before no longer match), or move it away to have one generated"
        )
    return bytes.fromhex(text.strip())

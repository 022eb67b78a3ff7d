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
    anyone can test guesses against (only for callers that predate the key).

    A rule on an argument (``/input/args/...``) masks the argument wherever the event carries it,
    not only at its path: what provenance made of it (``input.values.<arg>`` and
    ``input.provenance.<arg>``, the identifiers read from it) is masked alike; every quotation of a
    masked value, or of an identifier read from it, in the result's messages (a policy's reasons,
    a schema error) is replaced by ``[masked]``; and the digests of a call's arguments
    (``binding``, ``args_sha256``: an approval's, a credential's) are keyed, since a digest of a
    few arguments can be reversed by trying each value."""
    masked: list[str] = []
    originals: list[Any] = []
    for path, hashed in rules:
        steps = pointer_steps(path)
        taken: list[Any] | None = originals if steps[:2] == ["input", "args"] else None
        document = _apply(document, steps, hashed, key, "", masked, taken)
        if taken is not None and len(steps) > 2:
            for derived in ("values", "provenance"):
                inputs = document.get("input")
                held = inputs.get(derived) if isinstance(inputs, dict) else None
                if isinstance(held, dict):
                    originals.extend(_identifiers(held, steps[2]))
                document = _apply(document, ["input", derived, steps[2]], hashed, key, "", masked, None)
    arguments = [name for path, _ in rules if (name := _argument(pointer_steps(path))) is not None]
    if arguments:
        document = _keyed_digests(document, key, masked)
        document = _masked_problems(document, arguments, masked)
    quoted = _quotations(originals)
    if quoted is not None:
        document = _scrubbed_messages(document, quoted, masked)
    streams = {name for path, _ in rules for name in _streams(pointer_steps(path))}
    if streams:
        document = _keyed_stream_digests(document, streams, key, masked)
    return document, masked


_STREAMS = ("stdout", "stderr", "output")  # each recorded beside its digest, ``<name>_sha256``


def _streams(steps: list[str]) -> list[str]:
    """The outputs a rule's path masks: a sandboxed run's ``stdout`` and ``stderr``, an external
    tool's reported ``output``."""
    if not steps or steps[0] not in ("result", "*"):
        return []
    if len(steps) == 1 or steps[1] == "*":
        return list(_STREAMS)
    return [steps[1]] if steps[1] in _STREAMS else []


def _keyed_stream_digests(document: dict[str, Any], streams: set[str], key: bytes | None,
                          masked: list[str]) -> dict[str, Any]:  # fmt: skip
    """``document`` with the digest of each masked output (``result.stdout_sha256``) keyed, or
    erased without a key: a plain digest of a masked output lets anyone test guesses at it."""
    result = document.get("result")
    if not isinstance(result, dict):
        return document
    changed = dict(result)
    for stream in sorted(streams):
        digest = result.get(f"{stream}_sha256")
        if isinstance(digest, str) and not digest.startswith("hmac-sha256:"):
            changed[f"{stream}_sha256"] = _keyed(digest, key)
            masked.append(f"/result/{stream}_sha256")
    return {**document, "result": changed} if changed != result else document


def _argument(steps: list[str]) -> str | None:
    """The argument a rule's path masks: its name; ``*`` for any, or for all of them (a rule on
    ``/input/args`` itself, or on ``/input``); None if it masks no argument."""
    if not all(step in ("*", wanted) for step, wanted in zip(steps[:2], ("input", "args"), strict=False)):
        return None
    return steps[2] if len(steps) > 2 else "*"


def _identifiers(held: dict[str, Any], arg: str) -> list[str]:
    """The identifiers provenance read from argument ``arg`` (``*``: any), as policy messages quote
    them: each key whole (``e:bob@example.com``) and without its kind (``bob@example.com``)."""
    found: list[str] = []
    for name, items in held.items():
        if arg not in ("*", name) or not isinstance(items, list):
            continue
        for item in items:
            text = item.get("key") if isinstance(item, dict) else None
            if isinstance(text, str):
                found.append(text)
                found.append(text.partition(":")[2])
    return found


def _leaves(value: Any) -> list[str]:
    """The text of every scalar in a masked value, in the forms a message quotes it (as it is, as
    Python's repr writes it, as JSON writes it)."""
    if isinstance(value, dict):
        return [text for item in value.values() for text in _leaves(item)]
    if isinstance(value, list):
        return [text for item in value for text in _leaves(item)]
    if value is None or isinstance(value, bool):
        return []
    text = value if isinstance(value, str) else json.dumps(value)
    return [text, repr(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]]


def _quotations(originals: list[Any]) -> re.Pattern[str] | None:
    """One pattern matching each masked value's text where it stands as a token of its own (not a
    part of a longer word: a masked "2026" must not eat a date), longest first; None if none."""
    texts = {text for value in originals for text in _leaves(value) if len(text.strip()) >= 2}
    if not texts:
        return None
    alternatives = "|".join(re.escape(text) for text in sorted(texts, key=len, reverse=True))
    return re.compile(f"(?<![A-Za-z0-9])(?:{alternatives})(?![A-Za-z0-9])")


def _scrubbed_messages(document: dict[str, Any], quoted: re.Pattern[str], masked: list[str]) -> dict[str, Any]:
    """``document`` with each quotation ``quoted`` finds in its result's messages (a policy's
    reasons, an error's message) replaced by [masked]. Only there: the agent chooses a masked
    value, and a sweep of the whole event would let it erase whatever word it likes from the
    record (another argument, a tool's name in a source, a status)."""
    result = document.get("result")
    if not isinstance(result, dict):
        return document
    changed = dict(result)
    if isinstance(message := result.get("message"), str) and (said := quoted.sub(ERASED, message)) != message:
        changed["message"] = said
        masked.append("/result/message")
    reasons = result.get("reasons")
    if isinstance(reasons, list):
        kept = []
        for index, reason in enumerate(reasons):
            text = reason.get("message") if isinstance(reason, dict) else reason
            told = quoted.sub(ERASED, text) if isinstance(text, str) else text
            if told == text:
                kept.append(reason)
                continue
            masked.append(f"/result/reasons/{index}" + ("/message" if isinstance(reason, dict) else ""))
            kept.append({**reason, "message": told} if isinstance(reason, dict) else told)
        changed["reasons"] = kept
    return {**document, "result": changed} if changed != result else document


def _masked_problems(document: dict[str, Any], arguments: list[str], masked: list[str]) -> dict[str, Any]:
    """``document`` with what a refused call's problems say of a masked argument erased: a schema
    error quotes the value it refused (``args.pin: '48x1' does not match ...``), in the problem and
    in the message made of the problems, while the call's arguments are not in the event at all.

    A problem is told by its ``path`` (`router.errors.FieldProblem`), whose first step is the
    argument's name exactly (the field, ``args.a.b``, does not say whether that is ``a.b`` or ``a``);
    one about the arguments as a whole (an empty path: ``anyOf``, ``maxProperties``, ``not`` at the
    schema's root) quotes them all, masked ones too, so any rule on an argument erases it. A problem
    without a path is one the router words itself, quoting no value. The message is made again
    from the problems: it quoted the same values, and it is not searched for them."""
    result = document.get("result")
    problems = result.get("problems") if isinstance(result, dict) else None
    if not isinstance(result, dict) or not isinstance(problems, list):
        return document
    changed = []
    for index, problem in enumerate(problems):
        path = problem.get("path") if isinstance(problem, dict) else None
        if not isinstance(path, list) or not _about_masked(path, arguments):
            changed.append(problem)
            continue
        changed.append({**problem, "problem": ERASED})
        masked.append(f"/result/problems/{index}/problem")
    if changed == problems:
        return document
    told = "; ".join(f"{p.get('field')}: {p.get('problem')}" for p in changed if isinstance(p, dict))
    tool = document.get("tool")
    message = f"invalid arguments for tool {tool!r}: {told}" if isinstance(tool, str) else f"invalid arguments: {told}"
    if "message" in result:
        masked.append("/result/message")
    return {**document, "result": {**result, "problems": changed, "message": message}}


def _about_masked(path: list[Any], arguments: list[str]) -> bool:
    """Whether a problem at ``path`` in the arguments may quote a masked one (``arguments``: the
    names the rules mask, ``*`` for any)."""
    return not path or "*" in arguments or path[0] in arguments


_DIGESTS = ("binding", "args_sha256")  # a digest of a call's tool, arguments and session


def _keyed_digests(document: dict[str, Any], key: bytes | None, masked: list[str]) -> dict[str, Any]:
    """``document`` with the digests of a call's arguments in its ``result`` keyed (an HMAC of the
    digest: still equal for the same call, so an approval joins its decision), or erased without a
    key; a digest of arguments that were masked would give them back to whoever tries each value."""
    result = document.get("result")
    if not isinstance(result, dict):
        return document

    def keyed(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            copy = {}
            for name, item in value.items():
                if name in _DIGESTS and isinstance(item, str):
                    masked.append(f"{where}/{_escaped(name)}")
                    copy[name] = _keyed(item, key)
                else:
                    copy[name] = keyed(item, f"{where}/{_escaped(name)}")
            return copy
        return value

    return {**document, "result": keyed(result, "/result")}


def _keyed(digest: str, key: bytes | None) -> str:
    """A digest of masked data as the log keeps it: an HMAC of it under the masking key (still
    equal for equal data), or erased without a key."""
    return ERASED if key is None else "hmac-sha256:" + hmac.new(key, digest.encode(), hashlib.sha256).hexdigest()


def _hashed(value: Any, key: bytes | None) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    data = text.encode(errors="surrogatepass")
    if key is None:
        return "sha256:" + hashlib.sha256(data).hexdigest()
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


def _apply(
    value: Any,
    steps: list[str],
    hashed: bool,
    key: bytes | None,
    where: str,
    masked: list[str],
    taken: list[Any] | None = None,
) -> Any:
    """``value`` with the value at ``steps`` masked (recorded in ``masked``, and kept in ``taken``)."""
    if not steps:
        masked.append(where)
        if taken is not None:
            taken.append(value)
        return _hashed(value, key) if hashed else ERASED
    step, rest = steps[0], steps[1:]
    if isinstance(value, dict):
        keys = list(value) if step == "*" else [step] if step in value else []
        if not keys:
            return value
        copy = dict(value)
        for name in keys:
            copy[name] = _apply(value[name], rest, hashed, key, f"{where}/{_escaped(name)}", masked, taken)
        return copy
    if isinstance(value, list):
        wanted = range(len(value)) if step == "*" else [int(step)] if _INDEX.fullmatch(step) else []
        indexes = [i for i in wanted if i < len(value)]
        if not indexes:
            return value
        items = list(value)
        for index in indexes:
            items[index] = _apply(value[index], rest, hashed, key, f"{where}/{index}", masked, taken)
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

"""Read a policy directory into a `PolicyBundle`: Rego modules, merged data, and a revision.

Layout follows OPA bundles: every ``*.rego`` under the directory is a module; a ``data.json``
in ``a/b/`` is mounted at ``data.a.b``. The revision is sha256 over each file's relative path
and bytes, so any change to policy or data changes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy.errors import PolicyBundleError


@dataclass(frozen=True, slots=True)
class PolicyBundle:
    """The loaded contents of a policy directory."""

    root: Path
    modules: tuple[tuple[str, str], ...]
    data: dict[str, Any]
    revision: str

    @property
    def decision_modules(self) -> list[tuple[str, str]]:
        """Modules for the decision program; tests use ``with``, which the compiled path rejects."""
        return [(path, text) for path, text in self.modules if not path.endswith("_test.rego")]

    @property
    def data_json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"), sort_keys=True)


def _mount(data: dict[str, Any], parts: tuple[str, ...], value: Any, source: str) -> None:
    node = data
    for part in parts:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise PolicyBundleError(f"{source}: data path {'.'.join(parts)} collides with a non-object value")
        node = child
    if not isinstance(value, dict):
        raise PolicyBundleError(f"{source}: data.json must hold a JSON object at its top level")
    for key, item in value.items():
        if key in node:
            raise PolicyBundleError(f"{source}: key {key!r} is defined twice under data.{'.'.join(parts)}")
        node[key] = item


def fingerprint(root: Path) -> tuple[tuple[str, int, int], ...]:
    """Path, mtime and size of every policy file: cheap to take, changes when any file does."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix == ".rego" or path.name == "data.json":
            try:
                info = path.stat()
            except OSError:
                continue
            found.append((path.relative_to(root).as_posix(), info.st_mtime_ns, info.st_size))
    return tuple(found)


def load_bundle(root: Path, *, max_bytes: int = 1 << 20) -> PolicyBundle:
    """Load every ``.rego`` and ``data.json`` under ``root``.

    Raises:
        PolicyBundleError: the directory is missing, holds no Rego, is too large, or a data
            file is not valid JSON. The message names the file and what to change.
    """
    if not root.is_dir():
        raise PolicyBundleError(f"policy directory {root} does not exist; set STOCKADE_POLICY__DIR")
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file() and (p.suffix == ".rego" or p.name == "data.json"))
    except OSError as exc:
        raise PolicyBundleError(f"policy directory {root} cannot be listed: {exc.strerror}") from exc
    digest = hashlib.sha256()
    modules: list[tuple[str, str]] = []
    data: dict[str, Any] = {}
    total = 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            raw = path.read_bytes()
        except OSError as exc:  # removed or replaced between the listing and the read (an editor, a checkout)
            raise PolicyBundleError(f"{rel}: cannot be read ({exc.strerror}); try again once it is in place") from exc
        total += len(raw)
        if total > max_bytes:
            raise PolicyBundleError(
                f"policy directory {root} exceeds {max_bytes} bytes at {rel}; "
                "raise STOCKADE_POLICY__MAX_POLICY_BYTES or split the data out"
            )
        digest.update(rel.encode() + b"\0" + hashlib.sha256(raw).digest())
        try:
            text = raw.decode()
        except UnicodeDecodeError as exc:
            raise PolicyBundleError(f"{rel}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if path.suffix == ".rego":
            modules.append((rel, text))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyBundleError(f"{rel}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
        _mount(data, tuple(path.parent.relative_to(root).parts), value, rel)
    if not any(not rel.endswith("_test.rego") for rel, _ in modules):
        raise PolicyBundleError(f"policy directory {root} holds no .rego policy")
    return PolicyBundle(root=root, modules=tuple(modules), data=data, revision=digest.hexdigest())

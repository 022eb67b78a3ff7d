"""Read a policy into a `PolicyBundle` (Rego modules, merged data, a revision) from a directory or
from a bundle file; build and sign bundle files.

A directory follows OPA's bundle layout: every ``*.rego`` under it is a module; a ``data.json``
in ``a/b/`` is mounted at ``data.a.b``. Its revision is sha256 over each file's relative path and
the sha256 of its bytes, so any change to policy or data changes it.

A bundle file is what ``stockade policy build`` makes, and what OPA's ``opa build`` makes: a gzip
tarball of those files plus ``.manifest`` (``{"revision": ..., "roots": [...]}``) and, when
signed, ``.signatures.json`` in OPA's format: ``{"signatures": ["<JWT>"]}``, one compact JWS whose
payload lists every other file as ``{"name", "hash", "algorithm"}``. Hashes are OPA's: the file's
bytes for Rego; for ``data.json`` and ``.manifest`` the JSON re-encoded with object keys sorted
(whitespace does not count); with any of OPA's SHA-2 algorithms (MD5 and SHA-1 are refused). The
JWS is checked with the configured public key under the algorithms that key is for, as OPA signs:
Ed25519 (EdDSA), RSA (RS256, OPA's default, RS384/512, PS256/384/512) or EC (ES256/384/512 by
curve); the header cannot pick another. stockade signs with RS256, ES* or EdDSA by the key's type.
A bundle's revision is its manifest's revision and the content hash, ``R+<sha256>``,
the hash being the one its files would have as a directory.

Reading a bundle file never extracts it to disk, and refuses, naming the member: links, anything
but regular files and directories, absolute names, ``..`` (or empty) path parts, duplicate names,
files other than the above, more than `MAX_MEMBERS` members, and contents over the size cap (the
archive is decompressed through a cap, so a tar bomb stops at it). With a public key, the bundle
must be signed with it and every file must be exactly as signed: none added, none removed, none
changed. Without one, a signed bundle is refused, as OPA refuses a signature it cannot check.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey, RSAPublicKey

from policy.config import PolicySettings
from policy.errors import PolicyBundleError

MANIFEST = ".manifest"
SIGNATURES = ".signatures.json"
MAX_MEMBERS = 1000  # a policy is tens of files; a tar of millions of empty members is a bomb too
_STRUCTURED = {"data.json", MANIFEST}  # hashed as sorted JSON, as OPA does (bundle.IsStructuredDoc)


@dataclass(frozen=True, slots=True)
class PolicyBundle:
    """The loaded contents of a policy directory or bundle file."""

    root: Path
    """The directory or bundle file it was read from."""
    modules: tuple[tuple[str, str], ...]
    data: dict[str, Any]
    revision: str
    """What decisions and audit events name: the content hash, after ``R+`` for a bundle with a
    manifest revision ``R``."""
    content_hash: str = ""
    """sha256 over the policy files (the revision of the same files as a directory)."""
    manifest_revision: str | None = None
    """The ``revision`` of a bundle file's manifest; None for a directory."""
    signed_by: str | None = None
    """The key id (`key_id`) a bundle file's signature was verified with; None if not signed."""

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


def _is_policy_file(name: str) -> bool:
    return name.endswith(".rego") or name.rsplit("/", 1)[-1] == "data.json"


def fingerprint(root: Path) -> tuple[tuple[str, int, int], ...]:
    """Path, mtime and size of every policy file (of the bundle file, if ``root`` is one): cheap
    to take, changes when any file does."""
    if root.is_file():
        try:
            info = root.stat()
        except OSError:
            return ()
        return ((root.name, info.st_mtime_ns, info.st_size),)
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix == ".rego" or path.name == "data.json":
            try:
                info = path.stat()
            except OSError:
                continue
            found.append((path.relative_to(root).as_posix(), info.st_mtime_ns, info.st_size))
    return tuple(found)


def _directory_files(root: Path, max_bytes: int) -> list[tuple[str, bytes]]:
    """Relative path and bytes of every ``.rego`` and ``data.json`` under ``root``, sorted."""
    if not root.is_dir():
        raise PolicyBundleError(f"policy directory {root} does not exist; set STOCKADE_POLICY__DIR")
    try:
        paths = sorted(p for p in root.rglob("*") if p.is_file() and _is_policy_file(p.name))
    except OSError as exc:
        raise PolicyBundleError(f"policy directory {root} cannot be listed: {exc.strerror}") from exc
    files: list[tuple[str, bytes]] = []
    total = 0
    for path in paths:
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
        files.append((rel, raw))
    return files


def _content_hash(files: Iterable[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for rel, raw in sorted(files):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(raw).digest())
    return digest.hexdigest()


def _assemble(files: list[tuple[str, bytes]], where: Path) -> tuple[tuple[tuple[str, str], ...], dict[str, Any]]:
    """Modules and merged data from policy files (sorted by path); errors name the file."""
    modules: list[tuple[str, str]] = []
    data: dict[str, Any] = {}
    for rel, raw in files:
        try:
            text = raw.decode()
        except UnicodeDecodeError as exc:
            raise PolicyBundleError(f"{rel}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
        if rel.endswith(".rego"):
            _check_nesting(rel, text)
            modules.append((rel, text))
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyBundleError(f"{rel}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
        except RecursionError as exc:
            raise PolicyBundleError(f"{rel}: JSON nested too deeply to load; flatten it") from exc
        _mount(data, tuple(rel.split("/")[:-1]), value, rel)
    if not any(not rel.endswith("_test.rego") for rel, _ in modules):
        raise PolicyBundleError(f"policy {where} holds no .rego policy")
    return tuple(modules), data


# regorus parses nested ``[`` and ``{`` in time exponential in their depth (about 2.2x a level:
# 12 levels 0.1 s, 18 levels 13 s, 22 over a minute), and a router parses on reload. Real
# policies nest a few levels; past this a module is refused before regorus sees it.
MAX_REGO_NESTING = 12
_STRING_OR_COMMENT = re.compile(r'"(?:[^"\\\n]|\\.)*"|`[^`]*`|#[^\n]*')


def _check_nesting(rel: str, text: str) -> None:
    """Refuse a module whose ``[``/``{`` nesting (outside strings and comments) is deeper than
    `MAX_REGO_NESTING`, naming the line.

    Raises:
        PolicyBundleError: too deep.
    """
    depth = 0
    position = 0
    for match in [*_STRING_OR_COMMENT.finditer(text), None]:
        end = match.start() if match is not None else len(text)
        for offset in range(position, end):
            char = text[offset]
            if char in "[{":
                depth += 1
                if depth > MAX_REGO_NESTING:
                    line = text.count("\n", 0, offset) + 1
                    raise PolicyBundleError(
                        f"{rel}:{line}: brackets nested more than {MAX_REGO_NESTING} deep; regorus parses such "
                        "nesting in exponential time: split the expression (name the inner parts)"
                    )
            elif char in "]}":
                depth = max(depth - 1, 0)
        if match is not None:
            position = match.end()


def load_bundle(root: Path, *, max_bytes: int = 1 << 20, public_key: PublicKey | None = None) -> PolicyBundle:
    """Load a policy directory (every ``.rego`` and ``data.json`` under ``root``), or the bundle
    file ``root`` names (`load_bundle_archive`).

    Raises:
        PolicyBundleError: the directory is missing, holds no Rego, is too large, or a data
            file is not valid JSON; a bundle file is refused; ``public_key`` is given for a
            directory (which carries no signature). The message names the file and what to change.
    """
    if root.is_file():
        return load_bundle_archive(root, public_key=public_key, max_bytes=max_bytes)
    if public_key is not None:
        raise PolicyBundleError(
            f"{root} is a directory, which carries no signature, and a bundle public key is configured: "
            "build a signed bundle (`stockade policy build`) and set STOCKADE_POLICY__BUNDLE"
        )
    files = _directory_files(root, max_bytes)
    modules, data = _assemble(files, root)
    content_hash = _content_hash(files)
    return PolicyBundle(root=root, modules=modules, data=data, revision=content_hash, content_hash=content_hash)


def load_configured(settings: PolicySettings) -> PolicyBundle:
    """The policy ``settings`` names (directory or bundle), checked against its public key."""
    key = load_public_key(settings.bundle_public_key) if settings.bundle_public_key is not None else None
    return load_bundle(settings.dir, max_bytes=settings.max_policy_bytes, public_key=key)


def digest_of(source: Path, *, max_bytes: int = 64 << 20) -> str | None:
    """What names files that did not load: for a directory, the revision its files would have;
    for a bundle file, ``sha256:`` and the digest of the file. None if they cannot be read."""
    try:
        if source.is_file():
            with source.open("rb") as handle:
                return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()
        return _content_hash(_directory_files(source, max_bytes))
    except (OSError, PolicyBundleError):
        return None


# -- bundle files ---------------------------------------------------------------------------


class _TooLarge(Exception):
    """The decompressed archive went over its cap."""


class _Capped(io.RawIOBase):
    """A reader that raises `_TooLarge` once more than ``cap`` bytes were read through it."""

    def __init__(self, inner: gzip.GzipFile, cap: int) -> None:
        self._inner = inner
        self._left = cap

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self._inner.read(self._left + 1 if size < 0 else min(size, self._left + 1))
        self._left -= len(chunk)
        if self._left < 0:
            raise _TooLarge
        return chunk


def _member_name(raw: str, where: Path) -> str:
    """A member's name relative to the bundle root (``./`` dropped); refuses any that could
    point elsewhere."""
    name = raw.removeprefix("./")
    if name in ("", "."):
        return ""
    if name.startswith("/"):
        raise PolicyBundleError(f"bundle {where}: member {raw!r} has an absolute name; bundle names are relative")
    if "\\" in name or "\0" in name:
        raise PolicyBundleError(f"bundle {where}: member {raw!r} has a backslash or NUL in its name")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise PolicyBundleError(
            f"bundle {where}: member {raw!r} has an empty, '.' or '..' path part (path traversal); bundle "
            "names are plain relative paths"
        )
    return name


def _read_archive(path: Path, max_bytes: int) -> dict[str, bytes]:
    """Every file of the bundle file at ``path``, by name, in archive order; refuses what the
    module docstring lists, naming the member."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise PolicyBundleError(f"bundle {path} cannot be read: {exc.strerror}") from exc
    if size > max_bytes:
        raise PolicyBundleError(
            f"bundle {path} is {size} bytes, over {max_bytes}; raise STOCKADE_POLICY__MAX_POLICY_BYTES"
        )
    # Room for the files (max_bytes in all) and each member's headers and padding.
    cap = max_bytes + MAX_MEMBERS * 2048 + 20480
    members: dict[str, bytes] = {}
    seen = 0
    last = "(none)"
    total = 0
    try:
        with gzip.open(path, "rb") as compressed, tarfile.open(fileobj=_Capped(compressed, cap), mode="r|") as tar:
            for member in tar:
                seen += 1
                if seen > MAX_MEMBERS:
                    raise PolicyBundleError(f"bundle {path} has more than {MAX_MEMBERS} members (at {member.name!r})")
                name = _member_name(member.name, path)
                last = member.name
                if member.issym() or member.islnk():
                    raise PolicyBundleError(f"bundle {path}: member {member.name!r} is a link (to "
                                            f"{member.linkname!r}); a bundle holds regular files only")  # fmt: skip
                if member.isdir():
                    continue
                if not member.isreg():
                    raise PolicyBundleError(f"bundle {path}: member {member.name!r} is not a regular file")
                if name in members:
                    raise PolicyBundleError(f"bundle {path}: member {member.name!r} appears twice")
                if not (name in (MANIFEST, SIGNATURES) or _is_policy_file(name)):
                    raise PolicyBundleError(f"bundle {path}: member {member.name!r} is not a policy file; a bundle "
                                            f"holds .rego, data.json, {MANIFEST} and {SIGNATURES} only")  # fmt: skip
                total += member.size
                if total > max_bytes:
                    raise PolicyBundleError(
                        f"bundle {path}: member {member.name!r} ({member.size} bytes) takes the contents over "
                        f"{max_bytes} bytes (a tar bomb?); raise STOCKADE_POLICY__MAX_POLICY_BYTES if it is not"
                    )
                handle = tar.extractfile(member)
                members[name] = handle.read() if handle is not None else b""
    except _TooLarge as exc:
        raise PolicyBundleError(
            f"bundle {path} decompresses to more than {cap} bytes, after member {last!r} (a tar bomb?)"
        ) from exc
    except (OSError, EOFError, zlib.error, tarfile.TarError) as exc:
        raise PolicyBundleError(f"bundle {path} is not a readable gzip tarball (after member {last!r}): {exc}") from exc
    return members


@dataclass(frozen=True, slots=True)
class _Manifest:
    revision: str
    roots: tuple[str, ...]


def _manifest(raw: bytes | None, where: Path) -> _Manifest:
    if raw is None:
        return _Manifest(revision="", roots=("",))  # OPA's default: no revision, every path
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PolicyBundleError(f"bundle {where}: member {MANIFEST!r} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise PolicyBundleError(f"bundle {where}: member {MANIFEST!r} must hold a JSON object")
    revision = value.get("revision", "")
    roots = value.get("roots", [""])
    if not isinstance(revision, str):
        raise PolicyBundleError(f"bundle {where}: member {MANIFEST!r}: revision must be a string")
    if not isinstance(roots, list) or not all(isinstance(root, str) for root in roots):
        raise PolicyBundleError(f"bundle {where}: member {MANIFEST!r}: roots must be a list of strings")
    return _Manifest(revision=revision, roots=tuple(root.strip("/") for root in roots))


_PACKAGE = re.compile(r"^\s*package\s+([A-Za-z_][\w.]*)", re.MULTILINE)


def _package(text: str) -> tuple[str, ...]:
    """The path of a module's package (``package a.b`` → ``("a", "b")``); empty if not found."""
    found = _PACKAGE.search(text)
    return tuple(found.group(1).split(".")) if found else ()


def _roots_of(modules: Iterable[tuple[str, str]], data: Mapping[str, Any]) -> list[str]:
    """The roots a bundle of these modules and data claims: the top segment of each."""
    tops = {parts[0] for parts in (_package(text) for _, text in modules) if parts}
    return sorted(tops | set(data))


def _check_roots(roots: tuple[str, ...], bundle: PolicyBundle, where: Path) -> None:
    """Every package and data path of ``bundle`` lies under a manifest root, as OPA requires."""
    split = [tuple(root.split("/")) if root else () for root in roots]

    def covered(path: tuple[str, ...]) -> bool:
        return any(path[: len(root)] == root for root in split)

    for rel, text in bundle.modules:
        package = _package(text)
        if package and not covered(package):
            raise PolicyBundleError(f"bundle {where}: member {rel!r} has package {'.'.join(package)}, outside the "
                                    f"manifest's roots {list(roots)}")  # fmt: skip

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = (*path, key)
            if covered(here):
                continue
            if any(root[: len(here)] == here for root in split) and isinstance(value, dict):
                walk(value, here)
                continue
            raise PolicyBundleError(f"bundle {where}: data.{'.'.join(here)} lies outside the manifest's roots "
                                    f"{list(roots)}")  # fmt: skip

    walk(bundle.data, ())


def load_bundle_archive(path: Path, *, public_key: PublicKey | None = None, max_bytes: int = 1 << 20) -> PolicyBundle:
    """Load the bundle file at ``path``; with ``public_key``, only if signed with it and unaltered.

    Raises:
        PolicyBundleError: the file is refused (module docstring); the message names the member.
    """
    members = _read_archive(path, max_bytes)
    signatures = members.pop(SIGNATURES, None)
    signed_by = None
    if public_key is None and signatures is not None:
        raise PolicyBundleError(
            f"bundle {path} is signed, but no public key is configured to check it: set "
            "STOCKADE_POLICY__BUNDLE_PUBLIC_KEY (or pass --public-key)"
        )
    if public_key is not None:
        if signatures is None:
            raise PolicyBundleError(
                f"bundle {path} is not signed ({SIGNATURES} is missing), and a public key is configured: sign it "
                "with `stockade policy build --signing-key`"
            )
        signed_by = verify_signatures(signatures, members, public_key, where=path)
    manifest = _manifest(members.pop(MANIFEST, None), path)
    files = sorted(members.items())
    modules, data = _assemble(files, path)
    content_hash = _content_hash(files)
    revision = f"{manifest.revision}+{content_hash}" if manifest.revision else content_hash
    bundle = PolicyBundle(root=path, modules=modules, data=data, revision=revision, content_hash=content_hash,
                          manifest_revision=manifest.revision, signed_by=signed_by)  # fmt: skip
    _check_roots(manifest.roots, bundle, path)
    return bundle


def build_bundle(
    root: Path,
    output: Path,
    *,
    revision: str = "",
    signing_key: PrivateKey | None = None,
    max_bytes: int = 1 << 20,
) -> PolicyBundle:
    """Write the policy directory ``root`` as a bundle file at ``output`` (with ``.manifest`` and,
    given ``signing_key``, ``.signatures.json``) and return it as loaded back. The file is written
    beside ``output`` and renamed into place, so a router watching it never reads half of one.
    The archive is reproducible: the same files, revision and key make the same bytes except for
    the signature's ``iat``.

    Raises:
        PolicyBundleError: the directory does not load, or ``output`` cannot be written.
    """
    files = _directory_files(root, max_bytes)
    modules, data = _assemble(files, root)
    manifest = {"revision": revision, "roots": _roots_of(modules, data)}
    members: dict[str, bytes] = {MANIFEST: (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()}
    members.update(files)
    if signing_key is not None:
        members[SIGNATURES] = sign_files(members, signing_key)
    order = [MANIFEST, *([SIGNATURES] if signing_key is not None else []), *(rel for rel, _ in files)]
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as compressed, \
            tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as tar:  # fmt: skip
        for name in order:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(members[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(members[name]))
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        staging.write_bytes(buffer.getvalue())
        os.replace(staging, output)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise PolicyBundleError(f"cannot write the bundle to {output}: {exc.strerror}") from exc
    public_key = signing_key.public_key() if signing_key is not None else None
    return load_bundle_archive(output, public_key=public_key, max_bytes=max_bytes)


# -- signatures (OPA's .signatures.json: one JWS over the files' hashes) -----------------------

PublicKey = Ed25519PublicKey | RSAPublicKey | EllipticCurvePublicKey
PrivateKey = Ed25519PrivateKey | RSAPrivateKey | EllipticCurvePrivateKey
_MIN_RSA_BITS = 2048
# The JWS algorithms OPA signs bundles with that a public key can check, per key type (HS256 and
# the other shared-secret ones are not: a public key is no secret). The first is what stockade
# signs with: RS256 is OPA's default, and ES* is fixed by the curve.
_EC_ALGORITHMS = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}
_RSA_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")
# OPA's file hashing algorithms (bundle/hash.go) that stockade accepts: MD5 and SHA-1 are
# refused, since a collision would let one signed hash stand for two files.
_HASHES = {"SHA-224": "sha224", "SHA-256": "sha256", "SHA-384": "sha384", "SHA-512": "sha512",
           "SHA-512-224": "sha512_224", "SHA-512-256": "sha512_256"}  # fmt: skip
_WEAK_HASHES = {"MD5", "SHA-1"}


def algorithms_for(key: PublicKey) -> tuple[str, ...]:
    """The JWS algorithms a signature checked with ``key`` may use (OPA's names)."""
    if isinstance(key, Ed25519PublicKey):
        return ("EdDSA",)
    if isinstance(key, RSAPublicKey):
        return _RSA_ALGORITHMS
    return (_EC_ALGORITHMS[key.curve.name],)


def _checked_public(key: object, path: Path, what: str) -> PublicKey:
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, RSAPublicKey) and key.key_size >= _MIN_RSA_BITS:
        return key
    if isinstance(key, EllipticCurvePublicKey) and key.curve.name in _EC_ALGORITHMS:
        return key
    raise PolicyBundleError(
        f"{what} {path} is a {_describe(key)}; bundles are signed with Ed25519, RSA of at least {_MIN_RSA_BITS} bits "
        "(RS256, OPA's default, and the other RS*/PS*) or EC P-256/P-384/P-521 (ES256/ES384/ES512)"
    )


def _describe(key: object) -> str:
    if isinstance(key, RSAPublicKey):
        return f"{key.key_size}-bit RSA key"
    if isinstance(key, EllipticCurvePublicKey):
        return f"EC key on {key.curve.name}"
    return type(key).__name__


def load_public_key(path: Path) -> PublicKey:
    """The public key in the PEM file ``path`` (``openssl pkey -pubout`` writes one): Ed25519,
    RSA or EC, as OPA's ``keys`` configuration takes them.

    Raises:
        PolicyBundleError: unreadable, not PEM, or a key type or size bundles are not signed with.
    """
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise PolicyBundleError(f"public key {path} cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise PolicyBundleError(f"public key {path} is not a PEM public key: {exc}") from exc
    return _checked_public(key, path, "public key")


def load_private_key(path: Path) -> PrivateKey:
    """The private key in the unencrypted PEM file ``path``: Ed25519 (``openssl genpkey -algorithm
    ed25519``), RSA (``openssl genpkey -algorithm RSA``, what ``opa build --signing-key`` is
    usually given) or EC.

    Raises:
        PolicyBundleError: unreadable, not PEM, encrypted, or a key type or size bundles are not
            signed with.
    """
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise PolicyBundleError(f"signing key {path} cannot be read: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise PolicyBundleError(f"signing key {path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey | RSAPrivateKey | EllipticCurvePrivateKey):
        raise PolicyBundleError(f"signing key {path} is a {type(key).__name__}; bundles are signed with Ed25519, "
                                "RSA or EC keys")  # fmt: skip
    _checked_public(key.public_key(), path, "signing key")
    return key


def key_id(public_key: PublicKey) -> str:
    """A short name for a public key (the JWS ``kid`` stockade writes): its type and the first 16
    hex digits of the sha256 of its raw bytes (Ed25519) or of its SubjectPublicKeyInfo."""
    if isinstance(public_key, Ed25519PublicKey):
        raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return ("rsa:" if isinstance(public_key, RSAPublicKey) else "ec:") + hashlib.sha256(der).hexdigest()[:16]


class _Number(str):
    """A JSON number kept as written: OPA hashes numbers by their literal text."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _encode_string(text: str) -> bytes:
    # Go's encoder (without HTML escaping) writes what Python's does, and escapes U+2028/U+2029.
    encoded = json.dumps(text, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return encoded.encode("utf-8", "surrogatepass")


def _walk(value: Any, out: list[bytes]) -> None:
    """OPA's structured hash input (bundle/hash.go ``walk``): keys sorted, no whitespace."""
    if isinstance(value, dict):
        out.append(b"{")
        for index, key in enumerate(sorted(value)):
            out.append(b"," if index else b"")
            out.append(_encode_string(key) + b":")
            _walk(value[key], out)
        out.append(b"}")
    elif isinstance(value, list):
        out.append(b"[")
        for index, item in enumerate(value):
            out.append(b"," if index else b"")
            _walk(item, out)
        out.append(b"]")
    elif isinstance(value, _Number):
        out.append(str(value).encode())
    elif isinstance(value, str):
        out.append(_encode_string(value))
    else:
        out.append(json.dumps(value).encode())  # true, false, null


def canonical_bytes(name: str, raw: bytes) -> bytes:
    """What OPA hashes for the bundle file ``name`` holding ``raw``: the bytes of a Rego (or any
    unstructured) file; for ``data.json`` and ``.manifest`` the JSON re-encoded with object keys
    sorted and no whitespace, numbers as written (bundle/hash.go ``walk``).

    Raises:
        ValueError: a structured file is not JSON.
    """
    if name.rsplit("/", 1)[-1] not in _STRUCTURED:
        return raw
    value = json.loads(raw, parse_int=_Number, parse_float=_Number, parse_constant=_reject_constant)
    out: list[bytes] = []
    _walk(value, out)
    return b"".join(out)


def file_hash(name: str, raw: bytes, algorithm: str = "SHA-256") -> str:
    """The hash (hex) OPA signs for the bundle file ``name`` holding ``raw``, with ``algorithm``
    (OPA's name: SHA-256, its default, or SHA-224, SHA-384, SHA-512, SHA-512-224, SHA-512-256).

    Raises:
        ValueError: a structured file is not JSON, or the algorithm is not one of those.
    """
    if algorithm not in _HASHES:
        raise ValueError(f"hashing algorithm {algorithm!r} is not accepted")
    return hashlib.new(_HASHES[algorithm], canonical_bytes(name, raw)).hexdigest()


def sign_files(files: Mapping[str, bytes], signing_key: PrivateKey) -> bytes:
    """The ``.signatures.json`` for a bundle holding ``files`` (name → bytes), signed with
    ``signing_key`` as OPA signs: RS256 for an RSA key (OPA's default), ES256/384/512 by curve,
    EdDSA for Ed25519; files hashed with SHA-256."""
    public = signing_key.public_key()
    payload = {
        "files": [
            {"name": name, "hash": file_hash(name, raw), "algorithm": "SHA-256"} for name, raw in sorted(files.items())
        ],
        "iat": int(time.time()),
    }
    token = jwt.PyJWS().encode(
        json.dumps(payload).encode(), signing_key, algorithm=algorithms_for(public)[0],
        headers={"kid": key_id(public)},
    )  # fmt: skip
    return (json.dumps({"signatures": [token]}, indent=2) + "\n").encode()


def verify_signatures(signatures: bytes, files: Mapping[str, bytes], public_key: PublicKey, *, where: Path) -> str:
    """Check ``.signatures.json`` against ``public_key`` and the bundle's other ``files``; returns
    the key id. The JWS algorithm must be one ``public_key`` is for (`algorithms_for`): a header
    cannot pick another (no HS256 with the public key as its secret, no ``none``).

    Raises:
        PolicyBundleError: the signature does not verify, or a file was added, removed or
            changed since signing (every such member named).
    """
    prefix = f"bundle {where}: {SIGNATURES}"
    payload = verified_payload(signatures, public_key, prefix)
    try:
        listed = payload["files"]
        entries = [(str(f["name"]), str(f["hash"]), str(f["algorithm"])) for f in listed]
    except (TypeError, KeyError) as exc:
        raise PolicyBundleError(f"{prefix}: the JWT payload has no valid files list: {exc}") from exc
    if payload.get("scope"):
        raise PolicyBundleError(f"{prefix}: signed for scope {payload['scope']!r}; stockade checks unscoped "
                                "signatures only")  # fmt: skip
    _compare(entries, files, where)
    return key_id(public_key)


def verified_payload(signatures: bytes, public_key: PublicKey, prefix: str) -> dict[str, Any]:
    """The payload of ``.signatures.json``'s one JWT, once its signature checks out with
    ``public_key``.

    Raises:
        PolicyBundleError: not one compact JWT, an algorithm ``public_key`` is not for, or a
            signature that does not verify (naming the key the header names, if any).
    """
    try:
        document = json.loads(signatures)
        [token] = document["signatures"]
        header = jwt.get_unverified_header(token)
    except (ValueError, TypeError, KeyError, RecursionError, jwt.exceptions.DecodeError) as exc:
        raise PolicyBundleError(f'{prefix} is not {{"signatures": [one compact JWT]}}: {exc}') from exc
    accepted = algorithms_for(public_key)
    if header.get("alg") not in accepted:
        raise PolicyBundleError(
            f"{prefix}: JWT alg {header.get('alg')!r} is not accepted with the configured key "
            f"({_describe(public_key)}, {key_id(public_key)}): it takes {', '.join(accepted)}"
        )
    try:
        decoded = jwt.PyJWS().decode_complete(token, public_key, algorithms=list(accepted))
        payload = json.loads(decoded["payload"])
    except jwt.exceptions.InvalidSignatureError as exc:
        mine, named = key_id(public_key), header.get("kid")
        if named not in (None, mine):
            raise PolicyBundleError(f"{prefix}: signed with key {named!r}, but the configured key is {mine!r}, "
                                    "and the signature does not verify with it") from exc  # fmt: skip
        raise PolicyBundleError(
            f"{prefix}: the signature does not verify with the configured key {mine!r} (signed with another key, "
            "or the signature was altered)"
        ) from exc
    except (jwt.exceptions.PyJWTError, ValueError, RecursionError) as exc:
        raise PolicyBundleError(f"{prefix}: the JWT cannot be read: {exc}") from exc
    if not isinstance(payload, dict):
        raise PolicyBundleError(f"{prefix}: the JWT payload is not an object")
    return payload


def _compare(entries: list[tuple[str, str, str]], files: Mapping[str, bytes], where: Path) -> None:
    """Raise naming every member not exactly as signed."""
    problems: list[str] = []
    signed: dict[str, tuple[str, str]] = {}
    for name, digest, algorithm in entries:
        if name in signed:
            problems.append(f"member {name!r} is listed twice in the signature")
        signed[name] = (digest, algorithm)
    for name in sorted(signed.keys() - files.keys()):
        problems.append(f"member {name!r} is signed but missing from the bundle (removed)")
    for name in sorted(files.keys() - signed.keys()):
        problems.append(f"member {name!r} is not covered by the signature (added after signing)")
    for name in sorted(files.keys() & signed.keys()):
        digest, algorithm = signed[name]
        if algorithm not in _HASHES:
            why = "too weak to vouch for a file" if algorithm in _WEAK_HASHES else "not one OPA defines"
            problems.append(f"member {name!r} is hashed with {algorithm!r}, {why}: sign with SHA-256 (OPA's default)")
            continue
        try:
            actual = file_hash(name, files[name], algorithm)
        except RecursionError:
            problems.append(f"member {name!r} is JSON nested too deeply to load")
            continue
        except ValueError as exc:
            problems.append(f"member {name!r} is not valid JSON: {exc}")
            continue
        if actual != digest.lower():
            problems.append(f"member {name!r} was modified after signing (its {algorithm} does not match)")
    if problems:
        raise PolicyBundleError(f"bundle {where} does not match its signature: " + "; ".join(problems))

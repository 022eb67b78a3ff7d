"""Signed checkpoints (signed tree heads) and tombstones for the audit log, with Ed25519 keys.

A `Checkpoint` commits the log's size and Merkle root under the log's key and chains to the previous
checkpoint; a `Tombstone` records, under the same key, a segment that retention deleted, with the tree
state needed to carry on verifying after the gap. Signatures cover `body()`: canonical JSON of every
field but ``signature``."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.audit.merkle import CompactRange

__all__ = [
    "Checkpoint",
    "SigningKey",
    "Tombstone",
    "VerifyKey",
    "create_private_file",
    "sign_checkpoint",
    "sign_tombstone",
]

_HEX64 = r"^[0-9a-f]{64}$"
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z")


def _key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _canonical(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _write_atomic(path: Path, data: bytes, mode: int, *, replace: bool) -> bool:
    """Write ``data`` to ``path`` with ``mode`` via a temp file in the same directory, so a reader never
    sees a partial file. With ``replace=False`` an existing file wins and False is returned."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                # link() fails if the name exists, unlike replace(): two processes creating the key at once
                # must end up sharing one key, not each signing with a key the other overwrote.
                os.link(tmp, path)
            except FileExistsError:
                return False
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the new name itself must survive a crash, not just the bytes
        finally:
            os.close(dir_fd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def create_private_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to a new file at ``path``, mode 0600, whole or not at all (for a key made on
    first use). When two processes make it at once, the first one written wins: False for the other."""
    return _write_atomic(path, data, 0o600, replace=False)


class VerifyKey:
    """An Ed25519 public key that checks checkpoint and tombstone signatures."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: Ed25519PublicKey) -> None:
        self._key = key
        self.key_id = _key_id(key)

    @classmethod
    def from_pem(cls, pem: bytes, *, source: str = "public key") -> VerifyKey:
        """Read a PEM SubjectPublicKeyInfo; raises `ValueError` unless it holds an Ed25519 key."""
        try:
            key = serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source} is not a PEM public key: {e}") from e
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{source} holds a {type(key).__name__} key, not an Ed25519 public key")
        return cls(key)

    @classmethod
    def load(cls, path: Path) -> VerifyKey:
        """Read the PEM public key file at ``path`` (as `SigningKey.load_or_create` writes ``<key>.pub``)."""
        return cls.from_pem(path.read_bytes(), source=str(path))

    def public_pem(self) -> bytes:
        """The key as PEM SubjectPublicKeyInfo."""
        return self._key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def verify(self, data: bytes, signature: bytes) -> bool:
        """Whether ``signature`` is this key's Ed25519 signature over ``data``."""
        try:
            self._key.verify(signature, data)
        except (InvalidSignature, ValueError):
            return False
        return True


class SigningKey:
    """The log's Ed25519 private key, which signs its checkpoints and tombstones."""

    __slots__ = ("_key", "verify_key")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.verify_key = VerifyKey(key.public_key())

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh random key, kept in memory only."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> SigningKey:
        """Load the unencrypted PKCS8 PEM key at ``path``, creating it (0600, in a 0700 directory if the
        directory is new) with its public key at ``<path>.pub`` (0644) when there is none. Raises
        `ValueError` naming the path and the fix for a key others can read or one that is not Ed25519."""
        path = Path(path)
        if not path.exists():
            if not path.parent.exists():
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                path.parent.chmod(0o700)  # mkdir's mode is filtered by the umask
            created = cls.generate()
            pem = created._key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            if _write_atomic(path, pem, 0o600, replace=False):
                _write_atomic(cls._pub_path(path), created.public_pem(), 0o644, replace=True)
                return created
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise ValueError(
                f"audit signing key {path} is accessible by group or others (mode {mode:04o}); run `chmod 600 {path}`"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"audit signing key {path} is not an unencrypted PEM private key ({e}); "
                "replace it with an Ed25519 PKCS8 key or move it away to have one generated"
            ) from e
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(
                f"audit signing key {path} holds a {type(key).__name__} key, not Ed25519; "
                "replace it with an Ed25519 PKCS8 key or move it away to have one generated"
            )
        loaded = cls(key)
        pub = cls._pub_path(path)
        if not pub.exists():
            # A crash between writing the private key and its .pub leaves no public key for verifiers.
            _write_atomic(pub, loaded.public_pem(), 0o644, replace=True)
        elif VerifyKey.load(pub).key_id != loaded.key_id:
            raise ValueError(
                f"{pub} is not the public key of {path}: verifiers would reject every checkpoint; "
                f"delete {pub} to have it rewritten from {path}"
            )
        return loaded

    @staticmethod
    def _pub_path(path: Path) -> Path:
        return path.with_name(path.name + ".pub")

    @property
    def key_id(self) -> str:
        """The first 16 hex characters of SHA-256 of the raw 32-byte public key."""
        return self.verify_key.key_id

    def public_pem(self) -> bytes:
        """The public key as PEM SubjectPublicKeyInfo."""
        return self.verify_key.public_pem()

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return self._key.sign(data)


class _Signed(BaseModel):
    """A record the log signs: its signature covers `body()`, the canonical JSON of every other field."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    log: str = Field(min_length=1)
    time: str
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    signature: str = Field(pattern=r"^[A-Za-z0-9+/]*={0,2}$")

    @field_validator("time")
    @classmethod
    def _utc(cls, value: str) -> str:
        if not _TIME.fullmatch(value):
            raise ValueError(f"time must be ISO 8601 UTC ending in Z, not {value!r}")
        datetime.fromisoformat(value)  # a real date and time, not just the right shape
        return value

    def body(self) -> bytes:
        """The signed bytes: canonical JSON (sorted keys, no spaces, UTF-8) of every field but ``signature``."""
        return _canonical(self.model_dump(exclude={"signature"}))

    def signed_text(self) -> bytes:
        """Canonical JSON of every field, ``signature`` included: what `digest` hashes."""
        return _canonical(self.model_dump())

    def digest(self) -> str:
        """SHA-256 hex of `signed_text`: what the next checkpoint's ``prev`` names."""
        return hashlib.sha256(self.signed_text()).hexdigest()

    def signed_by(self, keys: Sequence[VerifyKey]) -> bool:
        """Whether one of ``keys`` signed this record as it stands."""
        return any(self.verify(key) for key in keys)

    def verify(self, key: VerifyKey) -> bool:
        """Whether ``key`` signed this record as it stands."""
        if self.key_id != key.key_id:
            return False
        try:
            signature = base64.b64decode(self.signature, validate=True)
        except (binascii.Error, ValueError):
            return False
        return key.verify(self.body(), signature)

    def _signed_by(self, key: SigningKey) -> Self:
        return self.model_copy(update={"signature": base64.b64encode(key.sign(self.body())).decode()})


class Checkpoint(_Signed):
    """A signed tree head: the log ``log`` had ``size`` events with Merkle root ``root`` at ``time``.
    ``prev`` is the `digest` of the checkpoint before it ("" for the first), chaining them."""

    size: int = Field(ge=0)
    root: str = Field(pattern=_HEX64)
    prev: str = Field(pattern=r"^([0-9a-f]{64})?$")


class Tombstone(_Signed):
    """The signed record that retention deleted events ``first_seq``..``last_seq`` (one segment file of
    ``bytes`` bytes, SHA-256 ``sha256``, whose last event hashed to ``last_hash``). ``tree`` is the
    `CompactRange` at size ``last_seq`` and ``checkpoint`` the checkpoint at that size, so a verifier
    resumes the Merkle tree after the gap. The signature covers the nested checkpoint, its own
    signature included; check that one against its own key."""

    first_seq: int = Field(ge=1)
    last_seq: int = Field(ge=1)
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=_HEX64)
    last_hash: str = Field(pattern=_HEX64)
    tree: dict[str, Any]
    checkpoint: Checkpoint
    reason: str

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.last_seq < self.first_seq:
            raise ValueError(f"last_seq {self.last_seq} is before first_seq {self.first_seq}")
        tree = CompactRange.from_json(self.tree)
        if tree.size != self.last_seq or self.checkpoint.size != self.last_seq:
            raise ValueError(
                f"tree (size {tree.size}) and checkpoint (size {self.checkpoint.size}) must both be at "
                f"last_seq {self.last_seq}"
            )
        if self.checkpoint.log != self.log:
            raise ValueError(f"checkpoint is of log {self.checkpoint.log!r}, not {self.log!r}")
        if tree.root().hex() != self.checkpoint.root:
            raise ValueError("tree's root does not match the checkpoint's root")
        return self

    def records(self, manifest: Manifest, sha256: str | None = None) -> bool:
        """Whether this tombstone records the segment as ``manifest`` does: its bytes, their
        ``sha256`` (the manifest's unless given, as read from the segment), its last event's hash,
        its tree and its checkpoint."""
        digest = manifest.sha256 if sha256 is None else sha256
        return (self.bytes, self.sha256, self.last_hash, self.tree, self.checkpoint) == (
            manifest.bytes, digest, manifest.last_hash, manifest.tree, manifest.checkpoint
        )  # fmt: skip


def latest_signed(checkpoints: Iterable[Checkpoint], keys: Sequence[VerifyKey] | None) -> Checkpoint | None:
    """The largest of ``checkpoints`` one of ``keys`` signed (any, if ``keys`` is None); None if
    there is none. Signatures are checked from the largest down, only until one holds: a log
    checkpoints every second, and checking each would cost a signature per second of its life."""
    for checkpoint in sorted(checkpoints, key=lambda c: c.size, reverse=True):
        if keys is None or checkpoint.signed_by(keys):
            return checkpoint
    return None


def sign_checkpoint(
    key: SigningKey, *, log: str, size: int, root: bytes, prev: Checkpoint | None, time: str | None = None
) -> Checkpoint:
    """Sign the tree head (``size``, raw 32-byte ``root``) of ``log``, chained to ``prev`` (None for the
    log's first checkpoint). ``time`` defaults to now. Raises `ValueError` if ``prev`` is of another log
    or of a larger tree: a log only grows."""
    if len(root) != 32:
        raise ValueError(f"a Merkle root is 32 bytes, not {len(root)}")
    if prev is not None and (prev.log != log or prev.size > size):
        raise ValueError(f"checkpoint of {log!r} at size {size} cannot follow {prev.log!r} at size {prev.size}")
    unsigned = Checkpoint(
        log=log,
        size=size,
        root=root.hex(),
        time=_now() if time is None else time,
        prev="" if prev is None else prev.digest(),
        key_id=key.key_id,
        signature="",
    )
    return unsigned._signed_by(key)


def sign_tombstone(key: SigningKey, **fields: Any) -> Tombstone:
    """Sign a `Tombstone` from its fields (all but ``key_id`` and ``signature``; ``time`` defaults to now).
    Raises pydantic's `ValidationError` (a `ValueError`) for missing or inconsistent fields."""
    if "key_id" in fields or "signature" in fields:
        raise ValueError("sign_tombstone sets key_id and signature from the key; do not pass them")
    unsigned = Tombstone.model_validate({"time": _now(), **fields, "key_id": key.key_id, "signature": ""})
    return unsigned._signed_by(key)


class Manifest(BaseModel):
    """What sealing a segment recorded about it. Its checkpoint is signed; the rest is checked
    against the segment's bytes and that checkpoint by `router.audit.verify`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_seq: int
    last_seq: int
    bytes: int
    sha256: str
    first_prev_hash: str
    last_hash: str
    tree: dict[str, Any]
    """`CompactRange.to_json()` at size ``last_seq``: where the next segment's tree resumes."""
    checkpoint: Checkpoint
    """Signed at size ``last_seq`` when the segment was sealed."""
    first_time: str
    last_time: str


def unvouched_end(end: Manifest | Tombstone, keys: Sequence[VerifyKey]) -> str | None:
    """Why no signed checkpoint vouches for where a sealed part ends (its manifest's or
    tombstone's tree and last seq), which is where a writer resumes the chain and the tree and
    where `verify --from-seq` starts (None: one does): its tree and checkpoint not at its last seq,
    the tree's root not the signed one, or (with ``keys``) the checkpoint signed by none of them.
    A tombstone's own signature is its caller's to check: a genuine checkpoint may be copied in."""
    tree, checkpoint = CompactRange.from_json(end.tree), end.checkpoint
    if tree.size != end.last_seq or checkpoint.size != end.last_seq:
        return (f"its tree (size {tree.size}) and checkpoint (size {checkpoint.size}) are not at its last seq "
                f"{end.last_seq}")  # fmt: skip
    if tree.root().hex() != checkpoint.root:
        return "its tree's root is not the root its checkpoint signed"
    if keys and not checkpoint.signed_by(keys):
        return f"its checkpoint is not signed by a trusted key (key {checkpoint.key_id})"
    return None

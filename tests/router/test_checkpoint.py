"""Signed checkpoints and tombstones: key files on disk, Ed25519 signatures, the chain, and tampering."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import multiprocessing
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError

from router.audit.checkpoint import Checkpoint, SigningKey, Tombstone, VerifyKey, sign_checkpoint, sign_tombstone
from router.audit.merkle import CompactRange, leaf_hash

TIME = "2026-11-22T10:00:00.000000Z"


def tree(size: int) -> CompactRange:
    compact = CompactRange()
    for i in range(size):
        compact.append(leaf_hash(b"event %d" % i))
    return compact


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


def test_key_is_created_private_and_loaded_back(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "audit.key"
    created = SigningKey.load_or_create(path)
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    pub = tmp_path / "keys" / "audit.key.pub"
    assert mode(pub) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["audit.key", "audit.key.pub"]  # no temp files left
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert pub.read_bytes() == created.public_pem()
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")

    loaded = SigningKey.load_or_create(path)
    assert loaded.key_id == created.key_id
    assert VerifyKey.load(pub).key_id == created.key_id
    public = serialization.load_pem_public_key(pub.read_bytes())
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert created.key_id == hashlib.sha256(raw).hexdigest()[:16]
    assert VerifyKey.load(pub).verify(b"data", loaded.sign(b"data"))


def _create_key(path: str, barrier: Any, ids: Any) -> None:
    barrier.wait()
    ids.put(SigningKey.load_or_create(Path(path)).key_id)


def test_racing_creators_end_up_with_one_key(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "keys" / "audit.key"
    barrier, ids = ctx.Barrier(4), ctx.Queue()
    racers = [ctx.Process(target=_create_key, args=(str(path), barrier, ids)) for _ in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
        assert racer.exitcode == 0
    assert {ids.get(timeout=5) for _ in racers} == {SigningKey.load_or_create(path).key_id}
    assert VerifyKey.load(tmp_path / "keys" / "audit.key.pub").key_id == SigningKey.load_or_create(path).key_id


def test_missing_public_key_is_rewritten_and_a_wrong_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    created = SigningKey.load_or_create(path)
    (tmp_path / "audit.key.pub").unlink()
    SigningKey.load_or_create(path)
    assert VerifyKey.load(tmp_path / "audit.key.pub").key_id == created.key_id
    (tmp_path / "audit.key.pub").write_bytes(SigningKey.generate().public_pem())
    with pytest.raises(ValueError, match="is not the public key of"):
        SigningKey.load_or_create(path)


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    SigningKey.load_or_create(path)
    for loose in (0o644, 0o640, 0o604, 0o660):
        path.chmod(loose)
        with pytest.raises(
            ValueError, match=rf"{re.escape(str(path))} is accessible by group or others.*chmod 600"
        ) as raised:
            SigningKey.load_or_create(path)
        assert f"{loose:04o}" in str(raised.value)
    path.chmod(0o400)
    SigningKey.load_or_create(path)


def test_non_ed25519_keys_are_refused(tmp_path: Path) -> None:
    ec_key = ec.generate_private_key(ec.SECP256R1())
    path = tmp_path / "audit.key"
    path.write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} holds a \w+ key, not Ed25519"):
        SigningKey.load_or_create(path)
    pub = ec_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        VerifyKey.from_pem(pub)
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not an unencrypted PEM private key"):
        SigningKey.load_or_create(path)


def test_checkpoint_sign_verify_and_canonical_body(key: SigningKey) -> None:
    root = tree(5).root()
    checkpoint = sign_checkpoint(key, log="main", size=5, root=root, prev=None, time=TIME)
    assert checkpoint.verify(key.verify_key)
    assert VerifyKey.from_pem(key.public_pem()).key_id == checkpoint.key_id == key.key_id
    assert checkpoint.prev == ""
    assert checkpoint.root == root.hex()
    assert len(base64.b64decode(checkpoint.signature, validate=True)) == 64
    expected = {"key_id": key.key_id, "log": "main", "prev": "", "root": root.hex(), "size": 5, "time": TIME}
    assert checkpoint.body() == json.dumps(expected, sort_keys=True, separators=(",", ":")).encode()
    full = json.loads(checkpoint.signed_text())
    assert full == {**expected, "signature": checkpoint.signature}
    assert checkpoint.digest() == hashlib.sha256(checkpoint.signed_text()).hexdigest()
    assert Checkpoint.model_validate_json(checkpoint.model_dump_json()) == checkpoint
    now = sign_checkpoint(key, log="main", size=5, root=root, prev=None)
    assert now.time.endswith("Z")
    assert now.verify(key.verify_key)


def test_tampering_with_any_checkpoint_field_fails(key: SigningKey) -> None:
    checkpoint = sign_checkpoint(key, log="main", size=5, root=tree(5).root(), prev=None, time=TIME)
    other = sign_checkpoint(key, log="main", size=6, root=tree(6).root(), prev=checkpoint, time=TIME)
    signature = bytearray(base64.b64decode(checkpoint.signature))
    signature[0] ^= 1
    changes: list[dict[str, Any]] = [
        {"size": 6},
        {"size": 4},
        {"root": tree(6).root().hex()},
        {"time": "2026-11-22T10:00:00.000001Z"},
        {"prev": checkpoint.digest()},
        {"log": "mainx"},
        {"key_id": "0" * 16},
        {"signature": other.signature},
        {"signature": base64.b64encode(bytes(signature)).decode()},
        {"signature": ""},
        {"signature": "!!not base64!!"},
        {"signature": checkpoint.signature[:-4]},
    ]
    for change in changes:
        assert not checkpoint.model_copy(update=change).verify(key.verify_key), change
    assert checkpoint.verify(key.verify_key)


def test_another_key_fails(key: SigningKey) -> None:
    checkpoint = sign_checkpoint(key, log="main", size=5, root=tree(5).root(), prev=None, time=TIME)
    stranger = SigningKey.generate()
    assert not checkpoint.verify(stranger.verify_key)
    # Even claiming the stranger's key id, the signature is still the wrong key's.
    assert not checkpoint.model_copy(update={"key_id": stranger.key_id}).verify(stranger.verify_key)
    forged = sign_checkpoint(stranger, log="main", size=5, root=tree(5).root(), prev=None, time=TIME)
    assert not forged.model_copy(update={"key_id": key.key_id}).verify(key.verify_key)


def test_checkpoints_chain_by_digest(key: SigningKey) -> None:
    chain: list[Checkpoint] = []
    for size in (0, 3, 3, 10):
        chain.append(
            sign_checkpoint(key, log="main", size=size, root=tree(size).root(), prev=chain[-1] if chain else None)
        )
    assert chain[0].prev == ""
    for before, after in itertools.pairwise(chain):
        assert after.prev == before.digest() == hashlib.sha256(before.signed_text()).hexdigest()
        assert after.verify(key.verify_key)
    with pytest.raises(ValueError, match="cannot follow"):
        sign_checkpoint(key, log="main", size=9, root=tree(9).root(), prev=chain[-1])
    with pytest.raises(ValueError, match="cannot follow"):
        sign_checkpoint(key, log="other", size=11, root=tree(11).root(), prev=chain[-1])
    with pytest.raises(ValueError, match="32 bytes"):
        sign_checkpoint(key, log="main", size=11, root=b"short", prev=chain[-1])


def test_checkpoint_fields_are_validated(key: SigningKey) -> None:
    good = sign_checkpoint(key, log="main", size=5, root=tree(5).root(), prev=None, time=TIME).model_dump()
    bad: list[dict[str, Any]] = [
        {"size": -1},
        {"size": "5"},
        {"size": True},
        {"root": "AB" * 32},
        {"root": "ab" * 31},
        {"prev": "ab"},
        {"time": "2026-11-22T10:00:00+00:00"},
        {"time": "2026-13-22T10:00:00Z"},
        {"key_id": "xyz"},
        {"signature": "not base64!"},
        {"log": ""},
        {"extra": 1},
    ]
    for change in bad:
        with pytest.raises(ValidationError):
            Checkpoint.model_validate({**good, **change})
    with pytest.raises(ValidationError):
        Checkpoint.model_validate({k: v for k, v in good.items() if k != "prev"})
    assert Checkpoint.model_validate(good).verify(key.verify_key)


def segment(key: SigningKey) -> dict[str, Any]:
    compact = tree(7)
    return {
        "log": "main",
        "first_seq": 1,
        "last_seq": 7,
        "bytes": 4096,
        "sha256": hashlib.sha256(b"segment").hexdigest(),
        "last_hash": hashlib.sha256(b"event 7").hexdigest(),
        "tree": compact.to_json(),
        "checkpoint": sign_checkpoint(key, log="main", size=7, root=compact.root(), prev=None, time=TIME),
        "reason": "retention: older than 90 days",
        "time": TIME,
    }


def test_tombstone_sign_verify_and_tampering(key: SigningKey) -> None:
    tombstone = sign_tombstone(key, **segment(key))
    assert tombstone.verify(key.verify_key)
    assert not tombstone.verify(SigningKey.generate().verify_key)
    assert Tombstone.model_validate_json(tombstone.model_dump_json()) == tombstone
    assert Tombstone.model_validate(json.loads(tombstone.signed_text())) == tombstone
    assert json.loads(tombstone.body())["checkpoint"]["signature"] == tombstone.checkpoint.signature
    resumed = CompactRange.from_json(tombstone.tree)
    resumed.append(leaf_hash(b"event 7"))
    assert resumed.root() == tree(8).root()
    other = sign_checkpoint(key, log="main", size=7, root=tree(7).root(), prev=None, time="2026-11-22T10:00:01Z")
    changes: list[dict[str, Any]] = [
        {"log": "other"},
        {"first_seq": 2},
        {"last_seq": 6},
        {"bytes": 4095},
        {"sha256": "0" * 64},
        {"last_hash": "0" * 64},
        {"tree": tree(6).to_json()},
        {"checkpoint": other},
        {"reason": "retention"},
        {"time": "2026-11-22T10:00:01.000000Z"},
        {"key_id": "0" * 16},
        {"signature": sign_tombstone(key, **{**segment(key), "reason": "other"}).signature},
    ]
    for change in changes:
        assert not tombstone.model_copy(update=change).verify(key.verify_key), change
    assert sign_tombstone(key, **{k: v for k, v in segment(key).items() if k != "time"}).time.endswith("Z")


def test_tombstone_must_be_consistent(key: SigningKey) -> None:
    fields = segment(key)
    six = tree(6)
    bad: list[dict[str, Any]] = [
        {"last_seq": 6},
        {"first_seq": 8},
        {"first_seq": 0},
        {"tree": six.to_json()},
        {"tree": {"size": 7, "hashes": []}},
        {"checkpoint": sign_checkpoint(key, log="main", size=6, root=six.root(), prev=None)},
        {"checkpoint": sign_checkpoint(key, log="other", size=7, root=tree(7).root(), prev=None)},
        {"checkpoint": sign_checkpoint(key, log="main", size=7, root=six.root(), prev=None)},
        {"bytes": -1},
        {"sha256": "xyz"},
        {"key_id": key.key_id},
    ]
    for change in bad:
        with pytest.raises(ValueError):  # noqa: PT011  (each change trips a different check)
            sign_tombstone(key, **{**fields, **change})

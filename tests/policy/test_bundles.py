"""Policy bundles: built, signed, verified and loaded as OPA does, with every tampering refused
and the member at fault named (real regorus, real tarballs, real Ed25519 keys)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jwt as pyjwt
import pytest
import typer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings
from policy.bundle import (
    MANIFEST,
    MAX_MEMBERS,
    SIGNATURES,
    PrivateKey,
    build_bundle,
    canonical_bytes,
    file_hash,
    fingerprint,
    key_id,
    load_bundle,
    load_bundle_archive,
    load_public_key,
    sign_files,
)
from router.interfaces.bundle_cli import policy_build, policy_verify_bundle
from tests.conftest import copy_policies, edit_catalog

MEDIUM = PolicyInput.model_validate({
    "subject": {"agent": "a", "principal": "p@example.com"}, "session": {"id": "s-1"},
    "tool": {"name": "t", "capabilities": [], "risk": "medium"}, "args": {}, "now": "2026-11-22T10:00:00Z",
})  # fmt: skip


@dataclass
class Keys:
    private: Ed25519PrivateKey
    private_pem: Path
    public_pem: Path


def write_keys(where: Path, name: str) -> Keys:
    private = Ed25519PrivateKey.generate()
    private_pem, public_pem = where / f"{name}.pem", where / f"{name}.pub"
    pem = serialization.Encoding.PEM
    private_pem.write_bytes(private.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public_pem.write_bytes(private.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo))
    return Keys(private, private_pem, public_pem)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return write_keys(tmp_path, "signing")


def members_of(bundle: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(bundle, "r:gz") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]  # type: ignore[union-attr]


def pack(target: Path, members: list[tarfile.TarInfo | tuple[str, bytes]], *, fmt: int = tarfile.PAX_FORMAT) -> Path:
    """A gzip tarball of ``members``: (name, bytes) for a regular file, or a prepared TarInfo;
    ``fmt``: the tar format (GNU and ustar headers are attacks of their own)."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb") as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=fmt) as tar,
    ):
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            info = tarfile.TarInfo(member[0])
            info.size = len(member[1])
            tar.addfile(info, io.BytesIO(member[1]))
    target.write_bytes(buffer.getvalue())
    return target


def signed_bundle(tmp_path: Path, keys: Keys, revision: str = "v1") -> Path:
    return build_bundle(copy_policies(tmp_path), tmp_path / "bundle.tar.gz", revision=revision,
                        signing_key=keys.private).root  # fmt: skip


def test_a_built_bundle_carries_the_directory_and_loads_into_the_engine_that_decides(
    tmp_path: Path, keys: Keys
) -> None:
    root = copy_policies(tmp_path)
    bundle = build_bundle(root, tmp_path / "b.tar.gz", revision="2026.11.1", signing_key=keys.private)
    directory = load_bundle(root)
    assert bundle.revision == f"2026.11.1+{directory.revision}"  # the manifest revision plus the content hash
    assert (bundle.content_hash, bundle.signed_by) == (directory.revision, key_id(keys.private.public_key()))
    assert bundle.modules == directory.modules
    assert bundle.data == directory.data
    names = [name for name, _ in members_of(tmp_path / "b.tar.gz")]
    assert names[:2] == [MANIFEST, SIGNATURES]
    assert set(names[2:]) == {rel for rel, _ in directory.modules} | {
        "stockade/data.json",
        "stockade/reasons/data.json",
    }
    manifest = json.loads(dict(members_of(tmp_path / "b.tar.gz"))[MANIFEST])
    assert manifest["revision"] == "2026.11.1"
    assert "stockade" in manifest["roots"]

    engine = EmbeddedEngine(PolicySettings(bundle=tmp_path / "b.tar.gz", bundle_public_key=keys.public_pem))
    assert engine.revision == bundle.revision
    decision = engine.evaluate(MEDIUM)
    assert (decision.outcome, decision.policy_revision) == (Outcome.ALLOW, bundle.revision)
    unsigned = build_bundle(root, tmp_path / "u.tar.gz")
    assert unsigned.revision == directory.revision
    assert unsigned.signed_by is None
    assert EmbeddedEngine(PolicySettings(bundle=tmp_path / "u.tar.gz")).evaluate(MEDIUM).outcome is Outcome.ALLOW


async def test_hot_reload_picks_up_a_replaced_bundle_and_keeps_the_old_one_over_a_tampered_one(
    tmp_path: Path, keys: Keys
) -> None:
    root = copy_policies(tmp_path)
    target = tmp_path / "bundle.tar.gz"
    first = build_bundle(root, target, revision="v1", signing_key=keys.private)
    engine = EmbeddedEngine(PolicySettings(bundle=target, bundle_public_key=keys.public_pem))
    seen = fingerprint(target)
    edit_catalog(root, auto_allow_risks=["low"])  # medium-risk calls now need more than policy
    second = build_bundle(root, target, revision="v2", signing_key=keys.private)
    assert fingerprint(target) != seen  # what the control plane's watcher compares
    assert await engine.reload() == second.revision != first.revision
    assert (await engine.decide(MEDIUM)).reasons[0].code == "policy.default_deny"
    assert engine.load_status.error is None

    members = [(n, b + b"\ndefault allow_everything := true\n" if n == "stockade/risk.rego" else b)
               for n, b in members_of(target)]  # fmt: skip
    pack(target, members)
    with pytest.raises(PolicyBundleError, match=r"stockade/risk\.rego"):
        await engine.reload()
    assert engine.revision == second.revision
    status = engine.load_status
    assert status.revision == second.revision
    assert status.error is not None
    assert "member 'stockade/risk.rego' was modified after signing" in status.error
    assert status.failed_revision is not None
    assert status.failed_revision.startswith("sha256:")
    assert (await engine.decide(MEDIUM)).policy_revision == second.revision  # the good bundle still decides


def forged_token(
    files: dict[str, bytes], header: dict[str, str], signer: Ed25519PrivateKey | Callable[[bytes], bytes]
) -> bytes:
    """A .signatures.json with the given JWS header, signed by ``signer`` (a key, or a function of
    the signing input: made by hand, so any header and signature can be tried)."""

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    sign = signer.sign if isinstance(signer, Ed25519PrivateKey) else signer
    payload = {"files": [{"name": n, "hash": file_hash(n, b), "algorithm": "SHA-256"} for n, b in files.items()]}
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    return json.dumps({"signatures": [f"{signing_input}.{b64(sign(signing_input.encode()))}"]}).encode()


def got_through(what: str, load: Callable[[], object], expected: str) -> list[str]:
    """[] if ``load`` is refused with a message naming ``expected``; else what got through."""
    try:
        load()
    except PolicyBundleError as exc:
        return [] if expected in str(exc) else [f"{what}: refused without naming it: {exc}"]
    return [f"{what}: loaded"]


def padded(name: str, header_bytes: int) -> tarfile.TarInfo:
    """An empty member behind a PAX header of ``header_bytes`` (read whole before the member)."""
    info = tarfile.TarInfo(name)
    info.pax_headers = {"comment": "x" * header_bytes}
    return info


def link(name: str, target: str, kind: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


Tamper = Callable[[list[tuple[str, bytes]], Keys, Keys], list[tarfile.TarInfo | tuple[str, bytes]]]


def _replace(members: list[tuple[str, bytes]], name: str, raw: bytes) -> list[tarfile.TarInfo | tuple[str, bytes]]:
    return [(n, raw if n == name else b) for n, b in members]


def _resigned(members: list[tuple[str, bytes]], signer: Ed25519PrivateKey, kid: str,
              alg: str = "EdDSA") -> list[tarfile.TarInfo | tuple[str, bytes]]:  # fmt: skip
    files = {n: b for n, b in members if n != SIGNATURES}
    return [*files.items(), (SIGNATURES, forged_token(files, {"alg": alg, "typ": "JWT", "kid": kid}, signer))]


# Each tampering, and the member (or file) the refusal must name.
TAMPERINGS: dict[str, tuple[Tamper, str]] = {
    "modified rego": (
        lambda m, _, __: _replace(m, "stockade/decision.rego", dict(m)["stockade/decision.rego"] + b"\n# harmless?\n"),
        "'stockade/decision.rego' was modified",
    ),
    "modified data": (
        lambda m, _, __: _replace(
            m, "stockade/data.json", json.dumps({**json.loads(dict(m)["stockade/data.json"]), "extra": 1}).encode()
        ),
        "'stockade/data.json' was modified",
    ),
    "modified manifest": (
        lambda m, _, __: _replace(m, MANIFEST, b'{"revision": "v9", "roots": ["stockade"]}'),
        "'.manifest' was modified",
    ),
    "added file": (
        lambda m, _, __: [*m, ("stockade/zz_allow.rego", b"package stockade\n")],
        "'stockade/zz_allow.rego' is not covered by the signature",
    ),
    "removed file": (
        lambda m, _, __: [(n, b) for n, b in m if n != "stockade/risk.rego"],
        "'stockade/risk.rego' is signed but missing",
    ),
    "unsigned": (lambda m, _, __: [(n, b) for n, b in m if n != SIGNATURES], "is not signed"),
    "signed by another key": (
        lambda m, _, other: _resigned(m, other.private, key_id(other.private.public_key())),
        "signed with key",
    ),
    "another key claiming ours": (
        lambda m, ours, other: _resigned(m, other.private, key_id(ours.private.public_key())),
        "does not verify",
    ),
    "alg none": (
        lambda m, ours, _: _resigned(m, ours.private, key_id(ours.private.public_key()), alg="none"),
        "alg 'none' is not accepted",
    ),
    "traversal": (lambda m, _, __: [*m, ("../stockade/evil.rego", b"package stockade\n")], "'../stockade/evil.rego'"),
    "absolute name": (lambda m, _, __: [*m, ("/etc/evil.rego", b"package stockade\n")], "'/etc/evil.rego'"),
    "symlink": (
        lambda m, _, __: [*m, link("stockade/passwd.rego", "/etc/passwd", tarfile.SYMTYPE)],
        "'stockade/passwd.rego' is a link",
    ),
    "hard link": (
        lambda m, _, __: [*m, link("stockade/again.rego", "stockade/risk.rego", tarfile.LNKTYPE)],
        "'stockade/again.rego' is a link",
    ),
    "duplicate name": (
        lambda m, _, __: [*m, ("stockade/risk.rego", b"package stockade\n")],
        "'stockade/risk.rego' appears twice",
    ),
    "tar bomb": (
        lambda m, _, __: [*m, ("stockade/zeros/data.json", b"0" * (2 << 20))],
        "'stockade/zeros/data.json' (2097152 bytes)",
    ),
    "header bomb": (
        lambda m, _, __: [*m, padded("stockade/padded.rego", 16 << 20)],
        "decompresses to more than",
    ),
    "member flood": (
        lambda m, _, __: [*m, *((f"stockade/f{i}/data.json", b"{}") for i in range(MAX_MEMBERS))],
        f"more than {MAX_MEMBERS} members",
    ),
    "other file type": (
        lambda m, _, __: [*m, ("stockade/run.sh", b"#!/bin/sh\n")],
        "'stockade/run.sh' is not a policy file",
    ),
}


def test_every_tampering_is_refused_naming_the_member(tmp_path: Path, keys: Keys) -> None:
    other = write_keys(tmp_path, "attacker")
    original = members_of(signed_bundle(tmp_path, keys))
    settings = PolicySettings(bundle=tmp_path / "x", bundle_public_key=keys.public_pem)  # the router's view
    undetected: list[str] = []
    for name, (tamper, expected) in TAMPERINGS.items():
        target = pack(tmp_path / f"{name.replace(' ', '-')}.tar.gz", tamper(original, keys, other))
        undetected += got_through(
            name, lambda t=target: EmbeddedEngine(settings.model_copy(update={"dir": t, "bundle": t})), expected
        )
    assert undetected == []
    assert len(TAMPERINGS) == 18


def test_signatures_follow_opa_hashing_and_signed_bundles_need_a_key(tmp_path: Path, keys: Keys) -> None:
    """Data files are hashed as sorted JSON (reformatting them keeps the signature, as in OPA);
    numbers by their literal; Rego by its bytes. A signed bundle without a key is refused, as OPA does."""
    assert file_hash("a/data.json", b'{"b": 1, "a": [true, null]}') == file_hash(
        "a/data.json", b'{"a":[true,null],"b":1}'
    )
    assert file_hash("a/data.json", b'{"a": 1}') != file_hash("a/data.json", b'{"a": 1.0}')
    assert file_hash("x.rego", b"package x\n") != file_hash("x.rego", b"package x\n\n")
    target = signed_bundle(tmp_path, keys)
    members = members_of(target)
    data = json.loads(dict(members)["stockade/data.json"])
    pack(target, _replace(members, "stockade/data.json", json.dumps(data, indent=7).encode()))
    assert (
        load_bundle_archive(target, public_key=keys.private.public_key()).data["stockade"]["catalog"] == data["catalog"]
    )
    with pytest.raises(PolicyBundleError, match="is signed, but no public key is configured"):
        load_bundle_archive(target)
    with pytest.raises(PolicyBundleError, match="is a directory, which carries no signature"):
        EmbeddedEngine(PolicySettings(dir=copy_policies(tmp_path / "d"), bundle_public_key=keys.public_pem))
    payload = sign_files({"stockade/x.rego": b"package stockade\n"}, keys.private)
    assert json.loads(payload)["signatures"][0].count(".") == 2  # one compact JWS, as OPA writes


# OPA's own digests for files of its signing tests (v1/bundle/sign_test.go; the manifest's MD5 is
# also what OPA reports computing in verify_test.go): structured files hashed after `walk`.
OPA_DIGESTS = [
    (".manifest", b'{"revision": "quickbrownfaux"}', "md5", "a005c38a509dc2d5a7407b9494efb2ad"),
    ("a/b/c/data.json", b"[1,2,3]", "sha512",
     "60f7b5dc86ded48785436192a08dbfd04894d7f1b417c4f8d3714679a7f78cb3c833f16a8559a1cf1f32968747dc1d95ef34826263dacf125ded8f5c374be4c0"),
    ("a/b/d/data.json", b"true", "md5", "b326b5062b2f0e69046810717534cb09"),
    ("data.json", b'{"x": {"y": true}, "a": {"b": {"z": true}}}', "md5", "36669864a622563256817033b1fc53db"),
]  # fmt: skip


def test_files_are_hashed_to_opas_own_digests() -> None:
    assert [
        hashlib.new(algorithm, canonical_bytes(name, raw)).hexdigest() for name, raw, algorithm, _ in OPA_DIGESTS
    ] == [digest for *_, digest in OPA_DIGESTS]


def _opa_keys() -> dict[str, tuple[PrivateKey, str]]:
    """A key of each kind OPA signs bundles with, and the JWS algorithm to sign with."""
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return {
        "RSA RS256 (OPA's default)": (rsa_key, "RS256"),
        "RSA PS512": (rsa_key, "PS512"),
        "EC P-256 ES256": (ec.generate_private_key(ec.SECP256R1()), "ES256"),
        "EC P-384 ES384": (ec.generate_private_key(ec.SECP384R1()), "ES384"),
        "Ed25519 EdDSA": (Ed25519PrivateKey.generate(), "EdDSA"),
    }


def _pem_public(where: Path, key: PrivateKey) -> Path:
    where.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return where


def _opa_signed(files: dict[str, bytes], key: PrivateKey | bytes, alg: str, hashing: str = "SHA-256",
                header: dict[str, str] | None = None) -> bytes:  # fmt: skip
    """A .signatures.json as OPA writes one, made by PyJWT (a JWS implementation of its own): kid
    an operator's key name, no iat, files hashed with ``hashing``."""
    digest = {"MD5": "md5", "SHA-1": "sha1", "SHA-256": "sha256", "SHA-512": "sha512"}[hashing]
    listed = [{"name": n, "hash": hashlib.new(digest, canonical_bytes(n, b)).hexdigest(), "algorithm": hashing}
              for n, b in files.items()]  # fmt: skip
    payload = {"files": listed}
    token = pyjwt.encode(payload, key, algorithm=alg, headers=header or {"kid": "global_key"})  # type: ignore[arg-type]
    return json.dumps({"signatures": [token]}).encode()


def _hs256(files: dict[str, bytes], secret: bytes) -> bytes:
    """A .signatures.json MACed with ``secret`` under HS256 (made by hand: PyJWT refuses a PEM secret)."""
    return forged_token(files, {"alg": "HS256", "typ": "JWT"}, lambda data: hmac.new(secret, data, "sha256").digest())


def test_bundles_signed_with_each_kind_of_key_opa_takes_load_and_others_are_refused(tmp_path: Path) -> None:
    """An RSA, EC or Ed25519 key, with the algorithms OPA signs with: a bundle signed as OPA signs
    (other key names, other hashes than SHA-256) loads; the same bundle with one byte changed,
    signed by another key of the kind, or under an algorithm the key is not for, does not."""
    base = [(n, b) for n, b in members_of(build_bundle(copy_policies(tmp_path), tmp_path / "u.tar.gz").root)]
    files = dict(base)
    loaded = []
    for name, (key, alg) in _opa_keys().items():
        public = _pem_public(tmp_path / "k.pub", key)
        for hashing in ("SHA-256", "SHA-512"):
            target = pack(tmp_path / "opa.tar.gz", [*base, (SIGNATURES, _opa_signed(files, key, alg, hashing))])
            bundle = load_bundle_archive(target, public_key=load_public_key(public))
            loaded.append((name, hashing, bundle.signed_by == key_id(load_public_key(public))))
        tampered = _replace(base, "stockade/data.json", files["stockade/data.json"].replace(b"{", b"{ ", 1) + b" ")
        tampered = _replace(tampered, "stockade/risk.rego", files["stockade/risk.rego"] + b"\n# edited\n")
        pack(tmp_path / "t.tar.gz", [*tampered, (SIGNATURES, _opa_signed(files, key, alg))])
        with pytest.raises(PolicyBundleError, match=r"'stockade/risk\.rego' was modified after signing"):
            load_bundle_archive(tmp_path / "t.tar.gz", public_key=load_public_key(public))
        other = _opa_keys()[name][0]
        pack(tmp_path / "o.tar.gz", [*base, (SIGNATURES, _opa_signed(files, other, alg))])
        with pytest.raises(PolicyBundleError, match="the signature does not verify with"):
            load_bundle_archive(tmp_path / "o.tar.gz", public_key=load_public_key(public))
    assert all(ok for *_, ok in loaded), loaded
    assert len(loaded) == 10


def test_a_header_cannot_pick_an_algorithm_the_key_is_not_for(tmp_path: Path) -> None:
    """HS256 keyed with the public key's own PEM (the classic confusion), an EC curve's algorithm
    for another curve, RSA under EdDSA, and weak file hashes: each refused, saying why."""
    base = [(n, b) for n, b in members_of(build_bundle(copy_policies(tmp_path), tmp_path / "u.tar.gz").root)]
    files = dict(base)
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_pem = _pem_public(tmp_path / "rsa.pub", rsa_key)
    p256 = ec.generate_private_key(ec.SECP256R1())
    p256_pem = _pem_public(tmp_path / "p256.pub", p256)
    attempts = {
        "HS256 with the public PEM as secret": (rsa_pem, _hs256(files, rsa_pem.read_bytes()),
                                                "JWT alg 'HS256' is not accepted"),
        "ES384 for a P-256 key": (p256_pem, _opa_signed(files, ec.generate_private_key(ec.SECP384R1()), "ES384"),
                                  "JWT alg 'ES384' is not accepted"),
        "EdDSA for an RSA key": (rsa_pem, _opa_signed(files, Ed25519PrivateKey.generate(), "EdDSA"),
                                 "JWT alg 'EdDSA' is not accepted"),
        "MD5 file hashes": (rsa_pem, _opa_signed(files, rsa_key, "RS256", "MD5"), "hashed with 'MD5', too weak"),
        "SHA-1 file hashes": (p256_pem, _opa_signed(files, p256, "ES256", "SHA-1"), "hashed with 'SHA-1', too weak"),
    }  # fmt: skip
    through: list[str] = []
    for what, (public, signatures, expected) in attempts.items():
        target = pack(tmp_path / "a.tar.gz", [*base, (SIGNATURES, signatures)])
        through += got_through(
            what, lambda t=target, k=public: load_bundle_archive(t, public_key=load_public_key(k)), expected
        )
    assert through == []
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)  # noqa: S505  (the weak key refused)
    with pytest.raises(PolicyBundleError, match="1024-bit RSA key"):
        load_public_key(_pem_public(tmp_path / "weak.pub", weak))


def test_stockade_signs_with_rsa_and_ec_keys_as_opa_does(tmp_path: Path) -> None:
    """``stockade policy build --signing-key`` with an RSA key signs RS256 (what OPA's ``keys``
    expect by default), with an EC key ES256/384 by curve; PyJWT checks each signature."""
    for name, (key, alg) in _opa_keys().items():
        if alg in ("PS512", "EdDSA"):
            continue
        root = copy_policies(tmp_path / name.split()[0] / alg)
        bundle = build_bundle(root, root.parent / "b.tar.gz", signing_key=key)
        token = json.loads(dict(members_of(root.parent / "b.tar.gz"))[SIGNATURES])["signatures"][0]
        claims = pyjwt.decode(token, key.public_key(), algorithms=[alg])  # type: ignore[arg-type]
        assert pyjwt.get_unverified_header(token)["alg"] == alg
        assert {f["name"] for f in claims["files"]} == {n for n, _ in members_of(root.parent / "b.tar.gz")} - {
            SIGNATURES
        }
        assert bundle.signed_by == key_id(key.public_key())


def test_manifest_roots_bound_what_a_bundle_may_define(tmp_path: Path) -> None:
    rego = b"package other\n\nallow := true\n"
    target = pack(tmp_path / "r.tar.gz", [(MANIFEST, b'{"revision": "r", "roots": ["stockade"]}'),
                                          ("stockade/policy.rego", b"package stockade\n\nx := 1\n"),
                                          ("other/policy.rego", rego)])  # fmt: skip
    with pytest.raises(PolicyBundleError, match=r"'other/policy\.rego' has package other, outside"):
        load_bundle_archive(target)


def test_cli_builds_and_verifies_bundles(tmp_path: Path, keys: Keys) -> None:
    cli = typer.Typer()
    cli.command("build")(policy_build)
    cli.command("verify-bundle")(policy_verify_bundle)
    runner = CliRunner()
    root = copy_policies(tmp_path)
    target = tmp_path / "out.tar.gz"
    built = runner.invoke(cli, ["build", str(root), "-o", str(target), "--revision", "r7",
                                "--signing-key", str(keys.private_pem), "--json"])  # fmt: skip
    assert built.exit_code == 0, built.output
    report = json.loads(built.stdout)
    assert report["manifest_revision"] == "r7"
    assert report["signed_by"] == key_id(keys.private.public_key())
    verified = runner.invoke(cli, ["verify-bundle", str(target), "--public-key", str(keys.public_pem)])
    assert verified.exit_code == 0, verified.output
    assert f"revision {report['revision']}" in verified.stdout
    assert "signed by ed25519:" in verified.stdout

    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_pem = tmp_path / "rsa.pem"
    rsa_pem.write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))  # fmt: skip
    rsa_built = runner.invoke(cli, ["build", str(root), "-o", str(tmp_path / "rsa.tar.gz"), "--signing-key",
                                    str(rsa_pem)])  # fmt: skip
    assert rsa_built.exit_code == 0, rsa_built.output
    rsa_public = _pem_public(tmp_path / "rsa.pub", rsa_key)
    rsa_verified = runner.invoke(cli, ["verify-bundle", str(tmp_path / "rsa.tar.gz"), "--public-key", str(rsa_public)])
    assert rsa_verified.exit_code == 0, rsa_verified.output
    assert "signed by rsa:" in rsa_verified.stdout

    other = write_keys(tmp_path, "other")
    wrong = runner.invoke(cli, ["verify-bundle", str(target), "--public-key", str(other.public_pem)])
    assert wrong.exit_code == 1
    assert "signed with key" in wrong.output
    pack(target, [*members_of(target), ("stockade/zz.rego", b"package stockade\n")])
    added = runner.invoke(cli, ["verify-bundle", str(target), "--public-key", str(keys.public_pem)])
    assert added.exit_code == 1
    assert "'stockade/zz.rego' is not covered by the signature" in added.output
    (root / "stockade" / "broken.rego").write_text("package stockade\n\nthis is not rego\n")
    broken = runner.invoke(cli, ["build", str(root), "-o", str(tmp_path / "never.tar.gz")])
    assert broken.exit_code == 2
    assert "broken.rego" in broken.output
    assert not (tmp_path / "never.tar.gz").exists()
    missing_key = runner.invoke(cli, ["verify-bundle", str(target), "--public-key", str(tmp_path / "nope.pub")])
    assert missing_key.exit_code == 2

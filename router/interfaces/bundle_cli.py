"""`stockade policy build` and `stockade policy verify-bundle`: policy bundles as OPA makes them
(a gzip tarball with ``.manifest`` and, signed, ``.signatures.json``; see `policy.bundle`), for a
router to load with ``STOCKADE_POLICY__BUNDLE`` and ``STOCKADE_POLICY__BUNDLE_PUBLIC_KEY``.

Keys are PEM files of the kinds OPA signs bundles with: Ed25519 (``openssl genpkey -algorithm
ed25519 -out signing.pem``), RSA of at least 2048 bits (RS256) or EC P-256/384/521 (ES256/384/512);
``openssl pkey -in signing.pem -pubout -out signing.pub`` makes the public key.

Exit codes: 0 built, or verified; 1 the bundle is refused (not signed as required, altered, unsafe,
or its policy does not compile); 2 bad input (a directory that does not load, an unreadable key,
a BUNDLE path with nothing there).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from router.interfaces.cli_common import JsonFlag, emit_json, fail, out, settings_of

if TYPE_CHECKING:  # the bundle code (JWS, keys) and the engine only for these two commands
    from policy import PolicyBundle
    from policy.config import PolicySettings


def _policy_settings(ctx: typer.Context) -> PolicySettings:
    """The configured policy settings (size caps)."""
    return settings_of(ctx).policy


def _summary(bundle: PolicyBundle) -> dict[str, object]:
    return {
        "path": str(bundle.root),
        "revision": bundle.revision,
        "manifest_revision": bundle.manifest_revision,
        "content_hash": bundle.content_hash,
        "signed_by": bundle.signed_by,
        "files": [path for path, _ in bundle.modules],
    }


def policy_build(
    ctx: typer.Context,
    directory: Annotated[Path, typer.Argument(help="The policy directory to bundle.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The bundle file to write (.tar.gz).")],
    revision: Annotated[str, typer.Option("--revision", "-r", help="The manifest revision (e.g. a git sha).")] = "",
    signing_key: Annotated[
        Path | None, typer.Option("--signing-key", help="Sign with this private key (PEM: Ed25519, RSA or EC).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Bundle a policy directory into a gzip tarball with a manifest and, given a key, a signature
    (.signatures.json, OPA's format). The policy must compile; the file appears whole (written
    beside and renamed), so a router watching it never loads half of one."""
    from policy import EmbeddedEngine, PolicyBundleError  # noqa: PLC0415
    from policy.bundle import build_bundle, load_private_key  # noqa: PLC0415

    settings = _policy_settings(ctx)
    try:
        key = load_private_key(signing_key) if signing_key is not None else None
        EmbeddedEngine(settings.model_copy(update={"dir": directory, "bundle": None, "bundle_public_key": None}))
        bundle = build_bundle(directory, output, revision=revision, signing_key=key,
                              max_bytes=settings.max_policy_bytes)  # fmt: skip
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    if as_json:
        emit_json(_summary(bundle))
        return
    signed = f"signed by {bundle.signed_by}" if bundle.signed_by else "unsigned"
    out.print(f"built {output}: revision {bundle.revision}, {len(bundle.modules)} modules, {signed}", markup=False)


def policy_verify_bundle(
    ctx: typer.Context,
    bundle_file: Annotated[Path, typer.Argument(metavar="BUNDLE", help="The bundle file (.tar.gz).")],
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Public key (PEM: Ed25519, RSA or EC) it must be signed with.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Check a bundle as the router would load it: safe to read, signed with the key and unaltered
    (no file added, removed or changed), and compiling. Without --public-key the bundle must be
    unsigned: a signature that cannot be checked is refused, as OPA refuses it."""
    from policy import EmbeddedEngine, PolicyBundleError  # noqa: PLC0415
    from policy.bundle import load_public_key  # noqa: PLC0415

    settings = _policy_settings(ctx)
    if not bundle_file.exists():  # nothing to verify: bad usage (2), not a bundle refused (1)
        raise fail(f"BUNDLE {bundle_file}: no such file; pass the bundle's path (the .tar.gz `policy build` wrote)")
    try:
        if public_key is not None:
            load_public_key(public_key)  # an unreadable key is bad input (2), not a refused bundle
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    try:
        engine = EmbeddedEngine(settings.model_copy(update={"dir": bundle_file, "bundle": bundle_file,
                                                            "bundle_public_key": public_key}))  # fmt: skip
    except PolicyBundleError as exc:
        raise fail(f"refused: {exc}", code=1) from exc
    if as_json:
        emit_json({"verified": True, **_summary(engine.bundle)})
        return
    signed = f"signed by {engine.bundle.signed_by}" if engine.bundle.signed_by else "unsigned"
    out.print(f"verified {bundle_file}: revision {engine.revision}, {len(engine.bundle.modules)} modules, {signed}",
              markup=False)  # fmt: skip

"""An attacker's pass over issue 15's features: principal groups and labels, session labels, rate
windows, signed policy bundles and the policy tooling (check, test, explain, eval, verify-bundle,
replay) fed hostile Rego, data and audit logs.

Each test tries a family of attacks for real (real regorus, real tarballs and Ed25519 keys, a
real Redis for two routers, the HTTP API over ASGI, the CLI as a subprocess), counts what got
through, and asserts that nothing did: no escalation, every error a refusal on record, every
tampered bundle refused, no traceback, no terminal control text from a log or a policy."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from policy import PolicyBundleError, PolicySettings
from policy.bundle import (
    MANIFEST,
    SIGNATURES,
    build_bundle,
    file_hash,
    key_id,
    load_bundle,
    load_bundle_archive,
    sign_files,
)
from router import ControlPlane, PolicyError, Settings, StockadeError
from router.audit import AuditFilter
from router.audit.chain import GENESIS_HASH, line_hash
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings, StoreSettings
from tests.conftest import ECHO, REPO, external_tool, python_tool, stockade_server
from tests.policy.test_bundles import pack

STOCKADE = str(Path(sys.executable).parent / "stockade")
SEND = external_tool("send_email", capabilities=["sends_external"])
READ = external_tool("read_customers", capabilities=["reads_private"])

ALLOW_ALL = """
package stockade

import rego.v1

default decision := {"outcome": "allow"}
"""

DENY_ALL = """
package stockade

import rego.v1

default decision := {"outcome": "deny", "reasons": [{"code": "nope.denied", "message": "denied"}]}
"""

# Deploy only for admins: what an agent would want to claim.
ADMINS_ONLY = """
package stockade

import rego.v1

default decision := {"outcome": "deny", "reasons": [{"code": "nope.not_admin", "message": "admins only"}]}

decision := {"outcome": "allow"} if "admins" in input.subject.groups
"""

# Sending needs a label no rule ever sets: only an agent writing labels itself could send.
CLEARED_ONLY = """
package stockade

import rego.v1

default decision := {"outcome": "deny", "reasons": [{"code": "nope.not_cleared", "message": "not cleared"}]}

decision := {"outcome": "allow"} if "cleared" in input.session.labels
"""

AGENT_HOURLY_LIMIT = """
package stockade

import rego.v1

default decision := {"outcome": "allow"}

decision := {"outcome": "deny", "reasons": [{"code": "rate.exceeded", "message": "over 3 an hour"}]} if {
	input.rate.agent_per_hour > 3
}
"""

MARKUP = "[bold red]pwned[/bold red] [link=https://evil.test]click[/link]"
ESCAPES = "\x1b[2J\x1b]8;;https://evil.test\x1b\\click\x1b]8;;\x1b\\\x1b[31m"
MARKUP_REASON = (
    "package stockade\n\nimport rego.v1\n\n"
    'default decision := {"outcome": "deny", "reasons": [{"code": "nope.markup", "message": '
    + json.dumps(MARKUP + ESCAPES)
    + "}]}\n"
)

DEEP = 100_000  # nesting far past any recursion limit, in a few hundred kB


def policy_dir(root: Path, rego: str, data: str | None = None) -> Path:
    (root / "stockade").mkdir(parents=True, exist_ok=True)
    (root / "stockade" / "decision.rego").write_text(rego)
    if data is not None:
        (root / "data.json").write_text(data)
    return root


def settings_for(tmp_path: Path, rego: str, store_url: str | None = None, **fields: Any) -> Settings:
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(dir=policy_dir(tmp_path / "policies", rego), watch_interval_s=0),
        store=StoreSettings(url=store_url),
        **fields,
    )


def deep_json() -> str:
    return '{"x": ' + "[" * DEEP + "]" * DEEP + "}"


def run_cli(*args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCKADE_")}
    env.update({"STOCKADE_LOG_LEVEL": "error", "COLUMNS": "200"})
    return subprocess.run(
        [STOCKADE, *args], input=stdin, env=env, cwd=REPO, capture_output=True, timeout=timeout, check=False
    )


def crashed(done: subprocess.CompletedProcess[bytes]) -> bool:
    """A traceback, or an exit that is not one of the CLI's (0 ok, 1 refused/failed, 2 bad input)."""
    text = done.stdout + done.stderr
    return b"Traceback" in text or done.returncode not in (0, 1, 2)


# -- principals: groups are configuration, never the agent's to claim ------------------------------


TOKENS = {"bot": "tok-bot", "lister": "tok-lister"}


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ControlPlane]]:
    """The API: alice is an admin by configuration; ``bot`` acts for anyone unconfigured,
    ``lister`` only for bob."""
    settings = settings_for(
        tmp_path, ADMINS_ONLY,
        principals={"alice@example.com": {"groups": ["admins"], "labels": {"team": "ops"}}},
        api_principals=[
            ApiPrincipal(name="bot", role="agent", token_sha256=token_hash("tok-bot")),
            ApiPrincipal(name="lister", role="agent", token_sha256=token_hash("tok-lister"),
                         acts_for=["bob@example.com"]),
        ],
    )  # fmt: skip
    async with (
        ControlPlane.from_settings(settings) as plane,
        httpx.AsyncClient(transport=httpx.ASGITransport(create_app(plane)), base_url="http://s") as client,
    ):
        await plane.register(SEND)
        yield client, plane


ALICE = "alice@example.com"
ALICE_VARIANTS = [
    "Alice@example.com",
    "ALICE@EXAMPLE.COM",
    "alice@example.com ",
    " alice@example.com",
    "alice@example.com\u200b",  # zero-width space (not printable: refused at the door)
    "\uff41lice@example.com",  # fullwidth a
    "a\u0301lice@example.com",  # combining accent
    "alice@example.com.",
    "alice@example.com\t",
]


async def test_no_spelling_of_a_configured_principal_and_no_header_gives_an_agent_its_groups(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    client, plane = api
    through: list[str] = []
    for token in ("tok-bot", "tok-lister"):
        for principal in ["alice@example.com", *ALICE_VARIANTS]:
            headers = {"Authorization": f"Bearer {token}", "X-Stockade-Groups": "admins",
                       "X-Stockade-Principal": ALICE, "X-Forwarded-User": ALICE}  # fmt: skip
            opened = await client.post("/v1/sessions", json={"principal": principal, "groups": ["admins"]},
                                       headers=headers)  # fmt: skip
            if opened.status_code == 201:
                through.append(f"{token} opened {principal!r} with a groups field")
            opened = await client.post("/v1/sessions", json={"principal": principal}, headers=headers)
            if opened.status_code != 201:
                continue
            session = opened.json()["session_id"]
            call = await client.post(f"/v1/sessions/{session}/calls", json={"tool": "send_email", "args": {}},
                                     headers=headers)  # fmt: skip
            if call.json().get("status") == "awaiting_report":
                through.append(f"{token} as {principal!r} was allowed")
    inputs = [e.input for e in await plane.audit.query(AuditFilter(kind="decision", tool="send_email")) if e.input]
    through += [f"{i['subject']['agent']} got {i['subject']['groups']}" for i in inputs if i["subject"]["groups"]]
    assert through == []
    assert inputs  # the unconfigured spellings were decided, with no groups


async def test_an_agent_cannot_act_for_a_principal_its_acts_for_omits_over_mcp_http(tmp_path: Path) -> None:
    """``acts_for`` bounds an agent to the principals it names: over MCP's HTTP transport the
    token names the agent and the server's --principal the human, so an agent whose acts_for
    omits that principal must not get a session for it (and its groups)."""
    tokens = {"mallory": secrets.token_urlsafe(24)}
    api_principals = [{"name": "mallory", "role": "agent", "token_sha256": token_hash(tokens["mallory"]),
                       "acts_for": ["bob@example.com"]}]  # fmt: skip
    (tmp_path / "tools.json").write_text(json.dumps([python_tool("echo", ECHO)]))
    policies = policy_dir(tmp_path / "policies", DENY_ALL)
    env = {"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"), "STOCKADE_LOG_LEVEL": "error",
           "STOCKADE_POLICY__DIR": str(policies), "STOCKADE_API_PRINCIPALS": json.dumps(api_principals),
           "STOCKADE_PRINCIPALS": json.dumps({"alice@example.com": {"groups": ["admins"]}})}  # fmt: skip
    args = ["mcp", "--agent", "claude", "--principal", "alice@example.com", "--tools", str(tmp_path / "tools.json"),
            "--http"]  # fmt: skip
    try:
        with stockade_server(args, env, tmp_path / "mcp.log", "/mcp") as url:
            async with (
                create_mcp_http_client(headers={"Authorization": f"Bearer {tokens['mallory']}"}) as http,
                Client(streamable_http_client(url + "/mcp", http_client=http)) as client,
            ):
                await client.call_tool("echo", {"word": "hi"})
    except Exception:  # noqa: S110  (a refusal of any shape is the wanted outcome)
        pass
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    through = [e["input"]["subject"] for e in audit if e["kind"] == "decision" and e.get("agent") == "mallory"
               and e["input"]["subject"]["principal"] == "alice@example.com"]  # fmt: skip
    assert through == []


# -- session labels: policy's alone ---------------------------------------------------------------


async def test_an_agent_cannot_write_session_labels_itself(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, CLEARED_ONLY, api_principals=[
        ApiPrincipal(name="bot", role="agent", token_sha256=token_hash("tok-bot")),
    ])  # fmt: skip
    bot = {"Authorization": "Bearer tok-bot"}
    tries: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"principal": "bob", "labels": ["cleared"]}, {}),
        ({"principal": "bob", "session_labels": ["cleared"]}, {}),
        ({"principal": "bob", "trusted_context": ["cleared", "label:cleared"]}, {}),
        ({"principal": "label:cleared"}, {}),
        ({"principal": "bob"}, {"obligations": {"session_labels": ["cleared"]}}),
        ({"principal": "bob"}, {"session_labels": ["cleared"]}),
        ({"principal": "bob"}, {"session": {"labels": ["cleared"]}}),
        ({"principal": "bob"}, {"args": {"session_labels": ["cleared"], "label:cleared": "1"}}),
    ]
    through: list[str] = []
    async with (
        ControlPlane.from_settings(settings) as plane,
        httpx.AsyncClient(transport=httpx.ASGITransport(create_app(plane)), base_url="http://s") as client,
    ):
        await plane.register(SEND)
        for opening, extra in tries:
            opened = await client.post("/v1/sessions", json=opening, headers=bot)
            if opened.status_code != 201:
                continue
            session = opened.json()["session_id"]
            body = {"tool": "send_email", "args": {}, **extra}
            for _ in range(2):  # a label would show on the second call
                call = await client.post(f"/v1/sessions/{session}/calls", json=body, headers=bot)
                if call.json().get("status") == "awaiting_report":
                    through.append(f"allowed after {opening} {extra}")
            record = await plane.store.load_session(session)
            if record is not None and record.labels:
                through.append(f"labels stored: {sorted(record.labels)}")
    assert through == []


# -- rate windows: one count across two routers, however fast -------------------------------------


async def test_concurrent_calls_through_two_routers_on_one_redis_never_exceed_a_window(
    tmp_path: Path, redis_url: str
) -> None:
    settings = settings_for(tmp_path, AGENT_HOURLY_LIMIT, redis_url)
    async with ControlPlane.from_settings(settings) as one, ControlPlane.from_settings(settings) as two:
        for plane in (one, two):
            await plane.register(SEND)
        sessions = [await one.open_session("mailer", "alice@example.com"),
                    await two.open_session("mailer", "bob@example.com")]  # fmt: skip
        calls = [(one, two)[i % 2].call(sessions[(i // 2) % 2], "send_email", {"n": i}) for i in range(24)]
        results = await asyncio.gather(*calls)
        # An agent's other spellings are other agents; a tool's are no tool at all.
        spelled = await one.open_session("Mailer", "alice@example.com")
        spellings = ("Send_Email", "SEND_EMAIL", "send_email ", "send\u200bemail", "\uff53end_email")
        variants = [await status_of(one, sessions[0], name) for name in spellings]
        other = await one.call(spelled, "send_email", {})
    allowed = [r for r in results if r.status == "awaiting_report"]
    through = len(allowed) - 3 + variants.count("awaiting_report")
    assert through == 0
    assert set(variants) <= {"denied", "refused"}
    assert other.status == "awaiting_report"  # a different agent name is a different agent (its own window)


async def status_of(plane: ControlPlane, session: str, tool: str) -> str:
    """A call's status; ``refused`` if the router turns it away before deciding."""
    try:
        return (await plane.call(session, tool, {})).status
    except StockadeError:
        return "refused"


# -- signed bundles: every trick refused ------------------------------------------------------------


def new_key(where: Path, name: str) -> tuple[Ed25519PrivateKey, Path]:
    private = Ed25519PrivateKey.generate()
    public = where / f"{name}.pub"
    public.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    return private, public


def special(name: str, kind: bytes, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def jwt(header: dict[str, Any], payload: dict[str, Any], key: Ed25519PrivateKey | None) -> bytes:
    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(payload).encode())}"
    signature = b64(key.sign(signing_input.encode())) if key is not None else ""
    return json.dumps({"signatures": [f"{signing_input}.{signature}"]}).encode()


GOOD_REGO = ALLOW_ALL.encode()
EVIL_REGO = b'package stockade\n\nimport rego.v1\n\ndecision := {"outcome": "allow"} if true\n'


def test_every_tar_and_signature_trick_is_refused(tmp_path: Path) -> None:
    key, public_pem = new_key(tmp_path, "signer")
    other, _ = new_key(tmp_path, "other")
    public = key.public_key()
    files = {"stockade/decision.rego": GOOD_REGO, MANIFEST: b'{"revision": "r1", "roots": [""]}'}
    signed = sign_files(files, key)
    header = {"alg": "EdDSA", "typ": "JWT", "kid": key_id(public)}
    listed = {"files": [{"name": n, "hash": "", "algorithm": "SHA-256"} for n in files]}
    honest = {"files": [{"name": n, "hash": file_hash(n, b), "algorithm": "SHA-256"} for n, b in files.items()]}
    base: list[tarfile.TarInfo | tuple[str, bytes]] = list(files.items())
    manifest = (MANIFEST, files[MANIFEST])
    ours = json.loads(signed)["signatures"][0]
    theirs = json.loads(jwt(header, honest, other))["signatures"][0]
    evil_entry = {
        "name": "stockade/decision.rego",
        "hash": hashlib.sha256(EVIL_REGO).hexdigest(),
        "algorithm": "SHA-256",
    }
    twice = jwt(header, {"files": [*honest["files"], evil_entry]}, key)
    attacks: dict[str, tuple[list[tarfile.TarInfo | tuple[str, bytes]], bool]] = {
        # (members, whether a public key is configured)
        "symlink": ([*base, special("stockade/x.rego", tarfile.SYMTYPE, "/etc/passwd")], False),
        "hardlink": ([*base, special("stockade/x.rego", tarfile.LNKTYPE, "stockade/decision.rego")], False),
        "fifo": ([*base, special("stockade/x.rego", tarfile.FIFOTYPE)], False),
        "char device": ([*base, special("stockade/x.rego", tarfile.CHRTYPE)], False),
        "dot-dot": ([*base, ("../evil.rego", EVIL_REGO)], False),
        "inner dot-dot": ([*base, ("stockade/../../evil.rego", EVIL_REGO)], False),
        "absolute": ([*base, ("/tmp/evil.rego", EVIL_REGO)], False),
        "backslash": ([*base, ("stockade\\..\\evil.rego", EVIL_REGO)], False),
        "duplicate via ./": ([*base, ("./stockade/decision.rego", EVIL_REGO)], False),
        "duplicate via //": ([*base, ("stockade//decision.rego", EVIL_REGO)], False),
        "long pax name": ([*base, ("stockade/" + "a/" * 80 + "../" * 90 + "evil.rego", EVIL_REGO)], False),
        "not a policy file": ([*base, ("stockade/run.sh", b"#!/bin/sh\n")], False),
        "nested signatures": ([*base, ("stockade/.signatures.json", signed)], False),
        "unsigned, key set": (base, True),
        "signed, no key set": ([*base, (SIGNATURES, signed)], False),
        "member added": ([*base, ("stockade/evil.rego", EVIL_REGO), (SIGNATURES, signed)], True),
        "member changed": ([("stockade/decision.rego", EVIL_REGO), manifest, (SIGNATURES, signed)], True),
        "manifest removed": ([("stockade/decision.rego", GOOD_REGO), (SIGNATURES, signed)], True),
        "alg none": ([*base, (SIGNATURES, jwt({**header, "alg": "none"}, honest, None))], True),
        "alg HS256": ([*base, (SIGNATURES, jwt({**header, "alg": "HS256"}, honest, key))], True),
        "another key, kid dropped": ([*base, (SIGNATURES, jwt({"alg": "EdDSA"}, honest, other))], True),
        "another key, our kid": ([*base, (SIGNATURES, jwt(header, honest, other))], True),
        "empty hashes": ([*base, (SIGNATURES, jwt(header, listed, key))], True),
        "two tokens": ([*base, (SIGNATURES, json.dumps({"signatures": [ours, theirs]}).encode())], True),
        "scoped": ([*base, (SIGNATURES, jwt(header, {**honest, "scope": "write"}, key))], True),
        "listed twice": ([("stockade/decision.rego", EVIL_REGO), manifest, (SIGNATURES, twice)], True),
    }
    through = []
    for name, (members, keyed) in attacks.items():
        bundle = pack(tmp_path / "bundle.tar.gz", members)
        try:
            load_bundle_archive(bundle, public_key=public if keyed else None)
        except PolicyBundleError:
            continue
        through.append(name)
    assert through == []
    # The honest bundle loads: the refusals above are about the tricks, not the packing.
    honest_bundle = pack(tmp_path / "bundle.tar.gz", [*base, (SIGNATURES, signed)])
    assert load_bundle_archive(honest_bundle, public_key=public).signed_by is not None
    assert public_pem.exists()


def test_a_deeply_nested_data_json_is_refused_not_raised(tmp_path: Path) -> None:
    """A data.json nested past Python's recursion limit is hostile input like any other: the
    loader must refuse it (PolicyBundleError naming the file), in a directory, in an unsigned
    bundle and when checking a signed bundle's hashes."""
    key, _ = new_key(tmp_path, "signer")
    root = policy_dir(tmp_path / "deep", ALLOW_ALL, deep_json())
    files = {"stockade/decision.rego": GOOD_REGO, "data.json": deep_json().encode()}
    unsigned = pack(tmp_path / "unsigned.tar.gz", list(files.items()))
    honest = {"stockade/decision.rego": GOOD_REGO, "data.json": b"{}"}
    signed = pack(tmp_path / "signed.tar.gz", [*files.items(), (SIGNATURES, sign_files(honest, key))])
    attempts: list[tuple[str, Callable[[], object]]] = [
        ("directory", lambda: load_bundle(root)),
        ("unsigned bundle", lambda: load_bundle_archive(unsigned)),
        ("signed bundle", lambda: load_bundle_archive(signed, public_key=key.public_key())),
    ]
    through = []
    for name, attempt in attempts:
        try:
            attempt()
        except PolicyBundleError:
            continue
        except RecursionError:
            through.append(f"{name}: RecursionError escaped the loader")
            continue
        through.append(f"{name}: loaded")
    assert through == []


async def test_a_reload_of_a_deeply_nested_data_json_is_refused_on_record(tmp_path: Path) -> None:
    """Fail closed, audited: a reload that cannot load the files keeps the old policy, raises
    PolicyError and leaves a ``reload_refused`` policy event and the engine's load status."""
    settings = settings_for(tmp_path, ALLOW_ALL)
    async with ControlPlane.from_settings(settings) as plane:
        before = plane.policy.revision
        (settings.policy.dir / "data.json").write_text(deep_json())
        try:
            await plane.reload_policy(source="api", by="root")
            raised = "nothing"
        except PolicyError:
            raised = "PolicyError"
        except RecursionError:
            raised = "RecursionError"
        refused = [e for e in await plane.audit.query(AuditFilter(kind="policy")) if e.outcome == "reload_refused"]
        status = plane.policy.load_status  # type: ignore[attr-defined]
        assert plane.policy.revision == before
    assert (raised, len(refused), status.error is not None) == ("PolicyError", 1, True)


async def test_a_reload_never_stalls_the_routers_event_loop(tmp_path: Path) -> None:
    """A reload parses and compiles on the event loop: while regorus works on a slow policy (here
    16 levels of brackets, a few seconds) no call, health check or renewal is served. The loop
    must keep turning (a tick every 50 ms, none late by a second)."""
    settings = settings_for(tmp_path, ALLOW_ALL)
    depth = 16
    async with ControlPlane.from_settings(settings) as plane:
        (settings.policy.dir / "stockade" / "slow.rego").write_text(
            "package stockade\n\nslow := " + "[" * depth + "1" + "]" * depth + "\n"
        )
        loop = asyncio.get_running_loop()
        gaps: list[float] = []

        async def ticker() -> None:
            last = loop.time()
            while True:
                await asyncio.sleep(0.05)
                gaps.append(loop.time() - last)
                last = loop.time()

        ticking = loop.create_task(ticker())
        await asyncio.sleep(0.2)
        with contextlib.suppress(PolicyError):
            await plane.reload_policy(source="watcher")
        await asyncio.sleep(0.2)
        ticking.cancel()
    assert max(gaps) < 1.0


async def test_a_bundle_swapped_or_cut_short_under_a_running_router_never_loads(tmp_path: Path) -> None:
    """The configured bundle replaced (truncated mid-write, re-signed by another key, an unsigned
    one): each reload is refused and audited, the verified revision keeps deciding."""
    key, public = new_key(tmp_path, "signer")
    other, _ = new_key(tmp_path, "other")
    source = policy_dir(tmp_path / "src", ALLOW_ALL)
    target = tmp_path / "policy.tar.gz"
    build_bundle(source, target, revision="r1", signing_key=key)
    whole = target.read_bytes()
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"),
        policy=PolicySettings(bundle=target, bundle_public_key=public, watch_interval_s=0),
    )
    evil_src = policy_dir(tmp_path / "evil", DENY_ALL)

    def into_directory() -> None:
        target.unlink()
        evil_src.rename(target)

    swaps: dict[str, Callable[[], object]] = {
        "truncated": lambda: target.write_bytes(whole[: len(whole) // 2]),
        "empty": lambda: target.write_bytes(b""),
        "other key": lambda: build_bundle(evil_src, target, revision="r2", signing_key=other),
        "unsigned": lambda: build_bundle(evil_src, target, revision="r2"),
        "a directory": into_directory,
    }
    through = []
    async with ControlPlane.from_settings(settings) as plane:
        before = plane.policy.revision
        session = await plane.open_session("a", "p")
        await plane.register(SEND)
        for name, swap in swaps.items():
            swap()
            with contextlib.suppress(PolicyError):
                await plane.reload_policy(source="watcher")
            if plane.policy.revision != before or (await plane.call(session, "send_email", {})).status != (
                "awaiting_report"
            ):
                through.append(name)
        refused = [e for e in await plane.audit.query(AuditFilter(kind="policy")) if e.outcome == "reload_refused"]
    assert through == []
    assert len(refused) == len(swaps)


# -- the CLI on hostile input: an error message, never a traceback -----------------------------------


def test_policy_input_files_that_are_not_utf8_are_bad_input_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "input.json"
    bad.write_bytes(b'\xff\xfe{"subject": \x80}')
    runs = {
        "explain": run_cli("policy", "explain", "--input", str(bad)),
        "eval": run_cli("policy", "eval", "--input", str(bad)),
        "explain stdin": run_cli("policy", "explain", "--input", "-", stdin=bad.read_bytes()),
    }
    through = [name for name, done in runs.items() if crashed(done) or done.returncode != 2]
    assert through == []


def test_policy_tools_on_a_deeply_nested_data_json_answer_without_a_traceback(tmp_path: Path) -> None:
    root = policy_dir(tmp_path / "deep", ALLOW_ALL, deep_json())
    unsigned = pack(tmp_path / "deep.tar.gz", [("stockade/decision.rego", GOOD_REGO),
                                                ("data.json", deep_json().encode())])  # fmt: skip
    runs = {
        "check": run_cli("policy", "check", "--dir", str(root)),
        "test": run_cli("policy", "test", "--dir", str(root)),
        "verify-bundle": run_cli("policy", "verify-bundle", str(unsigned)),
    }
    through = [name for name, done in runs.items() if crashed(done) or done.returncode == 0]
    assert through == []


def test_a_small_deeply_bracketed_rego_file_is_refused_promptly(tmp_path: Path) -> None:
    """regorus parses ``[[[...]]]`` in time exponential in the depth (about 2.2x per level: 18
    levels take 13 s, 22 over a minute). 60 bytes of Rego must not hang check (nor, through the
    same parser, a router's reload)."""
    depth = 30
    rego = ALLOW_ALL + "\nbomb := " + "[" * depth + "1" + "]" * depth + "\n"
    root = policy_dir(tmp_path / "bomb", rego)
    try:
        done = run_cli("policy", "check", "--dir", str(root), timeout=30)
    except subprocess.TimeoutExpired:
        hung = True
    else:
        hung = False
        assert not crashed(done)
    assert not hung


def test_rego_text_is_never_read_as_markup_by_explain(tmp_path: Path) -> None:
    root = policy_dir(tmp_path / "markup", MARKUP_REASON)
    request = tmp_path / "input.json"
    request.write_text(json.dumps({
        "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"},
        "tool": {"name": "t", "capabilities": [], "risk": "low"}, "args": {}, "now": "2026-11-22T10:00:00Z",
    }))  # fmt: skip
    done = run_cli("policy", "explain", "--input", str(request), "--dir", str(root))
    assert not crashed(done)
    assert "[bold red]pwned[/bold red]" in done.stdout.decode()  # shown as written, not styled


# -- replay: a hostile audit log is skipped line by line ---------------------------------------------


def decision_line(decision_id: str, tool: str, agent: str = "a") -> str:
    return json.dumps({
        "decision_id": decision_id, "timestamp": "2026-11-22T10:00:00+00:00", "kind": "decision", "outcome": "allow",
        "session_id": "s-1", "tool": tool, "agent": agent,
        "input": {"subject": {"agent": agent, "principal": "p"}, "session": {"id": "s-1"},
                  "tool": {"name": tool, "capabilities": [], "risk": "low"}, "args": {},
                  "now": "2026-11-22T10:00:00Z"},
        "result": {"outcome": "allow"}, "bundles": {"policies": {"revision": "r0"}},
    })  # fmt: skip


def chained(log_lines: list[bytes]) -> list[bytes]:
    """The lines as a writer holding the file could append them, the hash chain whole (replay
    refuses a broken chain before reading a line): an object gets its chain head, anything else
    goes behind one of its own."""
    sealed, prev = [], GENESIS_HASH
    for seq, line in enumerate(log_lines, 1):
        body = line[1:] if line.startswith(b"{") else line
        sealed.append(b'{"seq":%d,"prev_hash":"%s",' % (seq, prev.encode()) + body)
        prev = line_hash(sealed[-1]).hex()
    return sealed


def replay(tmp_path: Path, log_lines: list[bytes], *extra: str) -> subprocess.CompletedProcess[bytes]:
    log = tmp_path / "audit.jsonl"
    log.write_bytes(b"\n".join(chained(log_lines)) + b"\n")
    candidate = policy_dir(tmp_path / "candidate", DENY_ALL)
    baseline = policy_dir(tmp_path / "baseline", ALLOW_ALL)
    return run_cli("policy", "replay", "--policy", str(candidate), "--baseline", str(baseline), "--path", str(log),
                   *extra)  # fmt: skip


def test_replay_skips_junk_lines_and_shows_markup_as_text(tmp_path: Path) -> None:
    lines = [
        decision_line("d-1", "send_email").encode(),
        b"\xff\xfe not utf-8 \x80",
        b"[1, 2, 3]",
        b"42",
        b'{"kind": "decision", "input": "nope"}',
        json.dumps({**json.loads(decision_line("d-2", "t")), "bundles": {"policies": "x"}}).encode(),
        json.dumps({**json.loads(decision_line("d-3", "t")), "input": {"subject": [1]}}).encode(),
        b'{"kind": "decision", "decision_id": "' + b"x" * 2_000_000 + b'"}',
        decision_line("d-4", MARKUP, agent=MARKUP).encode(),
    ]
    runs = [replay(tmp_path, lines), replay(tmp_path, lines, "--json", "--fail-on", "widened,narrowed")]
    assert [crashed(done) for done in runs] == [False, False]
    shown = runs[0].stdout.decode()
    assert MARKUP in shown
    assert json.loads(runs[1].stdout)["replayed"] == 2


def test_replay_of_a_log_with_a_deeply_nested_line_skips_it(tmp_path: Path) -> None:
    lines = [decision_line("d-1", "send_email").encode(), b"[" * DEEP + b"]" * DEEP,
             b'{"kind": "decision", "input": ' + b"[" * DEEP + b"]" * DEEP + b"}"]  # fmt: skip
    done = replay(tmp_path, lines)
    assert not crashed(done)
    assert done.returncode == 0


def test_replay_never_writes_terminal_control_sequences_from_the_log(tmp_path: Path) -> None:
    """A log is hostile text: names from it printed raw would let it clear the screen, forge
    lines or plant hyperlinks in a reviewer's terminal."""
    lines = [decision_line("d-1", "send" + ESCAPES, agent="a" + ESCAPES).encode()]
    done = replay(tmp_path, lines)
    assert not crashed(done)
    assert b"\x1b" not in done.stdout + done.stderr

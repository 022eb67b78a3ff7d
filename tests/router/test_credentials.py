"""Credentials end to end: minted after the decision, injected at the real egress proxy (HTTPS
through a per-call CA, and plain HTTP only where the operator allows it), introspected while the
call runs, refused once its lease has ended, revoked after it, and never seen by the sandbox, the
agent, the logs or the audit log. On the embedded store and Redis."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import http.server
import io
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import structlog
import trustme
from pydantic import SecretStr

from policy import PolicySettings
from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.credentials import Binding, CredentialConfig, CredentialUnavailable, Grant, introspect
from router.credentials.client import TokenIntrospector
from router.credentials.secrets import load_secret
from router.credentials.tokens import TokenIssuer
from router.errors import ToolNotFound, ToolRefused
from router.interfaces.api import create_app
from router.logging import configure_logging
from router.settings import AuditSettings, StoreSettings
from runner import RunnerSettings
from tests.conftest import copy_policies, edit_catalog, https_and_http, python_tool

HOST = "api.allowed.test"
LOOKALIKE = "api.allowed.test.evil.test"
CANARY = "sk-canary-5f1d8a3b9c7e4d2a"  # the upstream secret: must never show up where it must not
SERVICE_TOKEN = "svc-introspection-token"  # the upstream service's own credential for introspection


def introspector(
    plane: ControlPlane, client_token: str = SERVICE_TOKEN, audience: str | None = None
) -> TokenIntrospector:
    """How a service checks tokens: over HTTP, against the real application."""
    transport = httpx.ASGITransport(create_app(plane))
    return TokenIntrospector("http://stockade", client_token, audience=audience, transport=transport)


@dataclass
class Echo:
    """Loopback upstreams (HTTPS for HOST, plain HTTP for any name) that answer with the credentials
    they received, and with the token's introspection at the moment they received it."""

    https_port: int = 0
    http_port: int = 0
    ca_file: Path = Path()
    seen: list[dict[str, Any]] = field(default_factory=list)
    introspect: Any = None  # set by the test: token -> introspection result


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Echo]:
    state = Echo()
    ca = trustme.CA()
    state.ca_file = tmp_path_factory.mktemp("ca") / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(state.ca_file))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            auth = self.headers.get("Authorization", "")
            token = auth.removeprefix("Bearer ")
            seen = {"host": self.headers.get("Host"), "authorization": auth, "api_key": self.headers.get("X-Api-Key")}
            if state.introspect is not None and token.count(".") == 2:
                seen["introspection"] = state.introspect(token)
            state.seen.append(seen)
            body = json.dumps(seen).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with https_and_http(Handler, ca, HOST) as (state.https_port, state.http_port):
        yield state


@pytest.fixture
def store_url(both_stores: str | None) -> str | None:
    return both_stores


@pytest.fixture
def plain_text() -> bool:
    """Whether the operator lets the credentials go over plain HTTP too (a test parametrizes it)."""
    return False


@pytest.fixture
def key_ttl_s() -> int:
    """The longest lease policy grants on ``api-key`` (a test parametrizes it)."""
    return 60


@pytest.fixture
async def plane(
    tmp_path: Path,
    runner_state: Path,
    echo: Echo,
    store_url: str | None,
    monkeypatch: pytest.MonkeyPatch,
    plain_text: bool,
    key_ttl_s: int,
) -> AsyncIterator[ControlPlane]:
    policies = copy_policies(tmp_path)
    edit_catalog(policies, egress_allowlist=[HOST, LOOKALIKE], credentials={
        "api-token": {"scopes": ["read"], "ttl_s": 120}, "api-key": {"ttl_s": key_ttl_s},
        "ghost": {}, "api-token-admin": {"scopes": ["admin"]},
    })  # fmt: skip
    monkeypatch.setenv("TEST_API_KEY", CANARY)
    hosts = [f"{HOST}:{echo.https_port}", f"{HOST}:{echo.http_port}"]  # a host alone would mean 443 (and 80)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=policies),
        store=StoreSettings(url=store_url), introspection_tokens=[SecretStr(SERVICE_TOKEN)],
        runner=RunnerSettings(state_dir=runner_state, pool_size=0, egress_ca_file=echo.ca_file,
                              egress_hosts={HOST: "127.0.0.1", LOOKALIKE: "127.0.0.1"}),
        credentials=[
            CredentialConfig(name="api-token", kind="token", hosts=hosts, scopes=["read"], max_ttl_s=30,
                             allow_plaintext=plain_text),
            CredentialConfig(name="api-key", kind="secret", hosts=hosts, value_env="TEST_API_KEY",
                             allow_plaintext=plain_text),
            CredentialConfig(name="api-token-admin", kind="token", hosts=hosts, scopes=["read"]),
        ],
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane
    echo.introspect = None


FETCH = """
def main(url):
    import os, json, urllib.request
    request = urllib.request.Request(url, headers={
        "Authorization": "Bearer " + os.environ["STOCKADE_CREDENTIAL_API_TOKEN"],
        "X-Api-Key": os.environ["STOCKADE_CREDENTIAL_API_KEY"]})
    raw = urllib.request.urlopen(request, timeout=10).read()
    body = json.loads(raw)
    if os.path.isdir("/out"):
        open("/out/response.json", "wb").write(raw)
    files = {}
    for root in ("/in", "/tmp"):
        for name in os.listdir(root):
            try:
                files[root + "/" + name] = open(root + "/" + name, errors="replace").read()
            except OSError:
                pass
    environ = open("/proc/self/environ").read()
    return {"env": dict(os.environ), "upstream": body, "files": files, "proc_environ": environ}
"""


def fetch_tool(echo: Echo, name: str = "fetch", **overrides: Any) -> dict[str, Any]:
    return python_tool(name, FETCH, **{
        "credentials": [{"name": "api-token", "scopes": ["read"]}, {"name": "api-key"}],
        "sandbox": {"egress": [{"host": HOST, "port": echo.https_port}, {"host": HOST, "port": echo.http_port},
                               {"host": LOOKALIKE, "port": echo.http_port}]},
        **overrides,
    })  # fmt: skip


async def test_a_call_gets_working_credentials_that_never_reach_the_sandbox_agent_logs_or_audit(
    plane: ControlPlane, echo: Echo
) -> None:
    logs = io.StringIO()
    configure_logging("json", "debug", file=logs, cache=False)
    loop = asyncio.get_running_loop()
    service = introspector(plane)
    echo.introspect = lambda token: asyncio.run_coroutine_threadsafe(service.check(token), loop).result(10)
    await plane.register(fetch_tool(echo, sandbox={**fetch_tool(echo)["sandbox"], "outputs": {}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "fetch", {"url": f"https://{HOST}:{echo.https_port}/data"})
    assert result.ok, result.stderr
    assert result.quarantine is not None
    [artifact] = result.artifacts
    saved = (Path(result.quarantine) / artifact.path).read_text()
    assert "[REDACTED:api-key]" in saved  # the tool saved the echoed secret: scrubbed in quarantine
    assert (artifact.size, artifact.sha256) == (len(saved.encode()), hashlib.sha256(saved.encode()).hexdigest())

    upstream = echo.seen[-1]
    assert upstream["api_key"] == CANARY  # the proxy put the real values in
    token = upstream["authorization"].removeprefix("Bearer ")
    assert upstream["introspection"]["active"] is True  # accepted while the call ran
    assert upstream["introspection"]["scope"] == "read"
    assert upstream["introspection"]["sub"] == "agent-1"
    assert upstream["introspection"]["stockade"]["call_id"] == result.call_id
    assert (await service.check(token))["active"] is False  # revoked as the call ended
    await service.aclose()

    env = result.output["env"]
    assert env["STOCKADE_CREDENTIAL_API_KEY"].startswith("stockade-placeholder-")
    assert env["STOCKADE_CREDENTIAL_API_TOKEN"].startswith("stockade-placeholder-")
    assert result.output["upstream"]["api_key"] == "[REDACTED:api-key]"  # echoed back: scrubbed
    assert "BEGIN CERTIFICATE" in result.output["files"]["/in/stockade-ca.pem"]  # the CA, never its key
    for where, text in {
        "result": result.model_dump_json(), "audit": (plane.settings.audit.path).read_text(), "artifact": saved,
        "logs": logs.getvalue(),
    }.items():  # fmt: skip
        assert CANARY not in text, where
        assert token not in text, where
        assert "PRIVATE KEY" not in text, where
    structlog.reset_defaults()  # other tests keep structlog's defaults
    assert '"event": "egress"' in logs.getvalue()  # the logs were captured, and say what happened

    events = await plane.audit.query(AuditFilter(decision_id=result.decision_id))
    kinds = [(e.kind, e.outcome) for e in events]
    assert kinds[:3] == [("decision", "allow"), ("credential", "minted"), ("credential", "minted")]
    assert kinds[-2:] == [("credential", "revoked"), ("credential", "revoked")]
    [egress] = [e for e in events if e.kind == "egress"]
    assert egress.result is not None
    assert (sorted(egress.result["injected"]), egress.result["intercepted"]) == (["api-key", "api-token"], True)


@pytest.mark.parametrize("plain_text", [True])
async def test_credentials_go_only_to_their_host_never_to_a_lookalike(plane: ControlPlane, echo: Echo) -> None:
    """With the operator's leave (``allow_plaintext``), over plain HTTP to the credential's host;
    to a lookalike, never: the request carrying its placeholder there is refused and audited."""
    await plane.register(fetch_tool(echo))
    session = await plane.open_session("agent-1", "alice@example.com")
    exact = await plane.call(session, "fetch", {"url": f"http://{HOST}:{echo.http_port}/"})
    assert exact.ok, exact.stderr
    assert echo.seen[-1]["api_key"] == CANARY  # plain HTTP: injected in the forwarded request
    seen = len(echo.seen)
    lookalike = await plane.call(session, "fetch", {"url": f"http://{LOOKALIKE}:{echo.http_port}/"})
    assert not lookalike.ok
    assert "HTTP Error 403" in lookalike.stderr
    assert len(echo.seen) == seen  # not even the placeholder went there
    [egress] = await plane.audit.query(AuditFilter(decision_id=lookalike.decision_id, kind="egress"))
    assert egress.outcome == "deny"
    assert egress.result is not None
    assert egress.result["reason"].startswith("credential api-")
    assert LOOKALIKE in egress.result["reason"]


async def test_a_credential_never_goes_over_plain_http_without_the_operators_leave(
    plane: ControlPlane, echo: Echo
) -> None:
    """The value would cross the network in clear text, to whatever the name resolves to, with no
    certificate checked: a request carrying the placeholder over plain HTTP is refused, audited as
    denied, and nothing reaches the upstream; over HTTPS the same tool gets it."""
    await plane.register(fetch_tool(echo))
    session = await plane.open_session("agent-1", "alice@example.com")
    seen = len(echo.seen)
    plain = await plane.call(session, "fetch", {"url": f"http://{HOST}:{echo.http_port}/"})
    assert not plain.ok
    assert "HTTP Error 403" in plain.stderr
    assert len(echo.seen) == seen
    [egress] = await plane.audit.query(AuditFilter(decision_id=plain.decision_id, kind="egress"))
    assert (egress.outcome, egress.result and egress.result["status"]) == ("deny", 403)
    assert egress.result is not None
    assert "over plain HTTP" in egress.result["reason"]
    assert egress.result["injected"] == []
    secure = await plane.call(session, "fetch", {"url": f"https://{HOST}:{echo.https_port}/"})
    assert secure.ok, secure.stderr
    assert echo.seen[-1]["api_key"] == CANARY
    assert CANARY not in plane.settings.audit.path.read_text()


LATE = """
def main(url, wait):
    import os, time, urllib.error, urllib.request
    statuses = []
    for delay in (0, wait):
        time.sleep(delay)
        request = urllib.request.Request(url, headers={"X-Api-Key": os.environ["STOCKADE_CREDENTIAL_API_KEY"]})
        try:
            statuses.append(urllib.request.urlopen(request, timeout=10).status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
    return statuses
"""


@pytest.mark.parametrize("key_ttl_s", [1])
async def test_an_upstream_secret_is_not_injected_after_its_lease_ends(plane: ControlPlane, echo: Echo) -> None:
    """Policy grants ``api-key`` for 1 s; the call runs longer. Its request after the lease ended
    gets ``403`` from the proxy and a denied egress event; the upstream had the value only once."""
    await plane.register(python_tool("late", LATE, credentials=[{"name": "api-key"}], sandbox={
        "egress": [{"host": HOST, "port": echo.https_port}], "limits": {"timeout_s": 10},
    }))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    seen = len(echo.seen)
    result = await plane.call(session, "late", {"url": f"https://{HOST}:{echo.https_port}/", "wait": 1.5})
    assert result.ok, result.stderr
    assert result.output == [200, 403]
    assert [s["api_key"] for s in echo.seen[seen:]] == [CANARY]
    events = await plane.audit.query(AuditFilter(decision_id=result.decision_id))
    [minted] = [e for e in events if (e.kind, e.outcome) == ("credential", "minted")]
    assert minted.result is not None
    assert minted.result["ttl_s"] == 1
    egress = [e for e in events if e.kind == "egress"]
    assert [(e.outcome, e.result and e.result["status"]) for e in egress] == [("allow", 200), ("deny", 403)]
    assert egress[1].result is not None
    assert "expired" in egress[1].result["reason"]


async def test_a_token_is_bound_to_its_call_and_dies_with_its_ttl_even_if_never_revoked(plane: ControlPlane) -> None:
    config = CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"])
    binding = Binding("d-1", "c-1", "s-1", "agent-1", "ab" * 32)
    # The router dies between mint and run: nothing revokes this lease.
    minted_at = time.time()
    [lease] = await plane.credentials.mint([Grant(config, ("read",), 1)], binding)
    token = lease.value.get_secret_value()
    # Verifiers compare whole seconds: an ``exp`` rounded down would end it up to 1 s early.
    assert jwt.decode(token, options={"verify_signature": False})["exp"] >= minted_at + 1
    assert (await introspect(plane.store, token, call_id="c-1", args_sha256="ab" * 32))["active"] is True
    assert (await introspect(plane.store, token, call_id="c-2"))["active"] is False  # replayed by another call
    assert (await introspect(plane.store, token, args_sha256="cd" * 32))["active"] is False  # with other args
    assert (await introspect(plane.store, token[:-2] + "xx"))["active"] is False  # forged
    await asyncio.sleep(1.3)
    assert (await introspect(plane.store, token))["active"] is False
    assert await plane.store.get_lease(lease.id) is None  # the store forgot it too


async def test_denied_and_held_calls_never_mint(plane: ControlPlane, echo: Echo) -> None:
    await plane.register(fetch_tool(echo))
    await plane.register(fetch_tool(echo, name="risky", risk="high"))
    with pytest.raises(ToolRefused) as refused:  # no call to it could ever get the credential
        await plane.register(fetch_tool(echo, name="greedy", credentials=[{"name": "prod-db"}]))
    assert refused.value.reasons == ["credential.not_allowlisted"]
    session = await plane.open_session("agent-1", "alice@example.com")
    held = await plane.call(session, "risky", {"url": f"http://{HOST}:{echo.http_port}/"})
    with pytest.raises(ToolNotFound):
        await plane.call(session, "greedy", {"url": f"http://{HOST}:{echo.http_port}/"})
    assert held.status == "pending_approval"
    assert await plane.audit.query(AuditFilter(session_id=session, kind="credential")) == []


async def test_grants_beyond_the_operators_configuration_are_denied(plane: ControlPlane, echo: Echo) -> None:
    await plane.register(fetch_tool(echo, name="ghostly", credentials=[{"name": "ghost"}]))
    await plane.register(fetch_tool(echo, name="admin", credentials=[{"name": "api-token-admin", "scopes": ["admin"]}]))
    session = await plane.open_session("agent-1", "alice@example.com")
    ghost = await plane.call(session, "ghostly", {"url": f"http://{HOST}:{echo.http_port}/"})
    admin = await plane.call(session, "admin", {"url": f"http://{HOST}:{echo.http_port}/"})
    assert (ghost.status, ghost.reasons) == ("denied", ["credential.unknown"])
    assert (admin.status, admin.reasons) == ("denied", ["credential.scope_denied"])
    refused = await plane.audit.query(AuditFilter(session_id=session, kind="credential"))
    assert [e.outcome for e in refused] == ["refused", "refused"]


@pytest.mark.parametrize("tier", ["docker", "gvisor"])
async def test_container_tiers_inject_the_same_way(plane: ControlPlane, echo: Echo, tier: str) -> None:
    await plane.register(fetch_tool(echo, sandbox={"tier": tier, "egress": [{"host": HOST, "port": echo.https_port}]}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "fetch", {"url": f"https://{HOST}:{echo.https_port}/"})
    assert result.ok, result.stderr
    assert result.tier == tier
    assert echo.seen[-1]["api_key"] == CANARY
    assert result.output["upstream"]["api_key"] == "[REDACTED:api-key]"
    assert result.output["env"]["STOCKADE_CREDENTIAL_API_KEY"].startswith("stockade-placeholder-")
    assert CANARY not in result.model_dump_json()


SAY = "def main(text):\n    return {'said': text}\n"


async def test_a_revoked_token_handed_back_to_a_later_call_is_still_redacted(plane: ControlPlane, echo: Echo) -> None:
    """The upstream that received a token can hand it back to any later call (here, as the text a
    tool says). The token was forgotten at revoke, so that call's output and its audit events held
    it as written, while it still verified against the JWKS until it expired."""
    await plane.register(fetch_tool(echo))
    await plane.register(python_tool("say", SAY))
    session = await plane.open_session("agent-1", "alice@example.com")
    assert (await plane.call(session, "fetch", {"url": f"https://{HOST}:{echo.https_port}/data"})).ok
    token = echo.seen[-1]["authorization"].removeprefix("Bearer ")
    service = introspector(plane)
    assert (await service.check(token))["active"] is False  # revoked as the call ended
    await service.aclose()
    later = await plane.call(session, "say", {"text": f"the upstream kept: Bearer {token}"})
    assert later.ok, later.stderr
    assert later.output == {"said": "the upstream kept: Bearer [REDACTED:stockade-token]"}
    assert token not in later.model_dump_json()
    assert token not in plane.settings.audit.path.read_text()


async def test_services_introspect_over_http_and_only_with_their_own_token(plane: ControlPlane) -> None:
    config = CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"])
    [lease] = await plane.credentials.mint([Grant(config, ("read",), 30)], Binding("d-1", "c-1", "s-1", "a", "ab" * 32))
    token = lease.value.get_secret_value()
    service, stranger = introspector(plane), introspector(plane, "not-a-configured-token")
    transport = httpx.ASGITransport(create_app(plane))
    async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as raw:
        keys = (await raw.get("/.well-known/jwks.json")).json()["keys"]
        refused = await raw.post("/v1/credentials/introspect", data={"token": token})
        empty = await raw.post("/v1/credentials/introspect", data={},
                               headers={"Authorization": f"Bearer {SERVICE_TOKEN}"})  # fmt: skip
    assert jwt.get_unverified_header(token)["kid"] in {k["kid"] for k in keys}
    assert all("d" not in k for k in keys)  # public halves only
    assert (refused.status_code, empty.status_code) == (401, 400)
    assert (await service.check(token, call_id="c-1"))["active"] is True
    assert (await service.check(token, call_id="c-9"))["active"] is False
    assert (await stranger.check(token))["active"] is False  # unauthenticated callers learn nothing
    # A service names itself: a live token minted for another (an upstream replaying what it got) is
    # inactive there. Without the audience, any live stockade token was active to any service.
    mine, elsewhere = introspector(plane, audience=HOST), introspector(plane, audience="b.other.test")
    assert (await mine.check(token))["active"] is True
    assert (await elsewhere.check(token))["active"] is False
    await plane.credentials.revoke([lease])
    assert (await service.check(token))["active"] is False
    assert (await mine.check(token))["active"] is False
    for client in (service, stranger, mine, elsewhere):
        await client.aclose()


SLOW = "def main(seconds):\n    import time\n    time.sleep(seconds)\n    return 'done'\n"


async def test_leases_are_revoked_when_the_call_times_out_or_is_cancelled(plane: ControlPlane, echo: Echo) -> None:
    slow = fetch_tool(echo, name="slow", executor={"kind": "python", "source": SLOW})
    slow["sandbox"]["limits"] = {"timeout_s": 1}
    await plane.register(slow)
    session = await plane.open_session("agent-1", "alice@example.com")
    timed_out = await plane.call(session, "slow", {"seconds": 5})
    assert timed_out.verdict == "timeout"

    cancelled = asyncio.create_task(plane.call(session, "slow", {"seconds": 0.9}))
    for _ in range(200):  # until its credentials are minted and it runs
        if len(plane._leases) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(plane._leases) == 2
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert plane._leases == {}
    events = await plane.audit.query(AuditFilter(session_id=session, kind="credential"))
    outcomes = [e.outcome for e in events]
    assert outcomes.count("minted") == 4
    assert outcomes.count("revoked") == 4
    for event in events:
        if event.outcome == "minted" and event.result and event.result["kind"] == "token":
            assert (await plane.store.get_lease(event.result["lease_id"]) or ("gone",))[0] in ("revoked", "gone")


async def test_a_call_cancelled_while_its_credentials_are_minted_runs_nothing_and_revokes_them(
    plane: ControlPlane, echo: Echo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while its second lease is stored, by a store client that drops the cancellation
    and finishes the write (as redis-py does on Python 3.11: its ``asyncio.wait_for`` returns a
    write that finished as the cancellation arrived): the call is cancelled all the same, the tool
    never runs, and both leases are revoked."""
    await plane.register(fetch_tool(echo, name="slow", executor={"kind": "python", "source": SLOW}))
    session = await plane.open_session("agent-1", "alice@example.com")
    put_lease, storing = plane.store.put_lease, asyncio.Event()

    async def dropping_a_cancellation(lease_id: str, record: str, ttl_s: float) -> None:
        if plane._leases:  # the second lease
            storing.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(5)
        await put_lease(lease_id, record, ttl_s)

    monkeypatch.setattr(plane.store, "put_lease", dropping_a_cancellation)
    cancelled = asyncio.create_task(plane.call(session, "slow", {"seconds": 0.1}))
    await asyncio.wait_for(storing.wait(), 10)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert plane._leases == {}
    events = await plane.audit.query(AuditFilter(session_id=session))
    assert [e.outcome for e in events if e.kind == "credential"] == ["minted", "minted", "revoked", "revoked"]
    assert [(e.kind, e.outcome) for e in events if e.kind == "execution"] == [("execution", "cancelled")]


async def test_signing_keys_rotate_and_tokens_signed_by_the_old_key_still_verify(plane: ControlPlane) -> None:
    issuer = TokenIssuer(plane.store, rotation_s=0.2)
    grant = Grant(CredentialConfig(name="api-token", kind="token", hosts=[HOST], scopes=["read"]), ("read",), 30)
    first = await issuer.mint(grant, Binding("d-1", "c-1", "s-1", "a", "ab" * 32))
    await asyncio.sleep(0.3)
    second = await issuer.mint(grant, Binding("d-2", "c-2", "s-1", "a", "ab" * 32))
    kids = {jwt.get_unverified_header(lease.value.get_secret_value())["kid"] for lease in (first, second)}
    assert len(kids) == 2
    for lease in (first, second):
        assert (await introspect(plane.store, lease.value.get_secret_value()))["active"] is True
    await issuer.aclose()


async def test_a_router_missing_an_upstream_secret_does_not_start(tmp_path: Path) -> None:
    unset = CredentialConfig(name="api-key", kind="secret", hosts=[HOST], value_env="STOCKADE_TEST_UNSET_SECRET")
    settings = Settings(audit=AuditSettings(path=tmp_path / "a.jsonl"), credentials=[unset])
    with pytest.raises(CredentialUnavailable, match="STOCKADE_TEST_UNSET_SECRET is empty"):
        ControlPlane.from_settings(settings)


async def test_an_upstream_secret_is_read_without_stray_whitespace_and_one_no_header_can_carry_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key with a trailing newline (an env file, a secret mounted from a file) is the key alone;
    one with a line break inside could never be sent: the router refuses to start, naming the
    credential and never showing its value."""
    monkeypatch.setenv("TEST_PADDED_SECRET", f"  {CANARY}\n")
    padded = CredentialConfig(name="api-key", kind="secret", hosts=[HOST], value_env="TEST_PADDED_SECRET")
    assert load_secret(padded).get_secret_value() == CANARY
    monkeypatch.setenv("TEST_BROKEN_SECRET", f"{CANARY}\r\nX-Injected: yes")
    broken = CredentialConfig(name="api-key", kind="secret", hosts=[HOST], value_env="TEST_BROKEN_SECRET")
    settings = Settings(audit=AuditSettings(path=tmp_path / "a.jsonl"), credentials=[broken])
    with pytest.raises(CredentialUnavailable, match=r"credential api-key: .*TEST_BROKEN_SECRET.* control") as refused:
        ControlPlane.from_settings(settings)
    told = str(refused.value)
    # The half-built plane's policy engine was once left to the collector: run on another thread
    # (as a Docker client's did in CI), it raised "regoruspy::Program is unsendable".
    del refused
    collector = threading.Thread(target=gc.collect)
    collector.start()
    collector.join()
    assert CANARY not in told
    assert "X-Injected" not in told

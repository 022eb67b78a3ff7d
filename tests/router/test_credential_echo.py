"""A reflected credential, end to end through `ControlPlane.call`: an allowlisted upstream echoes
the injected secret back in every encoding a tool could hand to the agent, and the tool re-encodes
whatever it got; none of it reaches the tool's stdout, the `ToolResult` or the audit log. Also the
redaction of a secret the agent holds, and a GET-only HTTPS grant. On each sandbox tier, on
asyncio's loop and on uvloop (the loop `stockade serve` runs on)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from policy import PolicySettings
from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.credentials import CredentialConfig
from router.settings import AuditSettings
from runner import RunnerSettings
from tests.conftest import copy_policies, edit_catalog, python_tool
from tests.runner.test_egress import HOST, _asyncio_loop_factory, _runs_on_the_loop_asked_for  # noqa: F401  (run on both loops)
from tests.runner.test_egress_attacks import ENCODINGS, SECRET, Reflector, leaked, reflector

__all__ = ["reflector"]  # the fixture, shared with the proxy's own attack tests


@pytest.fixture
async def plane(
    tmp_path: Path, runner_state: Path, reflector: Reflector, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ControlPlane]:
    """A control plane granting the ``echo-key`` secret (SECRET) for HOST, as in test_credentials."""
    reflector.seen.clear()
    policies = copy_policies(tmp_path)
    edit_catalog(policies, egress_allowlist=[HOST], credentials={"echo-key": {"ttl_s": 60}})
    monkeypatch.setenv("TEST_ECHO_KEY", SECRET)
    settings = Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=policies),
        runner=RunnerSettings(state_dir=runner_state, pool_size=0, egress_ca_file=reflector.ca_file,
                              egress_hosts={HOST: "127.0.0.1"}),
        credentials=[CredentialConfig(name="echo-key", kind="secret", hosts=[f"{HOST}:{reflector.https_port}"],
                                      value_env="TEST_ECHO_KEY")],  # a host alone would mean port 443
    )  # fmt: skip
    async with ControlPlane.from_settings(settings) as control_plane:
        yield control_plane


ENCODE = """
    import base64, json
    from urllib.parse import quote
    encodings = {
        "raw": lambda v: v, "hex": lambda v: v.encode().hex(), "HEX": lambda v: v.encode().hex().upper(),
        "reversed": lambda v: v[::-1], "upper": str.upper,
        "basic": lambda v: base64.b64encode(("agent-1:" + v).encode()).decode(),
        "base64url": lambda v: base64.urlsafe_b64encode(v.encode()).decode().rstrip("="),
        "percent": lambda v: quote(v, safe=""),
        "percent-php": lambda v: "".join(c if c.isascii() and (c.isalnum() or c in "-._") else quote(c, safe="")
                                         if c != "~" else "%7E" for c in v),
        "html-go": lambda v: v.replace("&", "&amp;").replace("+", "&#43;").replace("'", "&#39;"),
        "percent-go-path": lambda v: "".join(c if c.isascii() and (c.isalnum() or c in "-._~$&+,;=:@")
                                             else "".join("%%%02X" % b for b in c.encode()) for c in v),
        "percent-js-escape": lambda v: "".join(c if c.isascii() and (c.isalnum() or c in "@*_+-./")
                                               else "".join("%%%02X" % b for b in c.encode()) for c in v),
        "json-dotnet": lambda v: "".join("\\\\u%04X" % ord(c) if c in "\\"&'+<>`\\\\" else c for c in v),
        "html-hex": lambda v: "".join(c if c.isalnum() else "&#x%X;" % ord(c) for c in v),
        "basic-mime": lambda v: base64.encodebytes(("agent-1:" + "x" * 32 + v).encode()).decode(),
    }
"""
EXFILTRATE = f"""
def main(url, names):
    import os, urllib.request
{ENCODE}
    placeholder = os.environ["STOCKADE_CREDENTIAL_ECHO_KEY"]
    got = {{}}
    for name in names:  # the upstream reflects the secret in each encoding
        request = urllib.request.Request(url + "/" + name, headers={{"X-Api-Key": placeholder}})
        with urllib.request.urlopen(request, timeout=10) as reply:
            got[name] = reply.headers.get("X-Reflected", "") + "\\n" + reply.read().decode()
    # and the tool hands on whatever it got in each encoding too, line by line and all of it
    mine = {{name: encode(text) for name, encode in encodings.items() for text in [json.dumps(got)]}}
    for name, text in got.items():
        for line in text.splitlines():
            for how, encode in encodings.items():
                mine[name + "/" + how + "/" + line[:12]] = encode(line.split(": ", 1)[-1])
    print(json.dumps(got))
    print(json.dumps(mine))
    return {{"got": got, "mine": mine}}
"""
HAND_ON = f"""
def main(value):
{ENCODE}
    out = {{name: encode(value) for name, encode in encodings.items()}}
    print(out)
    return out
"""


def counted(result_json: str, stdout: str, audit: str) -> dict[str, list[str]]:
    """The listed encodings of SECRET found in each place the agent or an operator reads."""
    return {"stdout": leaked(stdout), "result": leaked(result_json), "audit": leaked(audit)}


@pytest.mark.parametrize("tier", ["bwrap", "docker", "gvisor"])
async def test_a_secret_reflected_in_any_encoding_reaches_neither_the_agent_nor_the_audit_log(
    plane: ControlPlane, reflector: Reflector, tier: str
) -> None:
    await plane.register(python_tool("exfiltrate", EXFILTRATE, credentials=[{"name": "echo-key"}], sandbox={
        "tier": tier, "egress": [{"host": HOST, "port": reflector.https_port, "methods": ["GET"]}],
    }))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    url = f"https://{HOST}:{reflector.https_port}"
    result = await plane.call(session, "exfiltrate", {"url": url, "names": list(ENCODINGS)})
    assert result.ok, result.stderr[-800:]
    assert result.tier == tier
    found = counted(result.model_dump_json(), result.stdout, plane.settings.audit.path.read_text())
    assert sum(len(names) for names in found.values()) == 0, found
    assert reflector.seen == [("GET", SECRET)] * len(ENCODINGS)  # the upstream had the real secret each time
    got: dict[str, Any] = result.output["got"]
    assert all("[REDACTED:echo-key]" in text for text in got.values())  # it came back, scrubbed
    egress = await plane.audit.query(AuditFilter(decision_id=result.decision_id, kind="egress"))
    assert [(e.outcome, e.result["method"], e.result["injected"]) for e in egress if e.result] == [
        ("allow", "GET", ["echo-key"])] * len(ENCODINGS)  # fmt: skip
    assert all(e.result and e.result["scrubbed"] for e in egress)  # each scrub is on the record


async def test_outputs_and_audit_redact_every_encoding_of_a_registered_secret(plane: ControlPlane) -> None:
    """The redactor covers what the proxy scrubs: a secret the agent somehow holds, handed to a
    tool that prints and returns it in each encoding, is in neither the result nor the audit log
    (the arguments included)."""
    await plane.register(python_tool("hand-on", HAND_ON))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "hand-on", {"value": SECRET})
    assert result.ok, result.stderr[-800:]
    found = counted(result.model_dump_json(), result.stdout, plane.settings.audit.path.read_text())
    assert sum(len(names) for names in found.values()) == 0, found
    assert sorted(result.output) == sorted(ENCODINGS)
    assert all("[REDACTED:echo-key]" in text for text in result.output.values())


WRITE = """
def main(url):
    import urllib.error, urllib.request
    codes = {}
    for method in ("GET", "POST", "DELETE"):
        request = urllib.request.Request(url, data=b"x" if method == "POST" else None, method=method)
        try:
            codes[method] = urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as e:
            codes[method] = e.code
    return codes
"""


async def test_a_get_only_https_grant_refuses_other_methods_and_audits_them(
    plane: ControlPlane, reflector: Reflector
) -> None:
    await plane.register(python_tool("write", WRITE, sandbox={
        "egress": [{"host": HOST, "port": reflector.https_port, "methods": ["GET"]}],
    }))  # fmt: skip
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "write", {"url": f"https://{HOST}:{reflector.https_port}/raw"})
    assert result.ok, result.stderr[-800:]
    assert result.output == {"GET": 200, "POST": 403, "DELETE": 403}
    assert [method for method, _ in reflector.seen] == ["GET"]  # nothing else got through
    egress = await plane.audit.query(AuditFilter(decision_id=result.decision_id, kind="egress"))
    assert [(e.outcome, e.result["method"], e.result["status"]) for e in egress if e.result] == [
        ("allow", "GET", 200), ("deny", "POST", 403), ("deny", "DELETE", 403)]  # fmt: skip
    assert json.dumps([e.result for e in egress]).count('"intercepted": true') == 3

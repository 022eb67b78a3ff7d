"""GET /v1/policy and /readyz say when the policy files on disk failed to load, while the previous
revision keeps deciding; a real control plane behind the real HTTP app, on a directory and on a
hot-reloaded signed bundle."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from policy import PolicySettings
from policy.bundle import build_bundle, load_bundle
from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import copy_policies, edit_catalog, external_tool
from tests.policy.test_bundles import members_of, pack
from tests.router.test_api import auth, principals


@contextlib.asynccontextmanager
async def served(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, ControlPlane]]:
    async with ControlPlane.from_settings(settings) as plane:
        transport = httpx.ASGITransport(create_app(plane))
        async with httpx.AsyncClient(transport=transport, base_url="http://stockade") as client:
            yield client, plane


def make_settings(tmp_path: Path, policy: PolicySettings) -> Settings:
    return Settings(audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=policy,
                    api_principals=[ApiPrincipal.model_validate(p) for p in principals()])  # fmt: skip


async def decided_revision(client: httpx.AsyncClient, plane: ControlPlane, session: str) -> tuple[str, Any]:
    """Decide a call over HTTP; its outcome and the revision its audited decision names."""
    answer = (
        await client.post(f"/v1/sessions/{session}/decide", json={"tool": "echo"}, headers=auth("agent-1"))
    ).json()
    [event] = [
        e for e in await plane.audit.query(AuditFilter(kind="decision")) if e.decision_id == answer["decision_id"]
    ]
    return answer["outcome"], (event.bundles or {})["policies"]["revision"]


async def test_a_broken_edit_is_reported_by_policy_status_and_readyz_until_fixed(tmp_path: Path) -> None:
    root = copy_policies(tmp_path)
    settings = make_settings(tmp_path, PolicySettings(dir=root, watch_interval_s=0))
    async with served(settings) as (client, plane):
        await client.post("/v1/tools", json=external_tool("echo"), headers=auth("root"))
        session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
        good = plane.policy.revision
        healthy = (await client.get("/v1/policy", headers=auth("audit"))).json()
        assert healthy["in_force"]["revision"] == good
        assert healthy["in_force"]["source"] == str(root)
        assert healthy["on_disk"]["loaded"] is True
        assert healthy["on_disk"]["error"] is None
        assert (await client.get("/readyz")).json()["degraded"] == {}

        (root / "stockade" / "broken.rego").write_text("package stockade\n\nthis is not rego\n")
        refused = await client.post("/v1/policy/reload", headers=auth("root"))
        assert refused.status_code == 503
        status = (await client.get("/v1/policy", headers=auth("audit"))).json()
        assert status["revision"] == status["in_force"]["revision"] == good
        on_disk = status["on_disk"]
        assert on_disk["loaded"] is False
        assert "stockade/broken.rego:3:1: rule must have a body or assignment" in on_disk["error"]
        assert "\n" not in on_disk["error"]
        assert "backtrace" not in on_disk["error"].lower()
        assert on_disk["revision"] == load_bundle(root).revision != good  # the files that failed
        assert on_disk["at"] > status["in_force"]["loaded_at"]
        ready = await client.get("/readyz")
        assert ready.status_code == 200  # the previous revision decides: see get_readiness
        body = ready.json()
        assert body["ready"] is True
        assert body["checks"] == {"policy": True, "store": True, "audit": True}
        assert body["degraded"]["policy"].startswith("the files on disk failed to load (GET /v1/policy says why)")
        # Not why: anyone may ask /readyz, and the engine's error quotes the policy's source.
        assert "broken.rego" not in ready.text
        assert body["degraded"]["policy"].endswith(f"the previous revision {good} stays in force")
        assert await decided_revision(client, plane, session["session_id"]) == ("allow", good)

        (root / "stockade" / "broken.rego").unlink()
        edit_catalog(root, auto_allow_risks=[])
        fixed = await client.post("/v1/policy/reload", headers=auth("root"))
        assert fixed.status_code == 200
        new = fixed.json()["in_force"]["revision"]
        assert new != good
        assert fixed.json()["on_disk"] == {**fixed.json()["on_disk"], "loaded": True, "error": None, "revision": new}
        status = (await client.get("/v1/policy", headers=auth("audit"))).json()
        assert (status["on_disk"]["loaded"], status["on_disk"]["error"], status["files_problem"]) == (True, None, None)
        assert (await client.get("/readyz")).json()["degraded"] == {}
        assert await decided_revision(client, plane, session["session_id"]) == ("deny", new)


async def test_a_watched_bundle_is_hot_reloaded_and_a_tampered_one_reported(tmp_path: Path) -> None:
    key = Ed25519PrivateKey.generate()
    public = tmp_path / "signing.pub"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
    root = copy_policies(tmp_path)
    bundle = tmp_path / "policy.tar.gz"
    first = build_bundle(root, bundle, revision="v1", signing_key=key)
    policy = PolicySettings(bundle=bundle, bundle_public_key=public, watch_interval_s=0.05)
    async with served(make_settings(tmp_path, policy)) as (client, plane):
        await client.post("/v1/tools", json=external_tool("echo"), headers=auth("root"))
        session = (await client.post("/v1/sessions", json={"principal": "alice"}, headers=auth("agent-1"))).json()
        assert await decided_revision(client, plane, session["session_id"]) == ("allow", first.revision)

        edit_catalog(root, auto_allow_risks=[])
        second = build_bundle(root, bundle, revision="v2", signing_key=key)
        for _ in range(100):  # the watcher (opened with the session) sees the replaced file
            await asyncio.sleep(0.05)
            if plane.policy.revision == second.revision:
                break
        assert await decided_revision(client, plane, session["session_id"]) == ("deny", second.revision)

        pack(bundle, [*members_of(bundle), ("stockade/zz_allow.rego", b"package stockade\n")])
        for _ in range(100):
            await asyncio.sleep(0.05)
            if (await client.get("/readyz")).json()["degraded"]:
                break
        status = (await client.get("/v1/policy", headers=auth("audit"))).json()
        assert status["in_force"] == {**status["in_force"], "revision": second.revision, "source": str(bundle)}
        assert status["on_disk"]["loaded"] is False
        assert "'stockade/zz_allow.rego' is not covered by the signature" in status["on_disk"]["error"]
        assert status["on_disk"]["revision"].startswith("sha256:")
        ready = await client.get("/readyz")
        assert ready.status_code == 200
        assert "zz_allow.rego" not in ready.text
        assert ready.json()["degraded"]["policy"].startswith("the files on disk failed to load")
        assert await decided_revision(client, plane, session["session_id"]) == ("deny", second.revision)

"""The OPA server engine switches policies whole: a reload OPA refuses leaves exactly the old policy in
force, a restarted engine removes the modules an earlier one left on the server, and no decision is
evaluated against a half-uploaded policy. Against OPA's own evaluator (`tests.opa_server`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings
from policy.opa import OpaEngine
from tests.conftest import copy_policies, server_process
from tests.policy.test_embedded import make_input
from tests.policy.test_opa import opa_server


def serve_with_listing() -> None:
    """`tests.opa_server` plus two endpoints of OPA's REST API it lacks: ``GET /v1/policies``
    (``{"result": [{"id", "raw"}]}``) and ``DELETE /v1/data/<key>`` (204, or 404 when absent)."""
    import tests.opa_server as server  # noqa: PLC0415  (loads OPA's evaluator: only in the server process)

    plain = server.handler

    def handler(store: server.Store, log: Path | None) -> type[BaseHTTPRequestHandler]:
        base: Any = plain(store, log)

        class Listing(base):  # type: ignore[misc]  # the plain handler is a class built at run time
            def do_GET(self) -> None:
                if self.path.split("?")[0].rstrip("/") != "/v1/policies":
                    super().do_GET()
                    return
                self._route()
                with store.lock:
                    self._reply(200, {"result": [{"id": i, "raw": text} for i, text in store.modules.items()]})

            def do_DELETE(self) -> None:
                if not self.path.startswith("/v1/data/"):
                    super().do_DELETE()
                    return
                _, rest = self._route()
                with store.lock:
                    if rest[0] not in store.data:
                        self._reply(404, {"code": "resource_not_found", "message": self.path})
                        return
                    store.change(store.modules, {k: v for k, v in store.data.items() if k != rest[0]})
                self._reply(204)

        return Listing

    server.handler = handler
    server.main()


@contextlib.contextmanager
def listing_opa_server(log: Path) -> Iterator[str]:
    """`serve_with_listing` as a process, started as `opa_server` starts the plain one; its URL."""
    argv = [sys.executable, "-c", "from tests.policy.test_opa_reload import serve_with_listing as s; s()"]
    with server_process([*argv, "--log", str(log)], log.with_suffix(".stderr"), "/health") as url:
        log.write_text("")
        yield url


def deploy_input() -> PolicyInput:
    fields = make_input([], "critical").model_dump()
    fields["tool"]["name"] = "deploy_prod"
    return PolicyInput.model_validate(fields)


async def test_a_reload_opa_refuses_half_way_leaves_none_of_its_modules_in_force(tmp_path: Path) -> None:
    """OPA accepts the new bundle's loosening module, then refuses a broken one: the loosening
    module is deleted again, and a call that needs approval still needs it."""
    policies = copy_policies(tmp_path)
    with opa_server(tmp_path / "requests.log") as url:
        engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5))
        try:
            before = await engine.decide(make_input([], "critical"))
            assert before.outcome is Outcome.REQUIRE_APPROVAL
            (policies / "stockade" / "loosen.rego").write_text("package stockade\n\nis_approved if true\n")
            (policies / "stockade" / "broken.rego").write_text("package stockade\nthis is not rego\n")
            with pytest.raises(PolicyBundleError, match="refused"):
                await engine.reload()
            assert await engine.decide(make_input([], "critical")) == before
        finally:
            await engine.aclose()
    requests = (tmp_path / "requests.log").read_text().splitlines()
    assert "PUT /v1/policies/stockade/stockade/loosen" in requests  # OPA did accept it for a while
    assert requests.index("PUT /v1/policies/stockade/stockade/loosen") < requests.index(
        "DELETE /v1/policies/stockade/stockade/loosen"
    )


async def test_a_refused_reload_leaves_no_data_of_its_own_behind(tmp_path: Path) -> None:
    """Data the refused bundle mounted at a new key is deleted with its modules."""
    policies = copy_policies(tmp_path)
    with listing_opa_server(tmp_path / "requests.log") as url:
        engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5))
        try:
            before = await engine.decide(make_input([], "critical"))
            (policies / "team").mkdir()
            (policies / "team" / "data.json").write_text('{"quota": 5}')
            (policies / "stockade" / "broken.rego").write_text("package stockade\nthis is not rego\n")
            with pytest.raises(PolicyBundleError, match="refused"):
                await engine.reload()
            assert await engine.decide(make_input([], "critical")) == before
        finally:
            await engine.aclose()
        async with httpx.AsyncClient() as client:
            assert (await client.post(f"{url}/v1/data/team", json={})).json() == {}  # undefined


async def test_a_module_deleted_from_disk_is_gone_from_opa_after_a_restart(tmp_path: Path) -> None:
    """An engine owns the ``stockade/`` ids on the server: a new one (a restarted router) deletes
    the modules an earlier one put there that its policy no longer has, before it decides."""
    policies = copy_policies(tmp_path)
    exception = policies / "stockade" / "incident_exception.rego"
    exception.write_text('package stockade\n\nis_approved if input.tool.name == "deploy_prod"\n')
    log = tmp_path / "requests.log"
    with listing_opa_server(log) as url:
        settings = PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5)
        first = OpaEngine(settings)
        try:
            assert (await first.decide(deploy_input())).outcome is Outcome.ALLOW
        finally:
            await first.aclose()
        exception.unlink()
        log.write_text("")
        restarted, reference = OpaEngine(settings), EmbeddedEngine(PolicySettings(dir=policies))
        try:
            decision = await restarted.decide(deploy_input())
            assert decision == await reference.decide(deploy_input())
            assert decision.outcome is Outcome.REQUIRE_APPROVAL
        finally:
            await restarted.aclose()
            await reference.aclose()
    requests = log.read_text().splitlines()
    listed = requests.index("GET /v1/policies/")
    deleted = requests.index("DELETE /v1/policies/stockade/stockade/incident_exception")
    assert listed < deleted < requests.index("POST /v1/data/stockade/decision?strict-builtin-errors=True")


async def test_no_decision_is_evaluated_while_a_reload_uploads(tmp_path: Path) -> None:
    """Reloads move a deny rule from one file to another and back (old and new policy decide
    alike); decisions asked meanwhile wait for each upload, and every one is that deny."""
    policies = copy_policies(tmp_path)
    egress = policies / "stockade" / "egress.rego"
    moved = policies / "stockade" / "zz_egress.rego"
    old = egress.read_text()
    rule = old[old.index("deny_reasons contains") : old.index("requested_egress :=")]
    fields = make_input().model_dump()
    fields["tool"]["egress"] = [{"host": "evil.test", "port": 443}]
    call = PolicyInput.model_validate(fields)
    reference = EmbeddedEngine(PolicySettings(dir=policies))
    expected = await reference.decide(call)
    await reference.aclose()
    assert expected.outcome is Outcome.DENY
    with opa_server(tmp_path / "requests.log") as url:
        engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5))
        seen: list[tuple[Outcome, list[str]]] = []
        try:
            await engine.decide(call)
            for flip in range(6):
                if flip % 2 == 0:
                    egress.write_text(old.replace(rule, ""))
                    moved.write_text("package stockade\n\nimport data.stockade.catalog\n\n" + rule)
                else:
                    moved.unlink()
                    egress.write_text(old)
                reload = asyncio.create_task(engine.reload())
                while not reload.done():
                    decision = await engine.decide(call)
                    seen.append((decision.outcome, decision.reason_codes))
                await reload
        finally:
            await engine.aclose()
    assert len(seen) >= 6
    assert set(map(str, seen)) == {str((expected.outcome, expected.reason_codes))}

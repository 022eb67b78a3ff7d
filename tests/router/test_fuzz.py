"""Schemathesis against /openapi.json: at least 10,000 generated requests, authenticated as the
role each route is for, and not one 5xx; every 4xx is a well-formed error document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings

from policy import PolicySettings
from router import ControlPlane, Settings
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings
from tests.conftest import REPO, external_tool
from tests.router.test_api import TOKENS, principals

EXAMPLES = 1000  # per operation, at most: some operations have fewer distinct inputs than that
# Takes no input to vary; it compiles the policy on the test client's thread, and regorus objects
# must be dropped on the thread that made them (the role tests cover it).
SKIPPED = {("POST", "/v1/policy/reload")}


def token_for(path: str) -> str:
    """Each route is exercised as the role it is for, so requests get past the door."""
    if path.startswith("/v1/sessions"):
        return TOKENS["agent-1"]
    if path.startswith("/v1/approvals"):
        return TOKENS["oncall"]
    return TOKENS["root"]


def check(case: Any, statuses: list[int]) -> None:
    response = case.call(headers={"Authorization": f"Bearer {token_for(case.path)}"})
    statuses.append(response.status_code)
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    if 400 <= response.status_code < 500:
        body = response.json()
        assert isinstance(body, dict), body
        problem = {"type", "title", "status", "detail"} <= body.keys() and body["status"] == response.status_code
        oauth = "error" in body  # RFC 7662 / 6749 errors of the introspection endpoint
        assert problem or oauth, body


def test_ten_thousand_generated_requests_get_no_server_error(tmp_path: Path) -> None:
    plane = ControlPlane.from_settings(Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl", durability="relaxed"),
        policy=PolicySettings(dir=REPO / "policies", watch_interval_s=0),
        api_principals=[ApiPrincipal.model_validate(p) for p in principals()],
    ))  # fmt: skip
    plane.registry.register(external_tool("echo"))
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(plane))
    statuses: list[int] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) in SKIPPED:
            continue

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case: Any) -> None:
            check(case, statuses)

        fuzz()
    assert len(statuses) >= 10_000, len(statuses)
    assert any(400 <= s < 500 for s in statuses)
    assert any(s < 300 for s in statuses)

"""What policy sees: the principal's groups and labels from configuration, the environment, rate
windows per minute, hour and day for every scope, and session labels earlier decisions set.

Each test writes a small policy of its own and drives a real control plane (and the HTTP API, and
two routers on one Redis) against it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from policy import PolicySettings
from policy.base import MAX_SESSION_LABELS, RATE_WINDOWS
from router import ControlPlane, Settings
from router.audit import AuditFilter
from router.interfaces.api import create_app
from router.settings import ApiPrincipal, AuditSettings, StoreSettings
from tests.conftest import REPO, external_tool

DEPLOY = external_tool("deploy", risk="high", capabilities=["mutates_state"])
READ = external_tool("read_customers", capabilities=["reads_private"])
SEND = external_tool("send_email", capabilities=["sends_external"])

DEPLOY_GUARD = """
package stockade

import rego.v1

default decision := {"outcome": "deny", "reasons": [{"code": "deploy.refused", "message": "not a deployer here"}]}

decision := {"outcome": "allow"} if {
	"deployers" in input.subject.groups
	input.subject.labels.team == "payments"
	input.environment.name == "prod"
}
"""

AGENT_HOURLY_LIMIT = """
package stockade

import rego.v1

default decision := {"outcome": "allow"}

decision := {"outcome": "deny", "reasons": [{"code": "rate.exceeded", "message": "over 3 an hour"}]} if {
	input.rate.agent_per_hour > 3
}
"""

PRINCIPAL_DAILY_LIMIT = """
package stockade

import rego.v1

default decision := {"outcome": "allow"}

decision := {"outcome": "deny", "reasons": [{"code": "rate.exceeded", "message": "over 2 a day"}]} if {
	input.rate.principal_per_day > 2
}
"""

# Reading customer records marks the session; a later send from it is refused. Reading them
# needs an approval first.
CUSTOMER_RECORDS = """
package stockade

import rego.v1

default decision := {"outcome": "allow"}

decision := {"outcome": "require_approval", "reasons": [{"code": "approval.customer_records"}]} if {
	input.tool.name == "read_customers"
	input.approval == null
}

decision := {"outcome": "allow", "obligations": {"session_labels": ["read_customer_records"]}} if {
	input.tool.name == "read_customers"
	input.approval.status == "approved"
}

decision := {"outcome": "deny", "reasons": [{"code": "exfiltration.customer_records"}]} if {
	input.tool.name == "send_email"
	"read_customer_records" in input.session.labels
}
"""

ALLOW_AND_LABEL = """
package stockade

import rego.v1

decision := {"outcome": "allow", "obligations": {"session_labels": ["read_customer_records"]}} if {
	input.tool.name == "read_customers"
}

decision := {"outcome": "deny", "reasons": [{"code": "exfiltration.customer_records"}]} if {
	input.tool.name == "send_email"
	"read_customer_records" in input.session.labels
}

decision := {"outcome": "allow"} if {
	input.tool.name == "send_email"
	not "read_customer_records" in input.session.labels
}
"""

BOGUS_LABEL = """
package stockade

import rego.v1

decision := {"outcome": "allow", "obligations": {"session_labels": ["read customer records; DROP TABLE"]}}
"""

# 32 new labels a call (the most one decision may set): the ninth call would take the session
# past its cap.
MANY_LABELS = """
package stockade

import rego.v1

decision := {"outcome": "allow", "obligations": {"session_labels": labels}} if {
	labels := [sprintf("batch-%d-%d", [input.session.call_count, i]) | some i in numbers.range(1, 32)]
}
"""


def policy_dir(tmp_path: Path, rego: str) -> Path:
    root = tmp_path / "policies"
    (root / "stockade").mkdir(parents=True, exist_ok=True)
    (root / "stockade" / "decision.rego").write_text(rego)
    return root


def settings_for(tmp_path: Path, rego: str, store_url: str | None = None, **fields: Any) -> Settings:
    return Settings(
        audit=AuditSettings(path=tmp_path / "audit.jsonl"), policy=PolicySettings(dir=policy_dir(tmp_path, rego)),
        store=StoreSettings(url=store_url), **fields,
    )  # fmt: skip


async def decision_inputs(plane: ControlPlane, tool: str) -> list[dict[str, Any]]:
    """The ``input`` of every audited decision about ``tool``, oldest first."""
    events = await plane.audit.query(AuditFilter(kind="decision", tool=tool))
    return [e.input for e in events if e.input is not None]


# -- subject and environment ------------------------------------------------------------------


PRINCIPALS = {
    "alice@example.com": {"groups": ["deployers", "oncall"], "labels": {"team": "payments", "level": "L3"}},
    "bob@example.com": {"groups": ["developers"], "labels": {"team": "payments"}},
}


async def test_groups_labels_and_environment_come_from_configuration(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, DEPLOY_GUARD, principals=PRINCIPALS, environment="prod", instance="router-7")
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(DEPLOY)
        alice = await plane.open_session("release-bot", "alice@example.com")
        bob = await plane.open_session("release-bot", "bob@example.com")
        stranger = await plane.open_session("release-bot", "eve@example.com")
        assert (await plane.call(alice, "deploy", {})).status == "awaiting_report"
        for session in (bob, stranger):
            refused = await plane.call(session, "deploy", {})
            assert (refused.status, refused.reasons) == ("denied", ["deploy.refused"])
        seen = await decision_inputs(plane, "deploy")
    subjects = [i["subject"] for i in seen]
    assert subjects == [
        {"agent": "release-bot", "principal": "alice@example.com", "groups": ["deployers", "oncall"],
         "labels": {"team": "payments", "level": "L3"}},
        {"agent": "release-bot", "principal": "bob@example.com", "groups": ["developers"],
         "labels": {"team": "payments"}},
        {"agent": "release-bot", "principal": "eve@example.com", "groups": [], "labels": {}},
    ]  # fmt: skip
    assert [i["environment"] for i in seen] == [{"name": "prod", "instance": "router-7"}] * 3


async def test_the_same_policy_denies_outside_prod(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, DEPLOY_GUARD, principals=PRINCIPALS, environment="staging")
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(DEPLOY)
        alice = await plane.open_session("release-bot", "alice@example.com")
        assert (await plane.call(alice, "deploy", {})).reasons == ["deploy.refused"]


TOKENS = {"deploy-bot": "tok-bot", "other-bot": "tok-other", "alice@example.com": "tok-alice", "root": "tok-root"}


def token_hash(name: str) -> str:
    return hashlib.sha256(TOKENS[name].encode()).hexdigest()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ControlPlane]]:
    """The HTTP API, with alice's groups and labels on her own API principal entry (she approves)."""
    settings = settings_for(tmp_path, DEPLOY_GUARD, environment="prod", api_principals=[
        ApiPrincipal(name="deploy-bot", role="agent", token_sha256=token_hash("deploy-bot"),
                     acts_for=["alice@example.com", "bob@example.com"]),
        ApiPrincipal(name="other-bot", role="agent", token_sha256=token_hash("other-bot")),
        ApiPrincipal(name="alice@example.com", role="approver", token_sha256=token_hash("alice@example.com"),
                     groups=["deployers"], labels={"team": "payments"}),
        ApiPrincipal(name="root", role="admin", token_sha256=token_hash("root")),
    ])  # fmt: skip
    async with (
        ControlPlane.from_settings(settings) as plane,
        httpx.AsyncClient(transport=httpx.ASGITransport(create_app(plane)), base_url="http://s") as client,
    ):
        yield client, plane


async def test_over_http_a_session_acting_for_a_configured_principal_gets_its_groups(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    client, plane = api
    bot = {"Authorization": "Bearer tok-bot"}
    registered = await client.post("/v1/tools", json=DEPLOY, headers={"Authorization": "Bearer tok-root"})
    assert registered.status_code == 201
    results = []
    for principal in ("alice@example.com", "bob@example.com"):
        opened = await client.post("/v1/sessions", json={"principal": principal}, headers=bot)
        session = opened.json()["session_id"]
        call = await client.post(f"/v1/sessions/{session}/calls", json={"tool": "deploy", "args": {}}, headers=bot)
        results.append((call.json()["status"], call.json()["reasons"]))
    assert results == [("awaiting_report", []), ("denied", ["deploy.refused"])]
    seen = await decision_inputs(plane, "deploy")
    assert [(i["subject"]["groups"], i["subject"]["labels"]) for i in seen] == [
        (["deployers"], {"team": "payments"}),
        ([], {}),
    ]


async def test_an_agent_cannot_claim_a_configured_principal_it_does_not_act_for(
    api: tuple[httpx.AsyncClient, ControlPlane],
) -> None:
    """The session's principal is in the body, which the agent writes: groups and labels would be
    anyone's for the naming. A principal with groups or labels is acted for only by agents whose
    acts_for lists it; an agent with acts_for opens sessions for those principals only."""
    client, plane = api
    other = {"Authorization": "Bearer tok-other"}
    bot = {"Authorization": "Bearer tok-bot"}
    claimed = await client.post("/v1/sessions", json={"principal": "alice@example.com"}, headers=other)
    assert (claimed.status_code, claimed.json()["code"]) == (403, "auth.forbidden")
    assert "acts_for" in claimed.json()["detail"]
    unlisted = await client.post("/v1/sessions", json={"principal": "carol@example.com"}, headers=bot)
    assert unlisted.status_code == 403
    plain = await client.post("/v1/sessions", json={"principal": "bob@example.com"}, headers=other)
    assert plain.status_code == 201  # no groups or labels to claim: any agent may act for bob
    refusals = [e for e in await plane.audit.query(AuditFilter(kind="error")) if e.outcome == "refused"]
    assert [(e.agent, e.result["request"]) for e in refusals if e.result] == [
        ("other-bot", "POST /v1/sessions"),
        ("deploy-bot", "POST /v1/sessions"),
    ]


# -- rate windows -----------------------------------------------------------------------------


@pytest.fixture
def store_url(both_stores: str | None) -> str | None:
    return both_stores


async def test_an_hourly_limit_per_agent_spans_its_sessions(tmp_path: Path, store_url: str | None) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path, AGENT_HOURLY_LIMIT, store_url)) as plane:
        await plane.register(SEND)
        first = await plane.open_session("mailer", "alice@example.com")
        second = await plane.open_session("mailer", "bob@example.com")
        other = await plane.open_session("another-agent", "alice@example.com")
        statuses = [(await plane.call(s, "send_email", {})).status for s in (first, second, first, second)]
        assert statuses == ["awaiting_report"] * 3 + ["denied"]
        assert (await plane.decide(first, "send_email", {})).outcome == "deny"  # decide() sees, does not count
        assert (await plane.call(other, "send_email", {})).status == "awaiting_report"  # its own window
        seen = await decision_inputs(plane, "send_email")
    assert all(set(i["rate"]) == set(RATE_WINDOWS) for i in seen)  # every window is in input.rate
    assert [i["rate"]["agent_per_hour"] for i in seen] == [1, 2, 3, 4, 4, 1]
    assert [i["rate"]["principal_per_day"] for i in seen] == [1, 1, 2, 2, 2, 3]
    assert [i["rate"]["tool_per_minute"] for i in seen] == [1, 2, 3, 4, 4, 5]


async def test_a_daily_limit_per_principal_spans_agents(tmp_path: Path, store_url: str | None) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path, PRINCIPAL_DAILY_LIMIT, store_url)) as plane:
        await plane.register(SEND)
        sessions = [await plane.open_session(agent, "alice@example.com") for agent in ("a-1", "a-2", "a-3")]
        assert [(await plane.call(s, "send_email", {})).status for s in sessions] == [
            "awaiting_report",
            "awaiting_report",
            "denied",
        ]
        bob = await plane.open_session("a-1", "bob@example.com")
        assert (await plane.call(bob, "send_email", {})).status == "awaiting_report"


async def test_two_routers_on_one_redis_count_every_window_together(tmp_path: Path, redis_url: str) -> None:
    settings = settings_for(tmp_path, AGENT_HOURLY_LIMIT, redis_url)
    async with ControlPlane.from_settings(settings) as one, ControlPlane.from_settings(settings) as two:
        for plane in (one, two):
            await plane.register(SEND)
        session = await one.open_session("mailer", "alice@example.com")
        elsewhere = await two.open_session("mailer", "alice@example.com")
        order = [(one, session), (two, session), (two, elsewhere), (one, elsewhere)]
        assert [(await p.call(s, "send_email", {})).status for p, s in order] == ["awaiting_report"] * 3 + ["denied"]
        seen = await decision_inputs(one, "send_email")  # one audit log: both routers' decisions
    last = seen[-1]["rate"]
    assert (last["agent_per_minute"], last["agent_per_hour"], last["agent_per_day"]) == (4, 4, 4)
    assert (last["principal_per_day"], last["session_per_day"], last["agent_tool_per_hour"]) == (4, 2, 4)


# -- session labels ---------------------------------------------------------------------------


async def test_a_label_policy_sets_is_seen_by_later_decisions_and_audited(
    tmp_path: Path, store_url: str | None
) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path, ALLOW_AND_LABEL, store_url)) as plane:
        for tool in (READ, SEND):
            await plane.register(tool)
        session = await plane.open_session("support-bot", "alice@example.com")
        clean = await plane.open_session("support-bot", "alice@example.com")
        assert (await plane.decide(session, "read_customers", {})).outcome == "allow"  # a dry run labels nothing
        assert (await plane.call(session, "send_email", {})).status == "awaiting_report"
        assert (await plane.call(session, "read_customers", {})).status == "awaiting_report"
        after = await plane.call(session, "send_email", {})
        assert (after.status, after.reasons) == ("denied", ["exfiltration.customer_records"])
        assert (await plane.call(clean, "send_email", {})).status == "awaiting_report"  # its own session only
        reads = [e for e in await plane.audit.query(AuditFilter(kind="decision", tool="read_customers"))
                 if e.result is not None and e.result["mode"] == "call"]  # fmt: skip
        sends = await decision_inputs(plane, "send_email")
    assert [e.result["obligations"]["session_labels"] for e in reads if e.result] == [["read_customer_records"]]
    assert [(i["session"]["id"], i["session"]["labels"]) for i in sends] == [
        (session, []), (session, ["read_customer_records"]), (clean, []),
    ]  # fmt: skip


async def test_a_label_set_after_an_approval_holds_on_another_router(tmp_path: Path, redis_url: str) -> None:
    settings = settings_for(tmp_path, CUSTOMER_RECORDS, redis_url)
    async with ControlPlane.from_settings(settings) as one, ControlPlane.from_settings(settings) as two:
        for plane in (one, two):
            for tool in (READ, SEND):
                await plane.register(tool)
        session = await one.open_session("support-bot", "alice@example.com")
        held = await one.call(session, "read_customers", {"id": 7})
        assert held.status == "pending_approval"
        assert held.approval_id is not None
        assert (await two.call(session, "send_email", {})).status == "awaiting_report"  # not read yet
        await one.approve(held.approval_id, "oncall")
        assert (await one.call(session, "read_customers", {"id": 7}, approval_id=held.approval_id)).status == (
            "awaiting_report"
        )
        refused = await two.call(session, "send_email", {})
        assert (refused.status, refused.reasons) == ("denied", ["exfiltration.customer_records"])


async def test_a_malformed_label_from_policy_is_a_denial_on_record(tmp_path: Path, store_url: str | None) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path, BOGUS_LABEL, store_url)) as plane:
        await plane.register(SEND)
        session = await plane.open_session("mailer", "alice@example.com")
        result = await plane.call(session, "send_email", {})
        assert (result.status, result.reasons) == ("denied", ["policy.error"])
        [event] = await plane.audit.query(AuditFilter(kind="decision", session_id=session))
        loaded = await plane.store.load_session(session)
    assert event.outcome == "deny"
    assert event.result is not None
    assert "obligations.session_labels.0" in event.result["reasons"][0]["message"]
    assert loaded is not None
    assert loaded.labels == frozenset()  # nothing of it reached the session


async def test_a_session_takes_no_more_labels_than_its_cap(tmp_path: Path) -> None:
    async with ControlPlane.from_settings(settings_for(tmp_path, MANY_LABELS)) as plane:
        await plane.register(SEND)
        session = await plane.open_session("mailer", "alice@example.com")
        calls = MAX_SESSION_LABELS // 32 + 1
        results = [await plane.call(session, "send_email", {}) for _ in range(calls)]
        loaded = await plane.store.load_session(session)
        last = (await plane.audit.query(AuditFilter(kind="decision", session_id=session)))[-1]
    assert [r.status for r in results] == ["awaiting_report"] * (calls - 1) + ["denied"]
    assert results[-1].reasons == ["policy.error"]
    assert last.result is not None
    assert "over 256" in last.result["reasons"][0]["message"]
    assert loaded is not None
    assert len(loaded.labels) == MAX_SESSION_LABELS


# -- hostile configuration --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("principals", "where", "says"),
    [
        ({"alice": {"groups": ["x" * 100_000]}}, "principals.alice.groups.0", "100000 characters"),
        ({"alice": {"groups": ["deployers\nadmins"]}}, "principals.alice.groups.0", "is not a group name"),
        ({"alice": {"groups": [""]}}, "principals.alice.groups.0", "is not a group name"),
        ({"alice": {"groups": [f"g{i}" for i in range(65)]}}, "principals.alice.groups", "at most 64"),
        ({"alice": {"labels": {"team": "pay\x00ments"}}}, "principals.alice.labels", "value"),
        ({"alice": {"labels": {"team": "y" * 300}}}, "principals.alice.labels", "300 characters"),
        ({"alice": {"labels": {"team name": "payments"}}}, "principals.alice.labels", "label name 'team name'"),
        ({"alice": {"labels": {"\u202eteam": "payments"}}}, "principals.alice.labels", "label name"),
        ({"alice": {"roles": ["admin"]}}, "principals.alice.roles", "Extra inputs"),
        ({"al ice": {}}, "principals", "principal name 'al ice'"),
        ({"a" * 5000: {}}, "principals", "5000 characters"),
    ],
)
def test_odd_groups_and_labels_in_configuration_are_refused_naming_the_field(
    principals: dict[str, Any], where: str, says: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(principals=principals)
    message = str(caught.value)
    assert where in message
    assert says in message
    assert len(message) < 2000  # a 100 kB value is not echoed back whole


def test_an_api_principal_with_odd_groups_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"api_principals\.0\.groups\.1"):
        Settings(api_principals=[{"name": "alice", "role": "approver", "token_sha256": "0" * 64,
                                  "groups": ["ok", "not ok"]}])  # fmt: skip


def test_a_principal_configured_twice_differently_is_refused() -> None:
    api = {"name": "alice", "role": "approver", "token_sha256": "0" * 64, "groups": ["deployers"]}
    with pytest.raises(ValidationError, match="principal 'alice' has groups or labels configured twice"):
        Settings(principals={"alice": {"groups": ["admins"]}}, api_principals=[api])
    same = Settings(principals={"alice": {"groups": ["deployers"]}}, api_principals=[api])
    assert same.principal_config("alice").groups == ["deployers"]
    plain = Settings(principals={"alice": {"labels": {"team": "x"}}}, api_principals=[{**api, "groups": []}])
    assert plain.principal_config("alice").labels == {"team": "x"}


@pytest.mark.parametrize("environment", ["Prod", "prod env", "", "p" * 65, "prod\n"])
def test_an_odd_environment_name_is_refused(environment: str) -> None:
    with pytest.raises(ValidationError, match="environment"):
        Settings(environment=environment)


@pytest.fixture
def environ() -> dict[str, str]:
    """The variables a router started from a shell would see (none of stockade's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("STOCKADE_")}


def test_principals_and_environment_are_read_from_the_environment(environ: dict[str, str]) -> None:
    script = (
        "from router.settings import Settings; s = Settings(); "
        "print(s.environment, s.principal_config('alice@example.com').model_dump_json())"
    )
    env = {**environ, "STOCKADE_ENVIRONMENT": "prod", "STOCKADE_PRINCIPALS": json.dumps(PRINCIPALS)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    assert done.stdout.split(" ", 1) == [
        "prod",
        '{"groups":["deployers","oncall"],"labels":{"team":"payments","level":"L3"}}\n',
    ]
    env["STOCKADE_PRINCIPALS"] = json.dumps({"alice": {"groups": ["a" * 200]}})
    refused = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                             check=False, timeout=60)  # fmt: skip
    assert refused.returncode != 0
    assert "principals.alice.groups.0" in refused.stderr

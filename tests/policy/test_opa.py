"""The OPA server engine: fails closed without a server; with one (STOCKADE_TEST_OPA_URL), decides
exactly as the embedded engine, the reference."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings, make_engine
from policy.opa import OpaEngine
from tests.conftest import copy_policies, free_port
from tests.policy.test_embedded import PARITY_INPUTS, make_input

# No OPA binary installs on our machines: these run where one is running, e.g. `docker compose up opa`.
OPA_URL = os.environ.get("STOCKADE_TEST_OPA_URL")
needs_opa = pytest.mark.skipif(OPA_URL is None, reason="set STOCKADE_TEST_OPA_URL to an OPA server to run")


async def test_an_unreachable_opa_server_is_a_deny_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    engine = make_engine(PolicySettings(engine="opa", opa_url=url, opa_timeout_s=0.5))
    try:
        assert isinstance(engine, OpaEngine)
        decision = await engine.decide(make_input())
        assert decision.outcome is Outcome.DENY
        assert decision.reason_codes == ["policy.error"]
        assert url in decision.reasons[0].message
    finally:
        await engine.aclose()


def test_a_malformed_opa_url_or_policy_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyBundleError, match="STOCKADE_POLICY__OPA_URL"):
        OpaEngine(PolicySettings(engine="opa", opa_url="localhost:8181"))
    with pytest.raises(PolicyBundleError, match="does not exist"):
        OpaEngine(PolicySettings(engine="opa", dir=tmp_path / "missing"))


@pytest.fixture
async def opa(tmp_path: Path) -> AsyncIterator[tuple[OpaEngine, Path]]:
    assert OPA_URL is not None
    policies = copy_policies(tmp_path)
    engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=OPA_URL, opa_timeout_s=5))
    yield engine, policies
    await engine.aclose()


@needs_opa
@pytest.mark.parametrize("policy_input", PARITY_INPUTS)
async def test_opa_decides_exactly_as_the_embedded_engine(
    opa: tuple[OpaEngine, Path], policy_input: PolicyInput
) -> None:
    engine, policies = opa
    reference = EmbeddedEngine(PolicySettings(dir=policies))
    try:
        assert await engine.decide(policy_input) == await reference.decide(policy_input)
    finally:
        await reference.aclose()


@needs_opa
async def test_a_policy_opa_refuses_keeps_the_old_one_in_force(opa: tuple[OpaEngine, Path]) -> None:
    engine, policies = opa
    before = await engine.decide(make_input([], "high"))
    assert before.outcome is Outcome.REQUIRE_APPROVAL
    (policies / "stockade" / "broken.rego").write_text("package stockade\nthis is not rego\n")
    with pytest.raises(PolicyBundleError, match="refused"):
        await engine.reload()
    assert await engine.decide(make_input([], "high")) == before

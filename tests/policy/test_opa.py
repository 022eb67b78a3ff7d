"""The OPA server engine: fails closed without a server; against OPA's own evaluator
(`tests.opa_server`), decides exactly as the embedded engine, the reference; uploads its policy,
or not when the server loads the directory itself."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from policy import EmbeddedEngine, Outcome, PolicyBundleError, PolicyInput, PolicySettings, make_engine
from policy.opa import OpaEngine
from tests.conftest import copy_policies, free_port, server_process
from tests.policy.test_embedded import PARITY_INPUTS, make_input


@contextlib.contextmanager
def opa_server(log: Path, directory: Path | None = None) -> Iterator[str]:
    """`tests.opa_server` as a process (OPA's evaluator, which scripts/services unpacks); its URL.
    ``log`` receives the requests it answers, from the client's first one on."""
    argv = [
        sys.executable,
        "-m",
        "tests.opa_server",
        "--log",
        str(log),
        *(["--dir", str(directory)] if directory else []),
    ]
    with server_process(argv, log.with_suffix(".stderr"), "/health") as url:
        log.write_text("")  # the readiness probe is not the client's
        yield url


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


@pytest.mark.parametrize("upload", [True, False])
async def test_the_engine_uploads_the_policy_unless_the_server_loads_it_itself(tmp_path: Path, upload: bool) -> None:
    policies = copy_policies(tmp_path / "router")
    log = tmp_path / "requests.log"
    with opa_server(log, None if upload else copy_policies(tmp_path / "opa")) as url:
        engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5,
                                          opa_upload=upload))  # fmt: skip
        reference = EmbeddedEngine(PolicySettings(dir=policies))
        try:
            for policy_input in PARITY_INPUTS[:3]:
                assert await engine.decide(policy_input) == await reference.decide(policy_input)
            (policies / "stockade" / "extra.rego").write_text("package stockade.extra\n\nanswer := 42\n")
            assert await engine.reload() == await reference.reload()
            assert await engine.decide(make_input()) == await reference.decide(make_input())
        finally:
            await engine.aclose()
            await reference.aclose()
    requests = log.read_text().splitlines()
    decisions = [r for r in requests if r.startswith("POST")]
    # Strict: a builtin error is an error answer (a deny), never an undefined rule.
    assert decisions == ["POST /v1/data/stockade/decision?strict-builtin-errors=True"] * 4
    uploads = [r for r in requests if r.startswith("PUT")]
    if upload:  # before the first decision and on the reload
        assert "PUT /v1/policies/stockade/stockade/decision" in uploads
        assert "PUT /v1/policies/stockade/stockade/extra" in uploads
        assert requests.index("PUT /v1/policies/stockade/stockade/decision") < requests.index(decisions[0])
    else:
        assert uploads == []


@pytest.fixture(scope="module")
def opa_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with opa_server(tmp_path_factory.mktemp("opa") / "requests.log") as url:
        yield url


@pytest.fixture
async def opa(opa_url: str, tmp_path: Path) -> AsyncIterator[tuple[OpaEngine, Path]]:
    policies = copy_policies(tmp_path)
    engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=opa_url, opa_timeout_s=5))
    yield engine, policies
    await engine.aclose()


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


async def test_a_policy_opa_refuses_keeps_the_old_one_in_force(opa: tuple[OpaEngine, Path]) -> None:
    engine, policies = opa
    before = await engine.decide(make_input([], "high"))
    assert before.outcome is Outcome.REQUIRE_APPROVAL
    (policies / "stockade" / "broken.rego").write_text("package stockade\nthis is not rego\n")
    with pytest.raises(PolicyBundleError, match="refused"):
        await engine.reload()
    assert await engine.decide(make_input([], "high")) == before


async def test_an_evaluation_error_on_opa_denies_with_policy_error(opa: tuple[OpaEngine, Path]) -> None:
    """A rule that errors at evaluation (here a conflict between two complete rules) makes OPA answer
    with an error; the engine denies, it does not read the missing value as "no reason"."""
    engine, policies = opa
    (policies / "stockade" / "team.rego").write_text(
        "package stockade\n\nteam_limit := 1 if input.args.x\n\nteam_limit := 2 if input.args.x\n\n"
        'deny_reasons contains {"code": "team.limit", "message": "limit"} if team_limit > 1\n'
    )
    await engine.reload()
    decision = await engine.decide(make_input())
    assert (decision.outcome, decision.reason_codes) == (Outcome.DENY, ["policy.error"])

"""The OPA server engine: fails closed without a server; with one (STOCKADE_TEST_OPA_URL), decides
exactly as the embedded engine, the reference."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

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
def stand_in_opa(tmp_path: Path) -> Iterator[tuple[str, list[str], list[Any]]]:
    """An HTTP server speaking the part of OPA's REST API the engine uses (no OPA binary installs
    here): it records each request, accepts uploads, and answers decisions with what the embedded
    engine decides for the input it was sent."""
    policies = copy_policies(tmp_path)
    requests: list[str] = []
    answers: list[Any] = []
    reference: list[EmbeddedEngine] = []  # made on the server's thread: regorus objects stay on theirs

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _reply(self, body: Any, status: int = 200) -> None:
            data = b"" if status == 204 else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            requests.append(f"PUT {self.path}")
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            # As OPA answers: a policy upload 200 with {}, a data document 204.
            self._reply({}, 204 if self.path.startswith("/v1/data/") else 200)

        def do_POST(self) -> None:
            requests.append(f"POST {self.path}")
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if not reference:
                reference.append(EmbeddedEngine(PolicySettings(dir=policies)))
            decision = json.loads(reference[0].evaluate_raw(PolicyInput.model_validate(body["input"])) or "null")
            answers.append(decision)
            self._reply({"result": decision})

    server = HTTPServer(("127.0.0.1", 0), Handler)  # one thread: requests are answered in turn

    def serve() -> None:
        server.serve_forever()
        for engine in reference:  # dropped on the thread that made it
            asyncio.run(engine.aclose())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests, answers
    finally:
        server.shutdown()
        thread.join(10)
        server.server_close()


@pytest.mark.parametrize("upload", [True, False])
async def test_the_engine_uploads_the_policy_unless_the_server_loads_it_itself(
    stand_in_opa: tuple[str, list[str], list[Any]], tmp_path: Path, upload: bool
) -> None:
    url, requests, answers = stand_in_opa
    policies = copy_policies(tmp_path / "router")
    engine = OpaEngine(PolicySettings(engine="opa", dir=policies, opa_url=url, opa_timeout_s=5, opa_upload=upload))
    reference = EmbeddedEngine(PolicySettings(dir=policies))
    try:
        for policy_input in PARITY_INPUTS[:3]:
            assert await engine.decide(policy_input) == await reference.decide(policy_input)
        (policies / "stockade" / "extra.rego").write_text("package stockade.extra\n\nanswer := 42\n")
        assert await engine.reload() != reference.revision
        await engine.decide(make_input())
    finally:
        await engine.aclose()
        await reference.aclose()
    assert len(answers) == 4
    decisions = [r for r in requests if r.startswith("POST")]
    assert decisions == ["POST /v1/data/stockade/decision"] * 4
    uploads = [r for r in requests if r.startswith("PUT")]
    if upload:  # before the first decision and on the reload
        assert "PUT /v1/policies/stockade/stockade/decision" in uploads
        assert "PUT /v1/policies/stockade/stockade/extra" in uploads
        assert requests.index("PUT /v1/policies/stockade/stockade/decision") < requests.index(decisions[0])
    else:
        assert uploads == []


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

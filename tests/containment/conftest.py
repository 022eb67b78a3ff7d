"""Fixtures for the containment suite: each sandbox tier, a local HTTPS upstream with its own CA,
and host-side canaries a contained tool must never see."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner import (
    ContainerSandbox,
    EgressRecord,
    ResourceLimits,
    RunnerSettings,
    RunResult,
    Sandbox,
    SandboxSpec,
    make_sandbox,
)
from runner.base import EgressRule, InputFile
from tests.conftest import ALLOWED_HOST, Upstream

TIERS = ["bwrap", "docker", "gvisor"]


@dataclass
class Canaries:
    """Things on the host a contained tool must not reach."""

    secret_file: Path
    secret_value: str
    state_dir: Path


@pytest.fixture
def settings(runner_state: Path) -> RunnerSettings:
    return RunnerSettings(state_dir=runner_state, pool_size=0, egress_hosts={ALLOWED_HOST: "127.0.0.1"})


@pytest.fixture
def canaries(settings: RunnerSettings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Canaries:
    value = "canary-" + os.urandom(8).hex()
    secret = settings.state_dir / "router-secret.key"
    secret.write_text(value)
    monkeypatch.setenv("STOCKADE_TEST_SECRET", value)  # the router's own environment
    return Canaries(secret, value, settings.state_dir)


@pytest.fixture(params=TIERS)
async def sandbox(request: pytest.FixtureRequest, settings: RunnerSettings) -> AsyncIterator[Sandbox]:
    box = make_sandbox(settings, request.param)
    problem = box.check()
    assert problem is None, f"{request.param} must work in the test environment: {problem}"
    yield box
    await box.aclose()


@pytest.fixture(params=["docker", "gvisor"])
async def container(request: pytest.FixtureRequest, settings: RunnerSettings) -> AsyncIterator[ContainerSandbox]:
    """A container tier's sandbox, each tier in turn (the container-only attacks)."""
    box = ContainerSandbox(settings, request.param)
    assert box.check() is None
    yield box
    await box.aclose()


class Runner:
    """Runs python programs in the sandbox under test."""

    def __init__(self, sandbox: Sandbox, upstream: Upstream) -> None:
        self.sandbox = sandbox
        self.upstream = upstream
        self.egress: list[EgressRecord] = []

    async def py(self, code: str, *, egress: bool = False, **spec: object) -> RunResult:
        limits = spec.pop("limits", ResourceLimits(timeout_s=20))
        inputs = tuple(spec.pop("inputs", ())) + ((InputFile("ca.pem", self.upstream.ca_pem),) if egress else ())  # type: ignore[arg-type]

        async def record(item: EgressRecord) -> None:
            self.egress.append(item)

        job = SandboxSpec(
            argv=("python3", "-I", "-c", code), limits=limits, inputs=inputs,  # type: ignore[arg-type]
            egress=(EgressRule(ALLOWED_HOST, self.upstream.port),) if egress else (),
            on_egress=record, **spec,  # type: ignore[arg-type]
        )  # fmt: skip
        return await self.sandbox.run(job)


@pytest.fixture
def run(sandbox: Sandbox, upstream: Upstream) -> Runner:
    return Runner(sandbox, upstream)

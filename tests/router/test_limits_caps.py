"""Every run is capped: by policy's limits obligation, and never by a value only the tool asked for."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from policy import PolicySettings
from router import ControlPlane, InvalidToolSpec, Settings, ToolSpec
from router.audit import AuditFilter
from runner import BwrapSandbox, RunResult, SandboxSpec
from tests.conftest import ECHO, copy_policies, edit_catalog, python_tool

HUNGRY = {"limits": {"cpus": 64, "memory_mb": 65_536}}  # far over the shipped maxima (2 CPUs, 1024 MB)


class RecordingSandbox(BwrapSandbox):
    """The real bwrap tier, keeping every spec it is asked to run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.specs: list[SandboxSpec] = []

    async def run(self, spec: SandboxSpec) -> RunResult:
        self.specs.append(spec)
        return await super().run(spec)


async def _plane(settings: Settings, policies: Path) -> tuple[ControlPlane, RecordingSandbox]:
    edited = settings.model_copy(update={"policy": PolicySettings(dir=policies)})
    base = ControlPlane.from_settings(edited)
    sandbox = RecordingSandbox(edited.runner)
    plane = ControlPlane(edited, policy=base.policy, sandboxes={**base.sandboxes, "bwrap": sandbox}, audit=base.audit)
    return plane, sandbox


@pytest.fixture
async def without_defaults(tmp_path: Path, settings: Settings) -> AsyncIterator[tuple[ControlPlane, RecordingSandbox]]:
    """The shipped policies with catalog.limits.default lacking cpus and memory_mb (its schema
    allows that); limits.max is the shipped one."""
    root = copy_policies(tmp_path)
    limits = json.loads((root / "stockade" / "data.json").read_text())["catalog"]["limits"]
    del limits["default"]["cpus"], limits["default"]["memory_mb"]
    edit_catalog(root, limits=limits)
    plane, sandbox = await _plane(settings, root)
    yield plane, sandbox
    await plane.aclose()


async def test_limit_without_a_catalog_default_is_capped_by_its_maximum(
    without_defaults: tuple[ControlPlane, RecordingSandbox],
) -> None:
    plane, sandbox = without_defaults
    await plane.register(python_tool("hungry", ECHO, sandbox=HUNGRY))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "hungry", {})
    assert result.ok, result.reasons
    [spec] = sandbox.specs
    assert (spec.limits.cpus, spec.limits.memory_mb) == (2, 1024)


# A policy that allows everything and says nothing about limits.
SILENT = 'package stockade\n\ndefault decision := {"outcome": "allow"}\n'


@pytest.fixture
async def silent(tmp_path: Path, settings: Settings) -> AsyncIterator[tuple[ControlPlane, RecordingSandbox]]:
    root = tmp_path / "silent"
    (root / "stockade").mkdir(parents=True)
    (root / "stockade" / "decision.rego").write_text(SILENT)
    plane, sandbox = await _plane(settings, root)
    yield plane, sandbox
    await plane.aclose()


async def test_tool_asking_above_the_default_is_refused_when_policy_grants_no_limit(
    silent: tuple[ControlPlane, RecordingSandbox],
) -> None:
    plane, sandbox = silent
    await plane.register(python_tool("hungry", ECHO, sandbox=HUNGRY))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "hungry", {})
    assert (result.status, result.reasons) == ("denied", ["policy.error"])
    assert sandbox.specs == []
    trail = await plane.audit.query(AuditFilter(decision_id=result.decision_id))
    assert trail[-1].result is not None
    # the allow on record is closed as refused
    assert (trail[-1].result["code"], trail[-1].result["verdict"]) == ("policy.error", "refused")


async def test_tool_within_the_default_runs_when_policy_grants_no_limit(
    silent: tuple[ControlPlane, RecordingSandbox],
) -> None:
    plane, sandbox = silent
    await plane.register(python_tool("plain", ECHO, sandbox={"limits": {"timeout_s": 5}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    assert (await plane.call(session, "plain", {"a": 1})).ok
    [spec] = sandbox.specs
    assert (spec.limits.timeout_s, spec.limits.cpus, spec.limits.memory_mb) == (5, 1, 256)


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ('{"cpus": Infinity}', "cpus"),
        ('{"cpus": NaN}', "cpus"),
        ('{"timeout_s": Infinity}', "timeout_s"),
        ('{"cpus": 1e9}', "cpus"),
        ('{"memory_mb": 1e300}', "memory_mb"),
        ('{"output_bytes": 1e18}', "output_bytes"),
    ],
)
async def test_infinite_or_huge_tool_limits_are_refused_at_registration(
    plane: ControlPlane, limits: str, field: str
) -> None:
    spec = json.dumps(python_tool("t", ECHO))[:-1] + f', "sandbox": {{"limits": {limits}}}}}'
    with pytest.raises(InvalidToolSpec, match=field):
        await plane.register(json.loads(spec))
    with pytest.raises(ValueError, match=f"limits.{field}"):
        ToolSpec.model_validate_json(spec)

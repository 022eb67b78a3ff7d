"""What the agent gets back. Only outcomes, reason codes and ids: policy messages and
obligations go to the audit log, never to the agent."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CallStatus = Literal["completed", "denied", "pending_approval", "awaiting_report", "error"]


class DecisionResult(BaseModel):
    """The answer of `ControlPlane.decide`: what would happen, without running anything."""

    # defer_build: built on first use, not at import (as router.wire's models; see _Frozen there).
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    decision_id: str
    outcome: Literal["allow", "deny", "require_approval"]
    reasons: list[str] = Field(default_factory=list)


class RunUsage(BaseModel):
    """What a sandboxed run consumed."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    wall_ms: float
    cpu_ms: float
    max_rss_kb: int


class Artifact(BaseModel):
    """A file the tool wrote under ``/out``, copied into the call's quarantine. Untrusted content."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    path: str
    size: int
    sha256: str
    untrusted: bool = True


class ToolResult(BaseModel):
    """The answer of `ControlPlane.call`.

    ``status``: ``completed`` (it ran; see ``verdict``), ``denied`` (policy, or a failure that
    fails closed; see ``reasons``), ``pending_approval`` (a human must approve), ``awaiting_report``
    (an external tool the framework must now run and `report`), ``error`` (the sandbox failed).
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    status: CallStatus
    decision_id: str
    call_id: str
    tool: str
    reasons: list[str] = Field(default_factory=list)
    verdict: str | None = None
    exit_code: int | None = None
    output: Any = None
    stdout: str = ""
    stderr: str = ""
    usage: RunUsage | None = None
    tier: str | None = None
    start: str | None = None
    approval_id: str | None = None
    artifacts: list[Artifact] = Field(default_factory=list)
    quarantine: str | None = None

    @property
    def ok(self) -> bool:
        """True when the tool ran and finished successfully."""
        return self.status == "completed" and self.verdict == "ok"

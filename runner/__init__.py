"""Execute tool calls in sandboxes.

``runner`` runs a `SandboxSpec` in an isolation tier and reports a `RunResult`. Tiers sit
behind the `Sandbox` Protocol; `make_sandbox` picks one from settings. It imports nothing
else of stockade.
"""

from runner.base import ResourceLimits, RunResult, Sandbox, SandboxSpec, Usage, Verdict
from runner.bwrap import BwrapSandbox
from runner.config import RunnerSettings
from runner.errors import SandboxError, SandboxUnavailable
from runner.python import parse_result, python_job


def make_sandbox(settings: RunnerSettings) -> Sandbox:
    """The sandbox for ``settings.tier``.

    Raises:
        SandboxUnavailable: the tier is not known here.
    """
    if settings.tier == "bwrap":
        return BwrapSandbox(settings)
    raise SandboxUnavailable(f"unknown sandbox tier {settings.tier!r}; this build has: bwrap")


__all__ = [
    "BwrapSandbox",
    "ResourceLimits",
    "RunResult",
    "RunnerSettings",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "SandboxUnavailable",
    "Usage",
    "Verdict",
    "make_sandbox",
    "parse_result",
    "python_job",
]

"""Execute tool calls in sandboxes.

``runner`` runs a `SandboxSpec` in an isolation tier and reports a `RunResult`. Tiers sit
behind the `Sandbox` Protocol; `make_sandbox` picks one from settings. It imports nothing
else of stockade. The tiers themselves (and docker's client) load on first use, so what only needs
the package's types (the audit log's readers, the SDK) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from runner.base import (
    EgressRecord,
    EgressRule,
    FileRecord,
    Injection,
    InputFile,
    OutputCaps,
    ResourceLimits,
    RunResult,
    Sandbox,
    SandboxSpec,
    Usage,
    Verdict,
)
from runner.errors import SandboxError, SandboxUnavailable

if TYPE_CHECKING:
    from runner.bwrap import BwrapSandbox
    from runner.config import RunnerSettings
    from runner.container import ContainerSandbox
    from runner.python import parse_result, python_job


_LAZY = {
    "BwrapSandbox": "runner.bwrap",
    "ContainerSandbox": "runner.container",
    "RunnerSettings": "runner.config",
    "parse_result": "runner.python",
    "python_job": "runner.python",
}


def __getattr__(name: str) -> Any:
    """The tiers, the settings and the python job helpers, imported when first asked for
    (PEP 562): the settings bring pydantic-settings, the tiers docker's client."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


TIERS = ("bwrap", "docker", "gvisor")  # weakest to strongest boundary


def tier_rank(tier: str) -> int:
    """Position of ``tier`` from weakest (0); unknown tiers rank above every known one."""
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


def make_sandbox(settings: RunnerSettings, tier: str | None = None) -> Sandbox:
    """The sandbox for ``tier`` (default: ``settings.tier``).

    Raises:
        SandboxUnavailable: the tier is not known here.
    """
    tier = tier or settings.tier
    if tier == "bwrap":
        from runner.bwrap import BwrapSandbox  # noqa: PLC0415  (see the module docstring)

        return BwrapSandbox(settings)
    if tier in ("docker", "gvisor"):
        from runner.container import ContainerSandbox  # noqa: PLC0415

        return ContainerSandbox(settings, "gvisor" if tier == "gvisor" else "docker")
    raise SandboxUnavailable(f"unknown sandbox tier {tier!r}; known: {', '.join(TIERS)}")


def make_sandboxes(settings: RunnerSettings) -> dict[str, Sandbox]:
    """One sandbox per tier in ``settings.tiers``; whether each works here is its ``check()``."""
    return {tier: make_sandbox(settings, tier) for tier in settings.tiers}


__all__ = [
    "TIERS",
    "BwrapSandbox",
    "ContainerSandbox",
    "EgressRecord",
    "EgressRule",
    "FileRecord",
    "Injection",
    "InputFile",
    "OutputCaps",
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
    "make_sandboxes",
    "parse_result",
    "python_job",
    "tier_rank",
]

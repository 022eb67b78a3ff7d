"""stockade's router: composes policy, runner, audit and sessions into the tool-call pipeline.

The names below are imported on first use (PEP 562), so importing a light part of the package
(the SDK, `router.client`) does not load the server (the policy engine, the sandboxes, the store).
Importing the control plane gives logging sane defaults if the application has not configured
structlog (`router.logging.configure_default_logging`); the SDK does not log, and does not load
structlog.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.control import VERSION, ControlPlane
    from router.errors import (
        ApprovalError,
        AuditError,
        DuplicateTool,
        InvalidCall,
        InvalidToolSpec,
        PolicyError,
        PolicyUnavailable,
        SandboxError,
        SandboxUnavailable,
        SessionNotFound,
        StockadeError,
        ToolNotFound,
    )
    from router.results import DecisionResult, ToolResult
    from router.settings import Settings
    from router.wire import Approval, ApprovalStatus, ToolSpec

__all__ = [
    "VERSION",
    "Approval",
    "ApprovalError",
    "ApprovalStatus",
    "AuditError",
    "ControlPlane",
    "DecisionResult",
    "DuplicateTool",
    "InvalidCall",
    "InvalidToolSpec",
    "PolicyError",
    "PolicyUnavailable",
    "SandboxError",
    "SandboxUnavailable",
    "SessionNotFound",
    "Settings",
    "StockadeError",
    "ToolNotFound",
    "ToolResult",
    "ToolSpec",
]

# Where each name of __all__ is defined.
_HOME = {
    "VERSION": "router.control",
    "Approval": "router.wire",
    "ApprovalError": "router.errors",
    "ApprovalStatus": "router.wire",
    "AuditError": "router.errors",
    "ControlPlane": "router.control",
    "DecisionResult": "router.results",
    "DuplicateTool": "router.errors",
    "InvalidCall": "router.errors",
    "InvalidToolSpec": "router.errors",
    "PolicyError": "router.errors",
    "PolicyUnavailable": "router.errors",
    "SandboxError": "router.errors",
    "SandboxUnavailable": "router.errors",
    "SessionNotFound": "router.errors",
    "Settings": "router.settings",
    "StockadeError": "router.errors",
    "ToolNotFound": "router.errors",
    "ToolResult": "router.results",
    "ToolSpec": "router.wire",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # so `from router import metrics` goes on to import the submodule
        raise AttributeError(f"module 'router' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

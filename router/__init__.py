"""stockade's router: composes policy, runner, audit and sessions into the tool-call pipeline."""

from router.approvals import Approval, ApprovalError, ApprovalStatus
from router.control import VERSION, ControlPlane
from router.errors import (
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
from router.tools import ToolSpec

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

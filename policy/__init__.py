"""Decide tool calls with Rego.

``policy`` loads the Rego in ``policies/``, evaluates ``data.stockade.decision`` for a
:class:`PolicyInput` and returns a :class:`Decision`. It imports nothing else of stockade.
"""

from __future__ import annotations

import os

# Must be set before regorus loads: otherwise every engine error carries a long Rust
# backtrace and costs time (the variable is read once and cached).
os.environ.setdefault("RUST_BACKTRACE", "0")

import importlib
from typing import TYPE_CHECKING, Any

from policy.config import PolicySettings

if TYPE_CHECKING:
    from policy.base import (
        CredentialGrant,
        Decision,
        EgressRule,
        Limits,
        Obligations,
        Outcome,
        PolicyEngine,
        PolicyInput,
        Reason,
        SessionInfo,
        SubjectInfo,
        ToolInfo,
        ValueSources,
        deny,
    )
    from policy.bundle import PolicyBundle, build_bundle, load_bundle, load_bundle_archive
    from policy.embedded import EmbeddedEngine
    from policy.errors import PolicyBundleError, PolicyError
    from policy.status import LoadStatus, ReportsLoadStatus
    from policy.testing import RegoTestResult, run_rego_tests

# Where each name is defined: imported on first use (PEP 562), so what needs only the settings
# (router.settings, so every CLI command) does not load regorus, the bundle's crypto or the tests.
_HOME = {
    **dict.fromkeys(("CredentialGrant", "Decision", "EgressRule", "Limits", "Obligations", "Outcome", "PolicyEngine",
                     "PolicyInput", "Reason", "SessionInfo", "SubjectInfo", "ToolInfo", "ValueSources", "deny"),
                    "policy.base"),
    **dict.fromkeys(("PolicyBundle", "build_bundle", "load_bundle", "load_bundle_archive"), "policy.bundle"),
    "EmbeddedEngine": "policy.embedded",
    "PolicyBundleError": "policy.errors",
    "PolicyError": "policy.errors",
    "LoadStatus": "policy.status",
    "ReportsLoadStatus": "policy.status",
    "RegoTestResult": "policy.testing",
    "run_rego_tests": "policy.testing",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # so `from policy import check` goes on to import the submodule
        raise AttributeError(f"module 'policy' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def make_engine(settings: PolicySettings) -> PolicyEngine:
    """The engine ``settings.engine`` names, loaded from ``settings.dir`` (a directory or a bundle file).

    Raises:
        PolicyBundleError: the directory does not load (or, embedded, does not compile).
    """
    if settings.engine == "opa":
        from policy.opa import OpaEngine  # noqa: PLC0415  (aiohttp is slow to import; only OPA users pay)

        return OpaEngine(settings)
    from policy.embedded import EmbeddedEngine  # noqa: PLC0415

    return EmbeddedEngine(settings)


__all__ = [
    "CredentialGrant",
    "Decision",
    "EgressRule",
    "EmbeddedEngine",
    "Limits",
    "LoadStatus",
    "Obligations",
    "Outcome",
    "PolicyBundle",
    "PolicyBundleError",
    "PolicyEngine",
    "PolicyError",
    "PolicyInput",
    "PolicySettings",
    "Reason",
    "RegoTestResult",
    "ReportsLoadStatus",
    "SessionInfo",
    "SubjectInfo",
    "ToolInfo",
    "ValueSources",
    "build_bundle",
    "deny",
    "load_bundle",
    "load_bundle_archive",
    "make_engine",
    "run_rego_tests",
]

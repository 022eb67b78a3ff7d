"""Decide tool calls with Rego.

``policy`` loads the Rego in ``policies/``, evaluates ``data.stockade.decision`` for a
:class:`PolicyInput` and returns a :class:`Decision`. It imports nothing else of stockade.
"""

import os

# Must be set before regorus loads: otherwise every engine error carries a long Rust
# backtrace and costs time (the variable is read once and cached).
os.environ.setdefault("RUST_BACKTRACE", "0")

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
from policy.config import PolicySettings
from policy.embedded import EmbeddedEngine
from policy.errors import PolicyBundleError, PolicyError
from policy.status import LoadStatus, ReportsLoadStatus
from policy.testing import RegoTestResult, run_rego_tests


def make_engine(settings: PolicySettings) -> PolicyEngine:
    """The engine ``settings.engine`` names, loaded from ``settings.dir`` (a directory or a bundle file).

    Raises:
        PolicyBundleError: the directory does not load (or, embedded, does not compile).
    """
    if settings.engine == "opa":
        from policy.opa import OpaEngine  # noqa: PLC0415  (aiohttp is slow to import; only OPA users pay)

        return OpaEngine(settings)
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

"""The exceptions a stockade user sees.

    StockadeError
     ├── InvalidCall              arguments, payload or tool name are wrong; nothing ran
     ├── ToolNotFound             no tool of that name is registered
     ├── InvalidToolSpec          a registration is malformed
     │    ├── ToolRefused         policy would refuse every call to the tool
     │    └── DuplicateTool       a tool of that name is already registered
     ├── SessionNotFound          no open session with that id
     ├── ApprovalError            an approval cannot be used or decided
     ├── CredentialError          a credential cannot be granted or minted; the call is denied
     │    ├── UnknownCredential   policy granted one the operator did not configure
     │    ├── ScopeDenied         ... or a scope the operator's configuration does not allow
     │    └── CredentialUnavailable  configured, but it cannot be issued
     ├── PolicyError              the policy cannot be loaded
     │    └── PolicyUnavailable   no policy is in force
     ├── SandboxError             the sandbox itself failed
     │    └── SandboxUnavailable  the tier cannot run on this host
     ├── StoreError               the shared state (sessions, approvals, rates) cannot be reached
     └── AuditError               the audit log cannot be written or read

Each message names the thing that is wrong and what to do about it; ``code`` is its stable name
(the reason code, the problem type over HTTP) and ``http_status`` its status over HTTP. Exceptions from the
``policy`` and ``runner`` packages and from libraries are translated into these at the seam. The SDK
(`router.client`) raises these from the API's problem documents, plus its own three (`router.client.errors`).

This module imports the standard library only: the SDK imports it without the server.
"""

from __future__ import annotations

import dataclasses


class StockadeError(Exception):
    """Base class of every error stockade raises to its users."""

    code = "stockade.error"
    http_status = 500


@dataclasses.dataclass(frozen=True, slots=True)
class FieldProblem:
    """One thing wrong with a call: where (``args.to``), and what. ``path``: for a problem whose
    text may quote the value it is about (a schema error's), where that value is in the arguments,
    step by step (``("a.b", 0)``; ``()``: the arguments as a whole), which ``field`` cannot say
    unambiguously (``args.a.b`` is the argument ``a.b`` or ``b`` inside ``a``). An audit mask on
    an argument erases such a problem (`router.audit.masking`); it is not sent to clients."""

    field: str
    problem: str
    path: tuple[str | int, ...] | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}"


class InvalidCall(StockadeError):
    """The call is malformed; the message names each bad field and how to fix it. Nothing ran."""

    code = "call.invalid"
    http_status = 422

    def __init__(self, message: str, problems: list[FieldProblem] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []


class ToolNotFound(StockadeError):
    """No tool of that name is registered."""

    code = "tool.not_found"
    http_status = 404


class InvalidToolSpec(StockadeError):
    """A tool registration is malformed."""

    code = "tool.invalid_spec"
    http_status = 422


class ToolRefused(InvalidToolSpec):
    """Policy would refuse every call to this tool (its capabilities, risk, egress or credentials),
    so it is not registered; ``reasons`` are the policy's reason codes."""

    code = "tool.refused_by_policy"
    http_status = 422

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message)
        self.reasons = reasons


class DuplicateTool(InvalidToolSpec):
    """A tool of that name is already registered."""

    code = "tool.duplicate"
    http_status = 409


class SessionNotFound(StockadeError):
    """No open session with that id."""

    code = "session.not_found"
    http_status = 404


class ApprovalError(StockadeError):
    """The approval cannot be used or decided: unknown, expired, used, mismatched or self-approved."""

    code = "approval.invalid"
    http_status = 409


class PolicyError(StockadeError):
    """The policy cannot be loaded or compiled; the old policy, if any, stays in force."""

    code = "policy.error"
    http_status = 503


class PolicyUnavailable(PolicyError):
    """No policy is in force, so nothing can be decided."""

    code = "policy.unavailable"


class SandboxError(StockadeError):
    """The sandbox itself failed (not the tool)."""

    code = "sandbox.error"
    http_status = 503


class SandboxUnavailable(SandboxError):
    """The sandbox tier cannot run on this host."""

    code = "sandbox.unavailable"


class CredentialError(StockadeError):
    """A credential cannot be granted or minted; the call is denied."""

    code = "credential.error"
    http_status = 403


class UnknownCredential(CredentialError):
    """Policy granted a credential the operator did not configure."""

    code = "credential.unknown"


class ScopeDenied(CredentialError):
    """Policy granted a scope the operator's configuration does not allow for that credential."""

    code = "credential.scope_denied"


class CredentialUnavailable(CredentialError):
    """The credential is configured but cannot be issued (its secret is missing, or the tool runs
    outside the sandbox, where nothing can inject it)."""

    code = "credential.unavailable"


class StoreError(StockadeError):
    """The store holding sessions, provenance, approvals and rate windows failed; calls are denied
    until it answers again."""

    code = "store.unavailable"
    http_status = 503


class AuditError(StockadeError):
    """The audit log cannot be written or read; calls are denied until it can."""

    code = "audit.unavailable"
    http_status = 503

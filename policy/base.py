"""The policy seam: what Rego sees (`PolicyInput`), what it answers (`Decision`), and the
`PolicyEngine` Protocol every backend implements."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol, runtime_checkable

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    StringConstraints,
    ValidationError,
)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SubjectInfo(_Frozen):
    """Who is calling: the agent and the human principal it acts for."""

    agent: str
    principal: str
    # From the principal's configuration: what rules about teams and roles look at.
    groups: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)


class SessionInfo(_Frozen):
    """The session's state as far as policy is concerned."""

    id: str
    taint: list[str] = Field(default_factory=list)
    call_count: int = 0
    trusted_context: list[str] = Field(default_factory=list)
    # Sources (``untrusted:<tool>:<call_id>``, ...) a human endorsed for this session: their values
    # may be used as destinations, amounts and sensitive values (see docs/policy.md).
    endorsed: list[str] = Field(default_factory=list)
    # Set by earlier decisions' ``session_labels`` obligation ("read_customer_records"): the
    # session's history as policy wrote it.
    labels: list[str] = Field(default_factory=list)


RATE_SCOPES = ("session", "agent", "principal", "tool", "agent_tool")
"""What a rate window counts calls of: this session, this agent, this principal (the human the
agent acts for), this tool (every agent's calls to it), this agent's calls to this tool."""

RATE_PERIODS = ("minute", "hour", "day")
"""How far back a rate window looks."""

RATE_WINDOWS = tuple(f"{scope}_per_{period}" for scope in RATE_SCOPES for period in RATE_PERIODS)
"""Every window's name, ``<scope>_per_<period>``: the keys of ``input.rate`` and of
``catalog.rate_limits``."""


class RateCounts(_Frozen):
    """``input.rate``: the calls in each rate window, the call being decided included (every
    window is present, 0 when nothing was counted). How exact each period is: `router.rates`."""

    session_per_minute: int = Field(default=0, ge=0)
    session_per_hour: int = Field(default=0, ge=0)
    session_per_day: int = Field(default=0, ge=0)
    agent_per_minute: int = Field(default=0, ge=0)
    agent_per_hour: int = Field(default=0, ge=0)
    agent_per_day: int = Field(default=0, ge=0)
    principal_per_minute: int = Field(default=0, ge=0)
    principal_per_hour: int = Field(default=0, ge=0)
    principal_per_day: int = Field(default=0, ge=0)
    tool_per_minute: int = Field(default=0, ge=0)
    tool_per_hour: int = Field(default=0, ge=0)
    tool_per_day: int = Field(default=0, ge=0)
    agent_tool_per_minute: int = Field(default=0, ge=0)
    agent_tool_per_hour: int = Field(default=0, ge=0)
    agent_tool_per_day: int = Field(default=0, ge=0)


class InputInfo(_Frozen):
    """A file the caller passes in (the tool reads it at ``/in/<name>``): never its bytes."""

    name: str
    sha256: str
    size: int


class EnvironmentInfo(_Frozen):
    """Where the router deciding runs: the deployment's name and this router instance."""

    name: str = "dev"
    instance: str = ""


class EgressRequest(_Frozen):
    """A destination the tool says it needs; policy grants it or not."""

    host: str
    port: int = Field(ge=1, le=65535)
    methods: list[str] = Field(default_factory=list)


class CredentialRequest(_Frozen):
    """A credential the tool says it needs, with the scopes; policy grants it or not."""

    name: str
    scopes: list[str] = Field(default_factory=list)


class ToolInfo(_Frozen):
    """The registered tool, as policy needs it."""

    name: str
    capabilities: list[str]
    risk: str
    limits: dict[str, float] = Field(default_factory=dict)
    executor: str = "command"
    tier: str = "bwrap"
    egress: list[EgressRequest] = Field(default_factory=list)
    credentials: list[CredentialRequest] = Field(default_factory=list)
    destination_args: list[str] = Field(default_factory=list)
    amount_args: list[str] = Field(default_factory=list)
    content_args: list[str] = Field(default_factory=list)
    sensitive_args: list[str] = Field(default_factory=list)


class ValueSources(_Frozen):
    """One value inside a checked argument, and every source it was seen in.

    ``path``: where it is in the arguments (``to``, ``cc[1]``, ``payee.iban``); ``key``: for a
    content argument, the identifier found in its text (``u:https://...``, ``e:bob@...``)."""

    path: str
    key: str | None = None
    sources: list[str] = Field(default_factory=list)


# The integers the embedded engine (regorus) holds exactly: those of an i64 or a u64. It reads any
# other as the nearest float, so 2**64 + 1 would pass a rule that allows only 2**64, while the tool
# runs with the number sent. OPA reads JSON numbers exactly; the one bound holds for every engine.
EXACT_INTEGERS = range(-(2**63), 2**64)


def unfaithful_value(value: Any, path: str = "args") -> tuple[str, str] | None:
    """Where JSON ``value`` holds something policy would not see as it was sent, and what (never
    quoting a value, which an audit mask may be erasing): an integer outside `EXACT_INTEGERS`, or an
    object key UTF-8 cannot hold (a lone surrogate, which the input's JSON writes as U+FFFD, so two
    such keys become one). None if nothing. Iterative; paths are spelled only for what is found."""
    if not _unfaithful_in(value):
        return None
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        problem = _unfaithful_scalar(item)
        if problem is not None:
            return where, problem
        if isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _utf8(key):
                    return (
                        f"{where}.{key!r}",
                        "a key with a lone surrogate, which is not Unicode text: send valid UTF-8",
                    )
                stack.append((child, f"{where}.{key}"))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def _unfaithful_in(value: Any) -> bool:
    """Whether `unfaithful_value` finds anything in ``value``: one walk, no paths, the common types
    tested by identity (it runs on every call's arguments, up to a megabyte of them)."""
    low, high = EXACT_INTEGERS.start, EXACT_INTEGERS.stop
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is int:
            if not low <= item < high:
                return True
        elif kind is str or kind is float or kind is bool or item is None:
            continue
        elif kind is list or kind is tuple:
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(type(key) is not str or _utf8(key) for key in item):
                return True
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif _unfaithful_scalar(item) is not None:  # an int subclass
            return True
    return False


def _unfaithful_scalar(item: Any) -> str | None:
    if isinstance(item, int) and not isinstance(item, bool) and item not in EXACT_INTEGERS:
        return "an integer beyond 64 bits, which policy cannot compare exactly: send it as a string"
    return None


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class PolicyInput(_Frozen):
    """Everything a policy may look at for one call; the ``input`` document of the Rego query."""

    subject: SubjectInfo
    session: SessionInfo
    tool: ToolInfo
    # Checked where it is decided on (`serialised_input`) and, for a call, as it arrives
    # (router.tools.parse_args): not a third walk of up to a megabyte here.
    args: dict[str, Any]
    inputs: list[InputInfo] = Field(default_factory=list)  # the files passed in, by name, sorted
    provenance: dict[str, list[str]] = Field(default_factory=dict)
    # Per value of each destination, amount, sensitive and content argument (a list's elements
    # one by one; a content argument's identifiers one by one): where each was seen.
    values: dict[str, list[ValueSources]] = Field(default_factory=dict)
    rate: RateCounts = Field(default_factory=RateCounts)
    approval: dict[str, Any] | None = None
    now: str
    environment: EnvironmentInfo = Field(default_factory=EnvironmentInfo)


def serialised_input(policy_input: PolicyInput, max_bytes: int) -> str:
    """``policy_input`` as the JSON text an engine decides on, checked again here (a model built
    with ``model_copy(update=...)`` skips validation): nothing in its arguments that the engine
    would see otherwise than sent (`unfaithful_value`), nothing JSON cannot carry, at most
    ``max_bytes``.

    Raises:
        ValueError: naming what is wrong; the engine denies with ``policy.error``.
    """
    found = unfaithful_value(policy_input.args)
    if found is not None:
        raise ValueError(f"policy input {found[0]} holds {found[1]}")
    try:
        text = policy_input.model_dump_json()
    except ValueError as exc:  # text JSON cannot carry (a lone surrogate): nothing to decide on
        raise ValueError(f"policy input cannot be serialised: {str(exc)[:200]}") from exc
    if len(text) > max_bytes:
        raise ValueError(f"policy input is {len(text)} bytes, over the cap")
    return text


class Outcome(StrEnum):
    """What policy decided for the call."""

    ALLOW = "allow"
    DENY = "deny"
    REQUIRE_APPROVAL = "require_approval"


def _json_number(value: Any) -> Any:
    """Let only a JSON number through: pydantic's lax mode would take ``"512"``, ``"inf"`` and
    ``true`` as numbers, and a decision is policy's word, not something to guess at."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"must be a JSON number, not {type(value).__name__}")
    return value


Number = Annotated[float, BeforeValidator(_json_number), Field(allow_inf_nan=False)]
"""A finite JSON number (an integer is one too)."""

Integer = Annotated[int, BeforeValidator(_json_number)]
"""A JSON integer; a float with no fraction (``512.0``, what arithmetic in Rego may give) is taken as one."""

# The most any obligation may ask for: far above what a tool needs, finite so that no value
# (1e308, a number past 64 bits) reaches the runner, the store or a credential issuer.
MAX_TIMEOUT_S = 86_400
MAX_MEMORY_MB = 1 << 20  # 1 TiB
MAX_CPUS = 1024
MAX_PIDS = 1 << 22
MAX_OUTPUT_BYTES = 1 << 40
MAX_CREDENTIAL_TTL_S = 86_400  # what `router.credentials` configures at most (max_ttl_s)

# Labels as hosts are named in practice, not only as RFC 1123 allows: "_" too (compose service
# names, SRV-style names), which the proxy compares like any other character.
_HOST_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"^{_HOST_LABEL}(\.{_HOST_LABEL})*$")
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _egress_host(host: str) -> str:
    """A host as the egress proxy compares it (lower case, no trailing dot; an IPv6 address in its
    compressed form, without brackets), if it is one DNS name or IP address: never a wildcard, an
    empty string, a ``host:port``, a URL or whitespace."""
    if ":" in host:  # only an IPv6 literal has one: a host:port is refused below
        try:
            return ipaddress.IPv6Address(host.removeprefix("[").removesuffix("]")).compressed
        except ValueError:
            pass
    normal = host.lower().removesuffix(".")
    if len(normal) > 253 or not _HOSTNAME.fullmatch(normal):
        raise ValueError(f"{host[:80]!r} is not a host name (no wildcard, port, scheme, path or whitespace)")
    return normal


def _http_method(method: str) -> str:
    normal = method.upper()
    if normal not in HTTP_METHODS:
        raise ValueError(f"{method[:20]!r} is not an HTTP method ({', '.join(sorted(HTTP_METHODS))})")
    return normal


EgressHost = Annotated[StrictStr, AfterValidator(_egress_host)]
HttpMethod = Annotated[StrictStr, AfterValidator(_http_method)]


class Reason(_Frozen):
    """A stable, documented reason code with a human message (the message is for the audit log)."""

    code: StrictStr = Field(min_length=1, max_length=128)
    message: StrictStr = ""


class Limits(_Frozen):
    """Resource limits for one run. An absent field falls back to the tool's default only up to
    the router's built-in one (`runner.ResourceLimits`); past that the call is refused."""

    timeout_s: Number | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    memory_mb: Integer | None = Field(default=None, gt=0, le=MAX_MEMORY_MB)
    cpus: Number | None = Field(default=None, gt=0, le=MAX_CPUS)
    pids: Integer | None = Field(default=None, gt=0, le=MAX_PIDS)
    output_bytes: Integer | None = Field(default=None, gt=0, le=MAX_OUTPUT_BYTES)


class EgressRule(_Frozen):
    """One host the call may reach through the egress proxy."""

    host: EgressHost
    port: Integer = Field(ge=1, le=65535)
    methods: list[HttpMethod] = Field(default_factory=list)


class CredentialGrant(_Frozen):
    """A credential policy grants to this call: the request, with its lifetime."""

    name: StrictStr = Field(min_length=1)
    scopes: list[StrictStr] = Field(default_factory=list)
    ttl_s: Integer = Field(default=60, gt=0, le=MAX_CREDENTIAL_TTL_S)


class SandboxObligation(_Frozen):
    """Constraints policy puts on where the call runs: the weakest tier allowed, and whether the
    call runs in the session's own sandbox or a fresh one (``None``: as the tool asks)."""

    min_tier: StrictStr | None = None
    mode: Literal["fresh", "session"] | None = None


MAX_SESSION_LABELS = 256
"""The most labels one session carries; a decision that would add more is a deny."""

SessionLabel = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$")]
"""A session label: 1-128 letters, digits and ``_ . : / -``, starting with a letter or digit."""


class Obligations(_Frozen):
    """What the router must enforce if it runs the call."""

    limits: Limits = Field(default_factory=Limits)
    egress: list[EgressRule] = Field(default_factory=list)
    credentials: list[CredentialGrant] = Field(default_factory=list)
    sandbox: SandboxObligation = Field(default_factory=SandboxObligation)
    # Labels the router adds to the session once this call is allowed; later decisions see
    # them in ``input.session.labels``.
    # Malformed labels, or more than 32, make the decision malformed: a deny (policy.error).
    session_labels: list[SessionLabel] = Field(default_factory=list, max_length=32)


class Decision(_Frozen):
    """The value of ``data.stockade.decision``, validated; plus the revision that produced it."""

    outcome: Outcome
    reasons: list[Reason] = Field(default_factory=list)
    obligations: Obligations = Field(default_factory=Obligations)
    policy_revision: str = ""

    @property
    def reason_codes(self) -> list[str]:
        """The codes only, each once (one reason per value may share a code): what the agent is
        allowed to see. The messages, one per value, go to the audit log."""
        return list(dict.fromkeys(r.code for r in self.reasons))


POLICY_ERROR = "policy.error"


def to_decision(value: Any, revision: str, reasons: Mapping[str, str] | None = None) -> Decision:
    """The entrypoint's JSON value (None: undefined) as a `Decision`; anything malformed is a
    deny (``policy.error``). Every engine validates through here, so they fail alike.

    Malformed: not the shape of `Decision` (strictly: a number written as a string is not a
    number), a deny or require_approval naming no reason and, given ``reasons`` (the loaded
    ``data.stockade.reasons``: code → outcome), a code not in it, or a deny or require_approval
    carrying a code the catalog gives another outcome (a deny a human could approve away).
    """
    if value is None:
        return deny(POLICY_ERROR, "data.stockade.decision is undefined for this input", revision=revision)
    if not isinstance(value, dict):
        return deny(POLICY_ERROR, f"decision is a {type(value).__name__}, not an object", revision=revision)
    if "policy_revision" in value:
        return deny(POLICY_ERROR, "malformed decision at policy_revision: the router sets it, not policy",
                    revision=revision)  # fmt: skip
    try:
        decision = Decision.model_validate({**value, "policy_revision": revision})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return deny(POLICY_ERROR, f"malformed decision at {where}: {first['msg']}", revision=revision)
    problem = _reason_problem(decision, reasons)
    if problem is not None:
        return deny(POLICY_ERROR, f"malformed decision at reasons: {problem}", revision=revision)
    return decision


def _reason_problem(decision: Decision, catalog: Mapping[str, str] | None) -> str | None:
    """What is wrong with the decision's reasons, if anything (`to_decision`)."""
    if decision.outcome is not Outcome.ALLOW and not decision.reasons:
        return f"a {decision.outcome.value} decision names no reason: give one from data.stockade.reasons"
    if catalog is None:
        return None
    for code in decision.reason_codes:
        outcome = catalog.get(code)
        if outcome is None:
            return f"code {code[:128]!r} is not in data.stockade.reasons: catalogue it, or give a catalogued code"
        if decision.outcome is not Outcome.ALLOW and outcome != decision.outcome.value:
            return (
                f"code {code!r} is catalogued as {outcome}, given in a {decision.outcome.value} decision: "
                "give it where the catalog says, or catalogue another code"
            )
    return None


def deny(code: str, message: str, *, revision: str = "") -> Decision:
    """A deny decision with one reason; used wherever the engine fails closed."""
    return Decision(outcome=Outcome.DENY, reasons=[Reason(code=code, message=message)], policy_revision=revision)


@runtime_checkable
class PolicyEngine(Protocol):
    """**Protocol**: decides calls. ``decide`` never raises: any failure is a deny (``policy.error``)."""

    @property
    def revision(self) -> str:
        """sha256 over the loaded policy files and data."""
        ...

    async def decide(self, policy_input: PolicyInput) -> Decision:
        """Evaluate the entrypoint for ``policy_input``."""
        ...

    async def reload(self, approve: Callable[[str], Awaitable[None]] | None = None) -> str:
        """Load the policy directory again; keep the old policy on any error. Returns the revision.
        ``approve(revision)`` is awaited once the new policy has loaded, before it takes effect (the
        router audits the reload there): if it raises, the old policy stays and the error propagates."""
        ...

    async def aclose(self) -> None:
        """Release the engine."""
        ...

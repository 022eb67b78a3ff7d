"""The runner seam: what to run (`SandboxSpec`), how it ended (`RunResult`), and the
`Sandbox` Protocol each isolation tier implements."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol, runtime_checkable


class Verdict(StrEnum):
    """How a run ended. Only ``ok`` means the tool finished and exited 0."""

    OK = "ok"
    NONZERO_EXIT = "nonzero_exit"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ResourceLimits:
    """Limits for one run. ``cpus`` bounds CPU seconds to ``timeout_s * cpus`` on tiers without cgroups."""

    timeout_s: float = 10.0
    memory_mb: int = 256
    cpus: float = 1.0
    pids: int = 64
    output_bytes: int = 1 << 20

    @property
    def cpu_seconds(self) -> int:
        return max(1, int(self.timeout_s * self.cpus + 0.999))


@dataclass(frozen=True, slots=True)
class InputFile:
    """A file the caller passes in; the tool sees it read-only at ``/in/<name>``."""

    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class OutputCaps:
    """What may come back from ``/out``: at most this many regular files and bytes in total."""

    max_files: int = 64
    max_bytes: int = 16 << 20


@dataclass(frozen=True, slots=True)
class EgressRule:
    """One destination the call may reach through the egress proxy. No methods: any method."""

    host: str
    port: int
    methods: tuple[str, ...] = ()


_TLS_PORT = 443  # where a credential host named without a port is reached over TLS
_PLAIN_PORT = 80  # and over plain HTTP, where its credential allows that


@dataclass(frozen=True, slots=True)
class Injection:
    """A credential the egress proxy puts into requests in place of ``placeholder``: in request
    headers only, only to ``hosts``, and only until ``expires_at``. The sandbox never holds ``value``.

    Each of ``hosts`` is ``host`` or ``host:port`` (an IPv6 literal in brackets when it has a port).
    The value goes only over TLS the proxy verified itself (an intercepted CONNECT): to port 443, or
    to the port an entry names. ``allow_plaintext`` also lets it go over plain ``http://``, which
    anyone on the path can read: to port 80, or the port an entry names, and never to 443 (a port
    for TLS: plain text there is a client tricked into downgrading). ``expires_at`` is wall-clock
    epoch seconds (the lease's end); past it the proxy refuses requests that carry the placeholder.
    ``None``: no end, for callers that bound the credential's life themselves.
    """

    label: str
    placeholder: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]
    allow_plaintext: bool = False
    expires_at: float | None = None

    def applies_to(self, host: str, port: int, *, tls: bool) -> bool:
        """Whether the value may go to ``host:port`` (``host`` lower-case, no trailing dot), over
        verified TLS (``tls``) or plain HTTP."""
        if not tls and (not self.allow_plaintext or port == _TLS_PORT):
            return False
        default = _TLS_PORT if tls else _PLAIN_PORT
        for entry in self.hosts:
            name, named_port = _host_and_port(entry)
            if name == host and (default if named_port is None else named_port) == port:
                return True
        return False

    def expired(self, now: float) -> bool:
        """Whether the credential's lease has ended at ``now`` (epoch seconds)."""
        return self.expires_at is not None and now >= self.expires_at


def _host_and_port(entry: str) -> tuple[str, int | None]:
    """``host`` and its port (``None`` if the entry names none; 0, which no request has, if the
    port is not a number) of an `Injection` host entry: ``name``, ``name:port``, ``[v6]``,
    ``[v6]:port``, or a bare IPv6 literal (several colons)."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        name, _, rest = entry[1:].partition("]")
        if not rest:
            return name, None
        port_text = rest[1:] if rest.startswith(":") else ""
    elif entry.count(":") == 1:
        name, _, port_text = entry.partition(":")
    else:
        return entry.rstrip("."), None
    valid = port_text.isascii() and port_text.isdigit() and len(port_text) <= 5
    return name.rstrip("."), int(port_text) if valid else 0


@dataclass(frozen=True, slots=True)
class EgressRecord:
    """One request the egress proxy saw, allowed or refused; the router audits each."""

    method: str
    host: str
    port: int
    allowed: bool
    reason: str
    status: int
    bytes_up: int = 0
    bytes_down: int = 0
    duration_ms: float = 0.0
    injected: tuple[str, ...] = ()  # labels of the credentials put into this request, never values
    intercepted: bool = False  # HTTPS terminated at the proxy (to inject or check the method), not tunnelled
    scrubbed: tuple[str, ...] = ()  # "<credential>:<encoding>" removed from the response, never values
    cut_off: bool = False  # the run ended (the proxy closed) before the exchange did: what went out is counted


EgressHook = Callable[[EgressRecord], Awaitable[None]]
JobKind = Literal["exec", "python"]


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """One job: an argv (never a shell string), bytes for stdin, extra environment and limits.

    ``kind="python"``: ``stdin`` is a python-harness job (see `runner.python`); container workers
    run it in their own interpreter, bwrap runs ``argv`` (the harness). ``session``: run in that
    session's sandbox instead of a fresh one, where the tier supports it.
    """

    argv: tuple[str, ...]
    stdin: bytes = b""
    env: dict[str, str] = field(default_factory=dict)
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    kind: JobKind = "exec"
    call_id: str = ""
    inputs: tuple[InputFile, ...] = ()
    outputs: OutputCaps | None = None
    egress: tuple[EgressRule, ...] = ()
    on_egress: EgressHook | None = None
    session: str | None = None
    injections: tuple[Injection, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """What the run consumed, as the kernel accounted it."""

    wall_s: float
    cpu_s: float
    max_rss_kb: int


@dataclass(frozen=True, slots=True)
class FileRecord:
    """A file that went in or came out, as the audit log records it."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one run. ``stdout``/``stderr`` are capped at the spec's ``output_bytes`` in total.

    ``start``: ``warm`` (a pre-started container), ``cold`` (started for this call), ``session``
    (the session's own sandbox) or ``fresh`` (bwrap starts every run). ``artifacts`` are the files
    copied out of ``/out`` into ``quarantine`` (untrusted); ``refused`` lists what was not copied.
    """

    verdict: Verdict
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    usage: Usage
    tier: str
    detail: str = ""
    start: str = "fresh"
    inputs: tuple[FileRecord, ...] = ()
    artifacts: tuple[FileRecord, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()
    quarantine: str | None = None


@runtime_checkable
class Sandbox(Protocol):
    """**Protocol**: runs one job in isolation and reports how it ended."""

    tier: str

    def check(self) -> str | None:
        """``None`` if this tier works on this host, else what is missing and how to fix it."""
        ...

    async def run(self, spec: SandboxSpec) -> RunResult:
        """Run ``spec``; limits become verdicts. Raises `SandboxError` only if the sandbox itself failed."""
        ...

    async def close_session(self, session: str) -> None:
        """Destroy the session's own sandbox, if this tier keeps one."""
        ...

    async def aclose(self) -> None:
        """Stop everything this sandbox started."""
        ...

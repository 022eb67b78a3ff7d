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


@dataclass(frozen=True, slots=True)
class Injection:
    """A credential the egress proxy puts into requests in place of ``placeholder``: in request
    headers only, only to ``hosts`` (``host`` or ``host:port``). The sandbox never holds ``value``."""

    label: str
    placeholder: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]

    def applies_to(self, host: str, port: int) -> bool:
        return any(h.lower() in (host, f"{host}:{port}") for h in self.hosts)


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

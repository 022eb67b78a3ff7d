"""The runner seam: what to run (`SandboxSpec`), how it ended (`RunResult`), and the
`Sandbox` Protocol each isolation tier implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable


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
class SandboxSpec:
    """One job: an argv (never a shell string), bytes for stdin, extra environment and limits."""

    argv: tuple[str, ...]
    stdin: bytes = b""
    env: dict[str, str] = field(default_factory=dict)
    limits: ResourceLimits = field(default_factory=ResourceLimits)


@dataclass(frozen=True, slots=True)
class Usage:
    """What the run consumed, as the kernel accounted it."""

    wall_s: float
    cpu_s: float
    max_rss_kb: int


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one run. ``stdout``/``stderr`` are capped at the spec's ``output_bytes`` in total."""

    verdict: Verdict
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    usage: Usage
    tier: str
    detail: str = ""


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

    async def aclose(self) -> None:
        """Stop everything this sandbox started."""
        ...

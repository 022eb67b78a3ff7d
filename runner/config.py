"""Settings owned by the runner package (composed into the router's settings)."""

from pydantic import BaseModel, ConfigDict, Field


class RunnerSettings(BaseModel):
    """How sandboxes are started on this host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: str = "bwrap"
    bwrap: str = "bwrap"
    # The interpreter for `python` tools, inside the sandbox. The system one: the project's own
    # may live under /root or /home, which a sandbox never sees.
    python: str = "/usr/bin/python3"
    # Each concurrent sandbox runs as its own host uid from this range, so per-uid limits
    # (RLIMIT_NPROC) are per sandbox, not shared. Only used when stockade runs as root.
    uid_base: int = Field(default=1_600_000, ge=1000)
    max_concurrent: int = Field(default=32, ge=1, le=4096)
    # Read-only binds: only system paths a tool needs. Never /root, /home, the host's /tmp.
    ro_binds: tuple[str, ...] = ("/usr", "/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
    tmpfs_mb: int = Field(default=64, gt=0)
    file_size_mb: int = Field(default=64, gt=0)
    open_files: int = Field(default=256, gt=16)

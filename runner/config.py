"""Settings owned by the runner package (composed into the router's settings)."""

import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


def _state_dir() -> Path:
    # Staging directories and quarantined outputs. Root: a system path whatever HOME says, since
    # each sandbox's own uid traverses it (a home directory is private); otherwise the user's own
    # XDG state directory, where the router keeps its audit log too.
    if os.geteuid() == 0:
        return Path("/var/lib/stockade")
    xdg = os.environ.get("XDG_STATE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local/state") / "stockade"


def _staging_dir() -> Path:
    # Container staging (bind-mount sources): a neutral path, since a tool reads them in mountinfo.
    if os.geteuid() == 0:
        return Path("/run/stockade")
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"stockade-{os.geteuid()}"


class RunnerSettings(BaseModel):
    """How sandboxes are started on this host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tier: str = "bwrap"
    # Tiers this router offers; a call needing one that is not here is denied, never downgraded.
    tiers: tuple[str, ...] = ("bwrap", "docker", "gvisor")
    state_dir: Path = Field(default_factory=_state_dir)
    docker_host: str | None = None  # None: DOCKER_HOST or the local socket
    image: str | None = None  # None: the image `stockade sandbox build-image` builds
    pool_size: int = Field(default=2, ge=0, le=64)
    gvisor_min_pids: int = Field(default=128, ge=64)  # gVisor's own threads count against the limit
    out_mb: int = Field(default=64, gt=0)
    # How long a call's quarantined outputs (``<state_dir>/quarantine/<call id>/``) are kept after
    # the call before the router removes them: a week.
    quarantine_keep_s: float = Field(default=604_800.0, gt=0)
    worker_start_timeout_s: float = Field(default=30.0, gt=0)
    # Pool refills and container removal wait until no call has run for this long.
    housekeeping_grace_s: float = Field(default=0.05, ge=0)
    # Static name -> address pins for the egress proxy (like curl --resolve), for hosts the
    # operator runs on private addresses; other names must resolve to public addresses.
    egress_hosts: dict[str, str] = Field(default_factory=dict)
    # Extra CAs (PEM) the egress proxy trusts for upstreams it terminates TLS to (to inject a
    # credential), beside the system's; e.g. an internal CA.
    egress_ca_file: Path | None = None
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
    # Container tiers: each container's staging directory (inputs, the egress socket, /etc files)
    # is made under this root; a tool sees its path in /proc/self/mountinfo, so keep it neutral.
    container_staging_dir: Path = Field(default_factory=_staging_dir)
    # Container tiers: how long one Docker request of the availability probe may take (and how
    # long check() waits for the first answer); an unavailable tier is probed again after
    # tier_recheck_min_s, the wait doubling up to tier_recheck_max_s, until it is back.
    tier_probe_timeout_s: float = Field(default=5.0, gt=0)
    tier_recheck_min_s: float = Field(default=0.5, gt=0)
    tier_recheck_max_s: float = Field(default=30.0, gt=0)
    # Files (inodes) a bwrap sandbox's /tmp may hold: its size alone does not stop a tool making
    # millions of empty files.
    tmpfs_inodes: int = Field(default=8192, ge=64)
    # Each bwrap sandbox runs in its own cgroup (memory, pids, CPU) under this one, in every
    # hierarchy used: relative paths are under stockade's own cgroup (and removed again when
    # empty), absolute ones from the hierarchy's root (e.g. a cgroup delegated to stockade).
    cgroup_parent: str = Field(default="stockade", pattern=r"^/?[\w][\w.-]*(/[\w][\w.-]*)*$")
    # False: where no cgroup is usable, run bwrap sandboxes with per-process rlimits only (one
    # tool's processes together may then use many times its memory limit). True: the tier is unavailable.
    cgroup_required: bool = True

    @property
    def quarantine_dir(self) -> Path:
        """Where calls' outputs are quarantined, a directory per call (`runner.files.Quarantine`)."""
        return self.state_dir / "quarantine"

"""Per-sandbox cgroups: memory, pids and CPU limits on all of a sandbox's processes together.

rlimits bind each process alone (eight children may each take the whole memory limit); a cgroup
binds the sandbox. Two kernel interfaces, one chosen when the tier starts:

- **v2**, the unified hierarchy: one directory per sandbox with ``memory.max``,
  ``memory.swap.max``, ``pids.max`` and ``cpu.max``; OOM kills are counted in ``memory.events``,
  and ``cgroup.kill`` ends what is left. Used when the parent can hand all three controllers down.
- **v1**: one directory per sandbox under each of the memory, pids and cpu hierarchies, with
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is accounted),
  ``pids.max`` and ``cpu.cfs_quota_us``; OOM kills are counted in ``memory.oom_control``.

Groups are made under ``parent`` in each hierarchy. A relative parent lies under stockade's own
cgroup, so the limits of whatever started stockade still bound its sandboxes, and is removed again
once no sandbox is left in it; an absolute one (a cgroup delegated to stockade) is used as it is.

A sandbox's first process writes ``0`` (itself) into each of `SandboxCgroup.join` before it execs
anything else (see `runner.bwrap`): the tool's code never runs outside its group. On v1 that file
is ``tasks``: moving only the writing thread (the whole of a single-threaded process) skips the
kernel's global threadgroup lock, whose RCU grace period costs a move through ``cgroup.procs``
5-20 ms here. v2 has no such file: there the move waits for that grace period, unless the host
mounts the hierarchy with ``favordynmods``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from runner.base import ResourceLimits
from runner.errors import SandboxError, SandboxUnavailable

log = structlog.get_logger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000
_MIN_CPU_QUOTA_US = 1_000  # the kernel's floor for a CFS quota
_REMOVE_WITHIN_S = 5.0
_GROUP_NAME = re.compile(r"(\d+)-[0-9a-f]{8}")  # the creating process's pid, then a random part


@dataclass(frozen=True, slots=True)
class CgroupOutcome:
    """What the kernel recorded about a sandbox's group: OOM kills, and its memory high-water mark."""

    oom_kills: int
    peak_bytes: int | None


class Cgroups:
    """The cgroup interface this host offers, and the parent directories sandboxes' groups go in."""

    def __init__(self, version: int, starts: tuple[Path, ...], parent: str) -> None:
        self.version = version
        # Where the parent's path begins in each hierarchy (v2: one; v1: memory, pids, cpu), and the parent.
        self._starts = starts
        self._parents = tuple(start / parent.lstrip("/") for start in starts)
        self._removable = not parent.startswith("/")

    def __repr__(self) -> str:
        return f"Cgroups(v{self.version}, {', '.join(map(str, self._parents))})"

    @classmethod
    def detect(cls, parent: str) -> Cgroups:
        """The usable interface (v2 if it offers memory, pids and cpu here, else v1), checked by
        making and removing one group.

        Raises:
            SandboxUnavailable: neither works; the message says why for each and what to do.
        """
        mounts = _mounts()
        own = _own_cgroups()
        problems = []
        for version, build in ((2, cls._v2), (1, cls._v1)):
            try:
                cgroups = build(mounts, own, parent)
                cgroups._probe()
            except (OSError, SandboxError) as exc:
                problems.append(f"v{version}: {exc}")
                continue
            return cgroups
        raise SandboxUnavailable(
            f"no cgroup can cap a sandbox's memory, pids and CPU ({'; '.join(problems)}): run stockade as root, "
            "or give it a delegated cgroup (STOCKADE_RUNNER__CGROUP_PARENT=/absolute/path)"
        )

    @classmethod
    def _v2(cls, mounts: dict[str, tuple[Path, str]], own: dict[str, str], parent: str) -> Cgroups:
        if "cgroup2" not in mounts or "" not in own:
            raise SandboxError("no cgroup2 hierarchy mounted")
        mount, root = mounts["cgroup2"]
        start = mount if parent.startswith("/") else _inside(mount, root, own[""])
        available = (start / "cgroup.controllers").read_text().split()
        missing = [c for c in CONTROLLERS if c not in available]
        if missing:
            raise SandboxError(f"controllers {', '.join(missing)} not available in {start}")
        return cls(2, (start,), parent)

    @classmethod
    def _v1(cls, mounts: dict[str, tuple[Path, str]], own: dict[str, str], parent: str) -> Cgroups:
        starts = []
        for controller in CONTROLLERS:
            if controller not in mounts or controller not in own:
                raise SandboxError(f"no {controller} hierarchy mounted")
            mount, root = mounts[controller]
            starts.append(mount if parent.startswith("/") else _inside(mount, root, own[controller]))
        return cls(1, tuple(starts), parent)

    def _probe(self) -> None:
        self._sweep()
        group = self.create(ResourceLimits())
        if not group.remove_now():
            raise SandboxError(f"a probe group could not be removed: {group}")
        self._remove_parents()

    def _sweep(self) -> None:
        """Remove empty groups a process that no longer exists left behind (it was killed)."""
        for parent in self._parents:
            with contextlib.suppress(OSError):
                for entry in os.scandir(parent):
                    owner = _GROUP_NAME.fullmatch(entry.name)
                    if owner and entry.is_dir() and not pid_alive(int(owner[1])):
                        with contextlib.suppress(OSError):  # not empty: its sandbox still runs
                            os.rmdir(entry.path)

    def _ensure_parents(self) -> None:
        for start, parent in zip(self._starts, self._parents, strict=True):
            parent.mkdir(parents=True, exist_ok=True)
            if self.version == 2:
                # Each level from where the parent's path begins down to the parent must hand the
                # controllers on to its children. (A level that has processes cannot, except the root.)
                parts = parent.relative_to(start).parts
                for level in (start / Path(*parts[:depth]) for depth in range(len(parts) + 1)):
                    if not _has_controllers(level):
                        _write(level / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))

    def _remove_parents(self) -> None:
        if not self._removable:
            return
        for start, parent in zip(self._starts, self._parents, strict=True):
            for level in (parent, *(start / up for up in parent.relative_to(start).parents[:-1])):
                try:
                    level.rmdir()
                except OSError:  # still in use by another sandbox: it stays
                    break

    def create(self, limits: ResourceLimits) -> SandboxCgroup:
        """A new, empty group with ``limits`` set.

        Raises:
            SandboxError: the group could not be made or limited (nothing is left behind).
        """
        name = f"{os.getpid()}-{os.urandom(4).hex()}"  # unique even beside groups a crashed process left
        dirs = tuple(parent / name for parent in self._parents)
        made: list[Path] = []
        try:
            for attempt in range(3):
                try:
                    for directory in dirs[len(made) :]:
                        directory.mkdir()
                        made.append(directory)
                    break
                except FileNotFoundError:
                    # The parent is gone (its last sandbox just removed it), or never existed.
                    if attempt == 2:
                        raise
                    self._ensure_parents()
            self._limit(dirs, limits)
        except OSError as exc:
            for directory in reversed(made):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            raise SandboxError(f"could not make the sandbox's cgroup under {self._parents[0]}: {exc}") from exc
        return SandboxCgroup(self, dirs)

    def _limit(self, dirs: tuple[Path, ...], limits: ResourceLimits) -> None:
        memory = str(limits.memory_mb << 20)
        quota = max(_MIN_CPU_QUOTA_US, int(limits.cpus * _CPU_PERIOD_US))
        if self.version == 2:
            [group] = dirs
            _write(group / "memory.max", memory)
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")
            _write(group / "pids.max", str(limits.pids))
            _write(group / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
            return
        memory_dir, pids_dir, cpu_dir = dirs
        _write(memory_dir / "memory.limit_in_bytes", memory)
        memsw = memory_dir / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # swap is accounted: memory + swap, so swap is no way around the limit
            _write(memsw, memory)
        _write(pids_dir / "pids.max", str(limits.pids))
        _write(cpu_dir / "cpu.cfs_quota_us", str(quota))  # a new group's period is the default, 100 ms


class SandboxCgroup:
    """One sandbox's group (a directory per hierarchy); removed with the sandbox."""

    def __init__(self, cgroups: Cgroups, dirs: tuple[Path, ...]) -> None:
        self._cgroups = cgroups
        self._dirs = dirs
        self.procs = tuple(str(d / "cgroup.procs") for d in dirs)
        # What a single-threaded process writes 0 into to join the group (see the module docstring).
        self.join = self.procs if cgroups.version == 2 else tuple(str(d / "tasks") for d in dirs)

    def __repr__(self) -> str:
        return f"SandboxCgroup({', '.join(map(str, self._dirs))})"

    def outcome(self) -> CgroupOutcome:
        """OOM kills in the group and its memory high-water mark; read before `remove`."""
        memory = self._dirs[0]
        if self._cgroups.version == 2:
            events, peak = memory / "memory.events", memory / "memory.peak"
        else:
            events, peak = memory / "memory.oom_control", memory / "memory.max_usage_in_bytes"
        try:
            fields = dict(line.split() for line in events.read_text().splitlines())
            kills = int(fields.get("oom_kill", "0"))
        except (OSError, ValueError) as exc:
            raise SandboxError(f"could not read {events}: {exc}") from exc
        try:
            peak_bytes: int | None = int(peak.read_text())
        except (OSError, ValueError):  # memory.peak is new in Linux 5.19
            peak_bytes = None
        return CgroupOutcome(kills, peak_bytes)

    def members(self) -> set[int]:
        """Pids still in the group, in any of its hierarchies."""
        found: set[int] = set()
        for procs in self.procs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(pid) for pid in Path(procs).read_text().split())
        return found

    def kill(self) -> None:
        """SIGKILL everything in the group, never a process outside it (pids may be reused)."""
        kill_file = self._dirs[0] / "cgroup.kill"
        if self._cgroups.version == 2 and kill_file.exists():
            _write(kill_file, "1")
            return
        for pid in self.members():
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Held by the pidfd, the process cannot be replaced by another under the same pid:
                # if the pid is still listed now, the pidfd is a member.
                if pid in self.members():
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)

    def remove_now(self) -> bool:
        """Remove the group if nothing is left in it; True once every directory is gone."""
        gone = True
        for directory in self._dirs:
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                    raise
                gone = False
        return gone

    async def remove(self) -> None:
        """Kill what is left in the group and remove it (and an emptied relative parent)."""
        deadline = time.monotonic() + _REMOVE_WITHIN_S
        while not (self._empty() and self.remove_now()):
            if time.monotonic() > deadline:
                log.warning("sandbox_cgroup_left_behind", cgroup=str(self._dirs[0]), members=len(self.members()))
                return
            with contextlib.suppress(OSError):
                self.kill()
            await asyncio.sleep(0.01)
        self._cgroups._remove_parents()

    def _empty(self) -> bool:
        return not self.members()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _has_controllers(directory: Path) -> bool:
    enabled = (directory / "cgroup.subtree_control").read_text().split()
    return all(c in enabled for c in CONTROLLERS)


def _inside(mount: Path, root: str, path: str) -> Path:
    """The directory of cgroup ``path`` (from /proc/self/cgroup) in a hierarchy mounted at ``mount``
    whose mount shows the hierarchy from ``root``."""
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return mount / relative.lstrip("/")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _mounts() -> dict[str, tuple[Path, str]]:
    """Controller name (or ``cgroup2``) -> (mount point, root shown) from /proc/self/mountinfo."""
    found: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fields, (fstype, _source, options, *_) = head.split(), tail.split()
        mount = (Path(_unescape(fields[4])), _unescape(fields[3]))
        if fstype == "cgroup2":
            found.setdefault("cgroup2", mount)
        elif fstype == "cgroup":
            for option in options.split(","):
                if option in CONTROLLERS:
                    found.setdefault(option, mount)
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller name (``""`` for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own

"""The ``bwrap`` tier: bubblewrap, no daemon, started as an unprivileged host uid.

Each run gets new user, pid, net, ipc, uts and cgroup namespaces, read-only binds of only the
system paths in settings, a private tmpfs capped in size and files, an empty environment (bwrap
itself is started under ``env={}``: its own pid 1 would otherwise keep the caller's environment
where the tool can read it), its own cgroup capping the memory, processes and CPU of all its
processes together (`runner.cgroup`), rlimits, a wall-clock timeout that kills the whole tree,
and output read with a byte cap while it streams.

As root, everything bound into the sandbox (``/tmp``, ``/in``, ``/run/stockade``, ``/out``) comes
from tmpfs mounts made for the run, so ``/proc/self/mountinfo`` inside names no host path.

The child is driven from the event loop without threads: pipes and a pidfd are watched with
``add_reader``, and the exit is reaped with ``os.wait4`` so CPU time and max RSS come from the
kernel's accounting of the whole sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from runner.base import ResourceLimits, RunResult, SandboxSpec, Usage, Verdict
from runner.cgroup import CgroupOutcome, Cgroups, SandboxCgroup, pid_alive
from runner.config import RunnerSettings
from runner.egress import EgressProxy
from runner.egress.intercept import with_interception
from runner.errors import SandboxError, SandboxUnavailable
from runner.files import Quarantine, mount_tmpfs, remove_tree, stage_inputs, unmount
from runner.seccomp import bpf_program

log = structlog.get_logger(__name__)

_SANDBOX_ID = "65534"  # the tool sees itself as nobody:nogroup
_READ_CHUNK = 65536
_DRAIN_AFTER_EXIT_S = 0.5
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_MERGED_USR = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")
_PROXY = "http://127.0.0.1:3128"
# The sandbox's first process (/bin/sh, still root, before setpriv; single-threaded) sets the
# rlimits, puts itself into each of its cgroup's hierarchies, then execs the rest: nothing runs
# outside the group or without its limits. ulimit sets soft and hard limits alike. The shell does
# what util-linux's prlimit did as one more exec wrapper (~1 ms per call saved). Arguments:
# address space (KiB), file size (512-byte blocks), open files, CPU seconds and processes ("-":
# none; a cgroup bounds both), then the cgroup files to join, "--" and the command.
_PREPARE = (
    'ulimit -c 0 && ulimit -v "$1" && ulimit -f "$2" && ulimit -n "$3" '
    '&& { [ "$4" = - ] || ulimit -t "$4"; } && { [ "$5" = - ] || ulimit -p "$5"; } '
    '|| { echo "stockade: could not set the sandbox rlimits" >&2; exit 125; }; shift 5; '
    'while [ "$1" != -- ]; do { echo 0 >"$1"; } 2>/dev/null || '
    '{ echo "stockade: could not enter the sandbox cgroup $1" >&2; exit 125; }; shift; done; shift; exec "$@"'
)
# Whether the sandbox was set up is told out of band, never from the exit code or stderr a tool
# controls. Before anything else the first process (on the host, as the router's user or root)
# opens the write end of a status pipe the router holds, by its /proc path, as fd 3 (4 if the
# seccomp program's pipe came as 3: dash names only single-digit fds, and Popen passes an fd under
# its own number). The fd passes through setpriv and bwrap; inside the sandbox, once every
# namespace, mount and limit is in place, the last wrapper writes one byte to it and execs the
# command with the fd closed. No byte: the sandbox failed to start and the tool never ran. A byte:
# the tool ran, and no later write of its own (it never holds the fd) could take the byte back.
_OPEN_STATUS = 'exec {fd}>"$1" || exit 125; shift; '
_STARTED = "printf . >&{fd} || exit 125; exec {fd}>&-; "
# Inodes of a staging tmpfs besides the inputs and the tool's files in /tmp: its root, tmp/, in/,
# run/, out/ and the egress socket, with room to spare.
_STAGING_INODES = 16
# Inside the sandbox: bridge 127.0.0.1:3128 to the proxy's socket, wait until it listens
# (0C38 is 3128 in /proc/net/tcp, 0A is LISTEN), then become the tool.
_BRIDGE = (
    "socat TCP-LISTEN:3128,bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:/run/stockade/egress.sock "
    "</dev/null >/dev/null 2>&1 & "
    'n=0; until grep -q ":0C38 00000000:0000 0A" /proc/net/tcp; do n=$((n+1)); [ $n -gt 2000 ] && break; '
    'sleep 0.002; done; exec "$@"'
)
_EXEC = 'exec "$@"'


class UidPool:
    """Hands each concurrent sandbox its own host uid, and bounds concurrency to the range's size."""

    def __init__(self, base: int, size: int) -> None:
        self._free = list(range(base + size - 1, base - 1, -1))
        self._available = asyncio.Semaphore(size)

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[int]:
        async with self._available:
            uid = self._free.pop()
            try:
                yield uid
            finally:
                self._free.append(uid)


def _limit_args(limits: ResourceLimits, settings: RunnerSettings, *, cgroup: bool) -> list[str]:
    """`_PREPARE`'s rlimit arguments: each process gets memory, file and fd limits; without a
    cgroup, CPU time and process count (per uid) too. With one, its CPU quota over the wall-clock
    timeout bounds CPU time and its pids limit the processes, for the whole sandbox.

    The tool is pid 1 of its namespace, where SIGXCPU is ignored: the hard limit's SIGKILL ends it.
    """
    return [
        str(limits.memory_mb << 10),
        str(settings.file_size_mb << 11),
        str(settings.open_files),
        "-" if cgroup else str(limits.cpu_seconds),
        "-" if cgroup else str(limits.pids),
    ]


class BwrapSandbox:
    """`Sandbox` on bubblewrap."""

    tier = "bwrap"

    def __init__(self, settings: RunnerSettings) -> None:
        self._settings = settings
        self._bwrap = shutil.which(settings.bwrap)
        # /bin/sh (rlimits, cgroup) and util-linux's setpriv (uid) are exec wrappers, so CPython
        # can vfork; a preexec_fn or user= would force a full fork of the router (~1.3 ms here).
        self._setpriv = shutil.which("setpriv")
        self._is_root = os.geteuid() == 0
        self._uids = UidPool(settings.uid_base, settings.max_concurrent)
        self._fs_args = self._filesystem_args()
        self._seccomp = bpf_program()
        self._children: set[int] = set()
        _sweep_staging(settings.state_dir / "bwrap")
        self._cgroups: Cgroups | None = None
        self._cgroup_problem: str | None = None
        try:
            self._cgroups = Cgroups.detect(settings.cgroup_parent)
        except SandboxUnavailable as exc:
            self._cgroup_problem = str(exc)
            if not settings.cgroup_required:
                log.warning("bwrap_runs_without_cgroup", reason=self._cgroup_problem)

    def check(self) -> str | None:
        if self._bwrap is None:
            return f"{self._settings.bwrap!r} not found: install it (apt-get install bubblewrap)"
        if self._is_root and self._setpriv is None:
            return "setpriv not found: install util-linux"
        if not Path(self._settings.python).exists():
            return f"{self._settings.python} not found: install python3 or set STOCKADE_RUNNER__PYTHON"
        if self._cgroups is None and self._settings.cgroup_required:
            return (
                f"{self._cgroup_problem}; or set STOCKADE_RUNNER__CGROUP_REQUIRED=false to accept per-process "
                "limits only"
            )
        return None

    def _filesystem_args(self) -> list[str]:
        args: list[str] = []
        for name in _MERGED_USR:
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                args += ["--ro-bind", str(host), str(host)]
        for path in self._settings.ro_binds:
            args += ["--ro-bind-try", path, path]
        return args

    def _tmp_args(self, staging: Path | None) -> list[str]:
        """/tmp: as root, the staging tmpfs's ``tmp/`` (capped in size and files); unprivileged,
        bwrap's own tmpfs, capped in size only (a cgroup, if any, charges its files' memory)."""
        if self._is_root and staging is not None:
            return ["--bind", str(staging / "tmp"), "/tmp"]
        return ["--size", str(self._settings.tmpfs_mb << 20), "--tmpfs", "/tmp"]

    def _argv(
        self,
        spec: SandboxSpec,
        bwrap: str,
        uid: int,
        seccomp_fd: int,
        staging: Path | None = None,
        cgroup: SandboxCgroup | None = None,
        status: str = "/dev/null",
    ) -> list[str]:
        status_fd = 4 if seccomp_fd == 3 else 3
        argv = ["/bin/sh", "-c", _OPEN_STATUS.format(fd=status_fd) + _PREPARE, "sh", status]
        argv += _limit_args(spec.limits, self._settings, cgroup=cgroup is not None)
        argv += [*(cgroup.join if cgroup is not None else ()), "--"]
        if self._is_root and self._setpriv:
            # As root, bwrap runs as the leased uid: as root RLIMIT_NPROC is not enforced and the
            # user namespace would map to real root. Unprivileged, it runs as the caller.
            argv += [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        argv += [
            bwrap,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--disable-userns",
            # --as-pid-1: no reaper between bwrap and the tool, so bwrap waits for the tool itself
            # and the kernel accounts its CPU time and RSS to us; when it exits, the kernel ends
            # everything else in its pid namespace.
            "--as-pid-1", "--die-with-parent", "--new-session",
            "--uid", _SANDBOX_ID, "--gid", _SANDBOX_ID, "--hostname", "sandbox",
            *self._fs_args,
            "--proc", "/proc", "--dev", "/dev",
            *self._tmp_args(staging),
            "--chdir", "/tmp", "--cap-drop", "ALL", "--clearenv", "--seccomp", str(seccomp_fd),
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
        ]  # fmt: skip
        if staging is not None:
            if spec.inputs:
                argv += ["--ro-bind", str(staging / "in"), "/in"]
            if spec.outputs is not None:
                argv += ["--bind", str(staging / "out"), "/out"]
            if spec.egress:
                argv += ["--ro-bind", str(staging / "run"), "/run/stockade"]
        if spec.egress:
            for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
                argv += ["--setenv", key, _PROXY]
        for key, value in spec.env.items():
            argv += ["--setenv", key, value]
        # Last, after every mount: bwrap's own root tmpfs (/, /etc) is owned by the sandbox user and
        # has no size cap; read-only, only /tmp and /out stay writable.
        argv += ["--remount-ro", "/"]
        wrapper = _STARTED.format(fd=status_fd) + (_BRIDGE if spec.egress else _EXEC)
        return [*argv, "--", "/bin/sh", "-c", wrapper, "sh", *spec.argv]

    async def run(self, spec: SandboxSpec) -> RunResult:
        problem = self.check()
        if problem is not None or self._bwrap is None:
            raise SandboxUnavailable(f"bwrap tier unavailable: {problem}")
        async with self._uids.lease() as uid:
            if not (self._is_root or spec.inputs or spec.outputs or spec.egress):
                return await self._run_as(spec, uid, self._bwrap)
            return await self._run_staged(spec, uid, self._bwrap)

    async def _run_staged(self, spec: SandboxSpec, uid: int, bwrap: str) -> RunResult:
        """A run from a staging directory (every run as root; else those with inputs, outputs or
        egress), and a proxy for the call.

        As root the staging directory is a tmpfs of its own: its ``tmp/`` is the sandbox's /tmp,
        capped in size and files (the inputs' pages and files come on top), and what is bound from
        it shows in the sandbox's mountinfo as ``/tmp``, ``/in`` and ``/run``, not as a host path.
        """
        spec, ca = with_interception(spec)
        root = self._settings.state_dir / "bwrap"
        root.mkdir(parents=True, exist_ok=True, mode=0o711)
        staging = Path(tempfile.mkdtemp(prefix=f"b-{_pid_namespace()}-{os.getpid():x}-", dir=root))
        os.chmod(staging, 0o755)  # noqa: S103  (the sandbox's uid must traverse it; nothing secret in it)
        owner = uid if self._is_root else os.getuid()
        on_tmpfs = mounted = False
        proxy: EgressProxy | None = None
        try:
            on_tmpfs = self._mount_staging(staging, spec, owner)
            if spec.inputs:
                (staging / "in").mkdir(mode=0o755)
            if spec.egress:
                (staging / "run").mkdir(mode=0o755)
            inputs = stage_inputs(staging / "in", spec.inputs)
            if spec.outputs is not None:
                out = staging / "out"
                out.mkdir(mode=0o700)
                mounted = mount_tmpfs(out, size_mb=self._settings.out_mb, inodes=1024, uid=owner)
                if not mounted:
                    out.chmod(0o777)
            if spec.egress:
                proxy = EgressProxy(staging / "run" / "egress.sock", spec.egress, spec.on_egress,
                                    hosts=self._settings.egress_hosts, injections=spec.injections,
                                    intercept=ca, upstream_ca=self._settings.egress_ca_file)  # fmt: skip
                await proxy.start()
            result = await self._run_as(spec, uid, bwrap, staging)
            if spec.outputs is None:
                return dataclasses.replace(result, inputs=inputs)
            quarantine = Quarantine(self._settings.quarantine_dir, spec.call_id, spec.outputs)
            fresh = not quarantine.directory.exists()
            try:
                quarantine.collect_tree(staging / "out")
            except Exception as exc:
                # No record will point at what was copied so far: it goes (unless another call made it).
                if fresh:
                    remove_tree(quarantine.directory)
                raise SandboxError(f"could not collect the sandbox's /out: {type(exc).__name__}: {exc}"[:300]) from exc
            return dataclasses.replace(
                result, inputs=inputs, artifacts=tuple(quarantine.records), refused=tuple(quarantine.refused),
                quarantine=str(quarantine.directory) if quarantine.records else None,
            )  # fmt: skip
        finally:
            try:
                if proxy is not None:
                    await proxy.aclose()
            finally:  # even if cancelled again while the proxy closes
                _remove_staging(staging, out_mounted=mounted, on_tmpfs=on_tmpfs)

    def _mount_staging(self, staging: Path, spec: SandboxSpec, owner: int) -> bool:
        """Mount the staging tmpfs (root only; False otherwise) and make its ``tmp/`` for ``owner``."""
        pages = sum((len(item.data) + 4095) & ~4095 for item in spec.inputs)
        size_mb = self._settings.tmpfs_mb + -(-pages // (1 << 20))
        inodes = self._settings.tmpfs_inodes + len(spec.inputs) + _STAGING_INODES
        if not mount_tmpfs(staging, size_mb=size_mb, inodes=inodes, uid=owner):
            return False
        os.chown(staging, 0, 0)  # the sandbox's uid only traverses it
        os.chmod(staging, 0o755)  # noqa: S103
        (staging / "tmp").mkdir(mode=0o700)
        os.chown(staging / "tmp", owner, owner)
        return True

    async def _run_as(self, spec: SandboxSpec, uid: int, bwrap: str, staging: Path | None = None) -> RunResult:
        """One sandbox, in a cgroup of its own (where this host has one) removed with it."""
        cgroup = self._cgroups.create(spec.limits) if self._cgroups is not None else None
        try:
            return await self._spawn(spec, uid, bwrap, staging, cgroup)
        finally:
            if cgroup is not None:
                # Shielded: cancelled again, the removal still finishes.
                await asyncio.shield(cgroup.remove())

    async def _spawn(
        self, spec: SandboxSpec, uid: int, bwrap: str, staging: Path | None, cgroup: SandboxCgroup | None
    ) -> RunResult:
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        stdout_r, stdout_w = os.pipe2(os.O_CLOEXEC)
        stderr_r, stderr_w = os.pipe2(os.O_CLOEXEC)
        # bwrap reads the seccomp program from a pipe until EOF; it is small enough for the buffer.
        seccomp_r, seccomp_w = os.pipe2(os.O_CLOEXEC)
        os.write(seccomp_w, self._seccomp)
        os.close(seccomp_w)
        # Not passed to the child: its first process opens the write end by path (see _OPEN_STATUS).
        status_r, status_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        started = time.monotonic()
        try:
            # Popen, not asyncio's subprocess: the loop watches our pipes and a pidfd, and we reap
            # with wait4 for the kernel's usage figures. The fork+exec itself is ~1 ms.
            proc = subprocess.Popen(  # noqa: ASYNC220
                self._argv(spec, bwrap, uid, seccomp_r, staging, cgroup, f"/proc/{os.getpid()}/fd/{status_w}"),
                stdin=stdin_r, stdout=stdout_w, stderr=stderr_w,
                env={}, close_fds=True, pass_fds=(seccomp_r,), start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            for fd in (stdin_r, stdin_w, stdout_r, stdout_w, stderr_r, stderr_w, seccomp_r, status_r, status_w):
                os.close(fd)
            raise SandboxError(f"could not start bwrap: {exc}") from exc
        finally:
            for fd in (stdin_r, stdout_w, stderr_w, seccomp_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._children.add(proc.pid)
        child = _Child(proc, stdin_w, stdout_r, stderr_r, spec.stdin, spec.limits.output_bytes)
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(child.exited), spec.limits.timeout_s)
            except TimeoutError:
                timed_out = True
                child.kill()
            status, rusage = await child.exited
            await child.drain(_DRAIN_AFTER_EXIT_S)
            outcome = cgroup.outcome() if cgroup is not None else None
            # Every process that could write it has exited: the byte is there or never will be.
            try:
                ran = os.read(status_r, 1) != b""
            except BlockingIOError:
                ran = False
        finally:
            # Cancellation or any error: the whole tree goes, and the child is reaped.
            child.close()
            self._children.discard(proc.pid)
            os.close(status_r)
            os.close(status_w)
        wall = time.monotonic() - started
        usage = Usage(wall_s=wall, cpu_s=rusage.ru_utime + rusage.ru_stime, max_rss_kb=rusage.ru_maxrss)
        if not (ran or timed_out or child.over_cap):
            # The sandbox itself failed to set up (the tool never ran): not a verdict about the tool.
            # What the setup wrote to stderr says why; the tool wrote none of it.
            raise SandboxError(f"could not start bwrap: {bytes(child.stderr).decode(errors='replace').strip()[:300]}")
        return _result(status, child, timed_out, usage, spec.limits, outcome)

    async def close_session(self, session: str) -> None:
        """bwrap keeps no per-session sandbox: every run starts fresh."""

    async def aclose(self) -> None:
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _pid_namespace() -> str:
    # Staging directories are named for the process that made them and its pid namespace
    # ("b-<namespace>-<pid>-..."), so what a killed process left can be told from what a live one uses.
    return f"{os.stat('/proc/self/ns/pid').st_ino:x}"


def _remove_staging(staging: Path, *, out_mounted: bool, on_tmpfs: bool) -> None:
    if out_mounted:
        unmount(staging / "out")
    if on_tmpfs:
        unmount(staging)
    try:
        os.rmdir(staging)  # empty once its tmpfs is gone
    except OSError:
        remove_tree(staging)


def _sweep_staging(root: Path) -> None:
    """Remove the staging directories (and their mounts) left under ``root`` by processes of this
    pid namespace that no longer exist: killed mid-run, their ``finally`` never ran."""
    made_here = re.compile(rf"b-{_pid_namespace()}-([0-9a-f]+)-.*")
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            maker = made_here.fullmatch(entry.name)
            if maker and not pid_alive(int(maker[1], 16)):
                _remove_staging(Path(entry.path), out_mounted=True, on_tmpfs=True)  # unmounting nothing is a no-op


def _result(
    status: int, child: _Child, timed_out: bool, usage: Usage, limits: ResourceLimits, cgroup: CgroupOutcome | None
) -> RunResult:
    """The verdict on a run of the tool, from bwrap's wait ``status`` and what the router saw.

    Raises:
        SandboxError: bwrap itself was killed by a signal the router did not send: the sandbox
            died, whatever the tool was doing.
    """
    code = os.waitstatus_to_exitcode(status)
    stdout, stderr = bytes(child.stdout), bytes(child.stderr)

    def verdict(v: Verdict, detail: str = "") -> RunResult:
        return RunResult(v, code, stdout, stderr, usage, BwrapSandbox.tier, detail)

    if child.over_cap:
        return verdict(Verdict.OUTPUT_LIMIT, f"output exceeded {limits.output_bytes} bytes")
    if timed_out:
        return verdict(Verdict.TIMEOUT, f"wall clock exceeded {limits.timeout_s:g}s")
    if cgroup is not None and cgroup.oom_kills:
        # Whatever the exit code: the kernel killed part of the tool, its work may be incomplete.
        peak = f" (peak {cgroup.peak_bytes / (1 << 20):.1f} MiB)" if cgroup.peak_bytes is not None else ""
        return verdict(
            Verdict.MEMORY_LIMIT,
            f"the sandbox's processes together reached the {limits.memory_mb} MiB memory limit{peak}; "
            f"the kernel killed {cgroup.oom_kills} of its processes",
        )
    if code < 0:
        # bwrap (--as-pid-1) reports a signalled tool as 128+signo: a status of "killed by a signal"
        # is bwrap's own death, and the router sent none (no timeout, no output cap) nor did the
        # sandbox's memory limit (above). Something outside killed it (an operator, the host's OOM
        # killer) or it crashed.
        log.error("bwrap_killed", signal=-code)
        raise SandboxError(f"bwrap killed by signal {-code} ({_signal_name(-code)}) mid-call; the tool's run is lost")
    # bwrap reports a signalled tool as 128+signo; the kernel's CPU-limit kill lands at the limit,
    # give or take a scheduler tick. (With a cgroup there is no CPU-time rlimit: its quota throttles.)
    if cgroup is None and code == 128 + signal.SIGKILL and usage.cpu_s >= limits.cpu_seconds - 0.1:
        return verdict(Verdict.TIMEOUT, f"CPU time exceeded {limits.cpu_seconds}s")
    if code == 0:
        return verdict(Verdict.OK)
    if any(marker in stderr for marker in _MEMORY_MARKERS):
        return verdict(Verdict.MEMORY_LIMIT, f"allocation failed under the {limits.memory_mb} MiB limit")
    return verdict(Verdict.NONZERO_EXIT, f"exit code {code}")


def _signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return "unknown signal"


class _Child:
    """Feeds stdin, collects stdout/stderr up to a byte cap, and reaps the child, all on the event loop."""

    def __init__(
        self, proc: subprocess.Popen[bytes], stdin: int, stdout: int, stderr: int, data: bytes, cap: int
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._proc = proc
        self._cap = cap
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.over_cap = False
        self._data = memoryview(data)
        self._open: set[int] = set()
        self._eof = asyncio.Event()
        self.exited: asyncio.Future[tuple[int, resource.struct_rusage]] = self._loop.create_future()
        self._pidfd = os.pidfd_open(proc.pid)
        for fd in (stdin, stdout, stderr):
            os.set_blocking(fd, False)
            self._open.add(fd)
        self._stdin = stdin
        self._loop.add_reader(stdout, self._read, stdout, self.stdout)
        self._loop.add_reader(stderr, self._read, stderr, self.stderr)
        self._loop.add_reader(self._pidfd, self._reap)
        if data:
            self._loop.add_writer(stdin, self._write)
        else:
            self._close(stdin)

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            if fd == self._stdin:
                self._loop.remove_writer(fd)
            else:
                self._loop.remove_reader(fd)
            os.close(fd)
        if not (self._open - {self._stdin}):
            self._eof.set()

    def _write(self) -> None:
        try:
            written = os.write(self._stdin, self._data[:_READ_CHUNK])
        except BlockingIOError:
            return
        except OSError:  # the tool closed stdin or died: what it did not read is not ours to force
            self._close(self._stdin)
            return
        self._data = self._data[written:]
        if not self._data:
            self._close(self._stdin)

    def _read(self, fd: int, sink: bytearray) -> None:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            self._close(fd)
            return
        room = self._cap - len(self.stdout) - len(self.stderr)
        sink += chunk[: max(room, 0)]
        if len(chunk) > room and not self.over_cap:
            self.over_cap = True
            self.kill()

    def _reap(self) -> None:
        self._loop.remove_reader(self._pidfd)
        _, status, rusage = os.wait4(self._proc.pid, 0)
        # Popen did not reap it; tell it so it does not warn about a running child.
        self._proc.returncode = os.waitstatus_to_exitcode(status)
        if not self.exited.done():
            self.exited.set_result((status, rusage))

    def kill(self) -> None:
        # bwrap leads its own process group; killing it takes pid 1 of the sandbox with it
        # (--die-with-parent), and with pid 1 the kernel ends the whole pid namespace.
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)

    async def drain(self, within_s: float) -> None:
        """Wait briefly for the pipes to reach EOF after exit, so no output is lost."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._eof.wait(), within_s)

    def close(self) -> None:
        if not self.exited.done():
            self.kill()
            # Reap synchronously: after SIGKILL the exit is immediate.
            with contextlib.suppress(ChildProcessError):
                self._loop.remove_reader(self._pidfd)
                _, status, _ = os.wait4(self._proc.pid, 0)
                self._proc.returncode = os.waitstatus_to_exitcode(status)
        for fd in list(self._open):
            self._close(fd)
        with contextlib.suppress(OSError):
            os.close(self._pidfd)

"""The ``docker`` and ``gvisor`` tiers: hardened containers through the Docker SDK.

Every container: all capabilities dropped, ``no-new-privileges``, stockade's seccomp profile,
read-only root, size-capped tmpfs at ``/tmp`` and ``/out``, ``network_mode=none``, memory, pids
and CPU limits, uid 65534, no log driver (output never lands on the host's disk), and no host
mounts but one per-container staging directory: ``/in`` (the call's inputs, read-only),
``/run/stockade`` (the egress proxy's socket, read-only) and ``/etc/hosts``, ``/etc/hostname``,
``/etc/resolv.conf`` (in place of Docker's, which name its own directories and copy the host's
resolvers). The staging directory is a random name under a neutral root (``/run/stockade``):
the tool sees bind sources in ``/proc/self/mountinfo``. ``gvisor`` is the same with the
``runsc`` runtime, so the tool talks to gVisor's kernel instead of the host's.

Warm pools keep ``pool_size`` started, never-used containers per (image, limits) class, each
with the resident worker (`runner.worker`) blocked on stdin. A call takes one, runs one job and
the container is destroyed in the background while a replacement starts (its worker has killed
whatever the tool left running). An empty pool means a cold start, reported as ``start="cold"``.
Session sandboxes keep one container per session, its worker serving job after job, until
`close_session`; nothing is shared across sessions, and ``/out`` is emptied after each job. Each
call runs under its own limits: ``docker`` sets the session's container to them (``docker update``);
``gvisor``, whose runtime cannot change a running sandbox's, refuses a call whose limits differ.

Availability (`ContainerSandbox.check`) is probed in a thread, started when the sandbox is made,
and cached: ``check()`` never calls Docker. An unavailable tier (no engine, no runtime, no image,
or a run that found the engine gone) is probed again with exponential backoff until it is back.

The Docker SDK blocks: its calls run in threads. The attach socket is driven by the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import secrets
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import docker
import docker.errors
import requests.exceptions
import structlog
from docker.types import LogConfig

from runner.base import ResourceLimits, RunResult, SandboxSpec, Usage, Verdict
from runner.config import RunnerSettings
from runner.egress import EgressProxy
from runner.egress.intercept import with_interception
from runner.errors import SandboxError, SandboxUnavailable
from runner.files import Quarantine, remove_tree, stage_inputs
from runner.image import default_image
from runner.seccomp import docker_profile
from runner.worker import OUT_ENTRIES, WORKER, FrameReader, encode_job

log = structlog.get_logger(__name__)

ContainerTier = Literal["docker", "gvisor"]
_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")
_WORKER_STDERR_CAP = 16384
# Host tasks gVisor uses per process of the sandbox: 64 processes peaked at 448 (runsc 20221219).
_GVISOR_HOST_TASKS_PER_PROCESS = 8
# How long a dead container's OOM event may lag its exit (it came within 10 ms when it did lag).
_OOM_EVENT_WAIT_S = 0.5
_MAX_USED_BACKLOG = 32  # used containers waiting for removal before removal stops waiting for idle
# A removal the engine failed (busy, restarting) is tried again, waiting longer each time up to the
# cap; past the last try the container is left to `aclose` and to the next start's orphan sweep.
_REMOVE_ATTEMPTS = 12
_REMOVE_BACKOFF_S = (0.25, 5.0)
_PATH = "/usr/local/bin:/usr/bin:/bin"
# In place of Docker's /etc files: the sandbox has no network and no resolver (the proxy resolves).
_ETC = {"hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost\n", "hostname": "sandbox\n", "resolv.conf": ""}


@dataclass(frozen=True)
class _Class:
    """Containers are interchangeable only within one class: same image and same limits."""

    image: str
    memory_mb: int
    pids: int
    cpus: float


@dataclass
class _Box:
    """A started container: its attach socket (the worker's stdin/stdout), staging directory, and
    the limits it runs under now (a session's container is set to each call's)."""

    id: str
    sock: socket.socket
    staging: Path
    handle: Any  # the SDK's socket wrapper: kept so the connection is not closed under us
    cls: _Class
    removals: int = 0  # attempts to remove it the engine failed


class _Demux:
    """Splits Docker's multiplexed attach stream (8-byte headers) into stdout and stderr."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        out = []
        while len(self._buffer) >= 8:
            stream, size = self._buffer[0], struct.unpack(">I", self._buffer[4:8])[0]
            if len(self._buffer) < 8 + size:
                break
            out.append((stream, bytes(self._buffer[8 : 8 + size])))
            del self._buffer[: 8 + size]
        return out


def _translate(exc: Exception) -> SandboxError:
    if isinstance(exc, docker.errors.ImageNotFound):
        return SandboxUnavailable(f"sandbox image missing ({exc.explanation}): run `stockade sandbox build-image`")
    if isinstance(exc, requests.exceptions.ConnectionError | docker.errors.DockerException) and "Connection" in str(
        exc
    ):
        return SandboxUnavailable(f"Docker engine unreachable: {exc}; start dockerd (scripts/services)")
    return SandboxError(f"Docker error: {exc}")


class ContainerSandbox:
    """`Sandbox` on Docker: ``docker`` (runc) or ``gvisor`` (runsc)."""

    def __init__(self, settings: RunnerSettings, tier: ContainerTier) -> None:
        self.tier: str = tier
        self._settings = settings
        self._image = settings.image or default_image()
        self._runtime = "runsc" if tier == "gvisor" else None
        self._owner = secrets.token_hex(6)
        self._maker = _maker()
        self._swept = False
        self._client: docker.DockerClient | None = None
        self._pools: dict[_Class, asyncio.Queue[_Box]] = {}
        self._wanted: set[_Class] = set()  # pools below pool_size, to refill when idle
        self._used: list[_Box] = []  # used containers, to remove when idle
        # Removals the engine failed, by container: each queued again when its timer fires.
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._chores = asyncio.Event()
        self._idle = asyncio.Event()
        self._inflight = 0
        self._housekeeper: asyncio.Task[None] | None = None
        self._closing = False
        self._creating: set[asyncio.Future[_Box]] = set()  # containers being started, awaited by aclose
        self._sessions: dict[str, _Box] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._staging_root = settings.container_staging_dir
        # Availability, written by the probe thread and read by check(); _answered once it is known.
        self._problem: str | None = None
        self._answered = threading.Event()
        self._stopping = threading.Event()
        self._probe_lock = threading.Lock()
        self._prober: threading.Thread | None = None
        self._reprobe("not checked yet")

    @property
    def owner(self) -> str:
        """The ``stockade.owner`` label on every container this instance creates."""
        return self._owner

    @property
    def warm(self) -> int:
        """Containers started and waiting in the warm pools, ready for a call."""
        return sum(queue.qsize() for queue in self._pools.values())

    # -- availability -----------------------------------------------------------------------

    def _docker(self) -> docker.DockerClient:
        """The client for container work (blocking: a thread's).

        Raises:
            SandboxUnavailable: the engine's socket is gone.
        """
        missing = self._missing_socket()
        if missing is not None:
            raise SandboxUnavailable(missing)
        if self._client is None:
            self._client = docker.DockerClient(base_url=self._settings.docker_host, timeout=30)
        return self._client

    def _missing_socket(self) -> str | None:
        # Checked before each use: the SDK leaks a socket when a connect to a missing path fails.
        host = self._settings.docker_host or "unix:///var/run/docker.sock"
        if host.startswith("unix://") and not os.path.exists(host.removeprefix("unix://")):
            return f"Docker engine unreachable: no socket at {host}; start dockerd (scripts/services)"
        return None

    def check(self) -> str | None:
        """Why this tier cannot run now, or None: the cached answer of the probe thread, so it
        never calls Docker. Only before the first probe has answered (just after the sandbox was
        made) does it wait for that answer, at most ``tier_probe_timeout_s``."""
        if not self._answered.wait(self._settings.tier_probe_timeout_s):
            return (f"Docker engine not answering within {self._settings.tier_probe_timeout_s:g}s "
                    "(still checking); start dockerd (scripts/services)")  # fmt: skip
        return self._problem

    def _reprobe(self, problem: str) -> None:
        """Mark the tier unavailable for ``problem`` and make sure a probe thread is re-checking it."""
        with self._probe_lock:
            self._problem = problem
            if self._prober is None and not self._stopping.is_set():
                self._prober = threading.Thread(target=self._watch, name=f"stockade-{self.tier}-probe", daemon=True)
                self._prober.start()

    def _watch(self) -> None:
        """Probe until the tier is available: after ``tier_recheck_min_s``, doubling up to
        ``tier_recheck_max_s``. Runs in its own thread; ends when the tier is available."""
        delay = self._settings.tier_recheck_min_s
        was = self._problem if self._answered.is_set() else None
        while True:
            problem = self._probe()
            with self._probe_lock:
                self._problem = problem
                self._answered.set()
                if problem is None or self._stopping.is_set():
                    self._prober = None
                    break
            if problem != was:
                log.warning("sandbox_tier_unavailable", tier=self.tier, problem=problem, retry_in_s=delay)
                was = problem
            if self._stopping.wait(delay):
                with self._probe_lock:
                    self._prober = None
                return
            delay = min(delay * 2, self._settings.tier_recheck_max_s)
        if problem is None and was is not None:
            # The engine may have restarted: connections pooled by the old client are dead.
            client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            log.info("sandbox_tier_available", tier=self.tier)
        if problem is None and not self._swept:
            self._swept = True
            self._sweep_orphans()

    def _sweep_orphans(self) -> None:
        """Remove the containers and staging directories that routers of this pid namespace left
        when they died without `aclose` (killed, crashed): each is labelled (or named) for the
        process that made it, and removed only once that process is gone. Runs once, in the probe
        thread, when the engine first answers. Containers of a live router, or of a process in
        another pid namespace (which this one cannot see), are left alone."""
        removed = 0
        with contextlib.suppress(Exception):
            client = self._docker()
            for found in client.api.containers(all=True, filters={"label": _MAKER_LABEL}):
                if _maker_gone((found.get("Labels") or {}).get(_MAKER_LABEL, "")):
                    with contextlib.suppress(docker.errors.NotFound):
                        client.api.remove_container(found["Id"], force=True)
                    removed += 1
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._staging_root):
                made = _STAGING_NAME.fullmatch(entry.name)
                if made and _maker_gone(made[1]):
                    remove_tree(Path(entry.path))
                    removed += 1
        if removed:
            log.info("sandbox_orphans_removed", tier=self.tier, count=removed)

    def _probe(self) -> str | None:
        """Why this tier cannot run (no engine, no runtime, no image, no staging directory), or
        None. Blocking: a thread's."""
        missing = self._missing_socket()
        if missing is not None:
            return missing
        try:
            _staging_root(self._staging_root)
        except (OSError, SandboxUnavailable) as exc:
            return f"cannot use the staging directory {self._staging_root}: {exc}"
        host = self._settings.docker_host or "unix:///var/run/docker.sock"
        client = None
        try:
            # A client of its own with a short timeout: a hung engine must not hold the probe for long.
            client = docker.DockerClient(base_url=host, timeout=max(1, round(self._settings.tier_probe_timeout_s)))
            client.ping()
            runtimes = client.info().get("Runtimes", {})
            if self._runtime and self._runtime not in runtimes:
                return "dockerd has no runsc runtime: install runsc and register it (scripts/services)"
            client.images.get(self._image)
        except docker.errors.ImageNotFound:
            return f"image {self._image} not built: run `stockade sandbox build-image`"
        except Exception as exc:  # any failure to reach Docker means: this tier is not here
            return f"Docker engine unreachable ({exc.__class__.__name__}): start dockerd (scripts/services)"
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
        return None

    # -- containers -----------------------------------------------------------------------

    def _class(self, limits: ResourceLimits) -> _Class:
        return _Class(self._image, limits.memory_mb, limits.pids, limits.cpus)

    def _pids_limit(self, cls: _Class) -> int:
        """The container's pids limit. Under gVisor it counts host tasks: the sentry's own threads
        and several for each process of the sandbox. Held to the tool's limit there, a tool reaching
        it took the whole sandbox down (exit 2, its output lost). The container gets room for the
        tool's processes (`_GVISOR_HOST_TASKS_PER_PROCESS` each) and ``gvisor_min_pids`` on top; the
        tool's own limit is held inside the sandbox (`_worker_command`)."""
        if self._runtime is None:
            return cls.pids
        return cls.pids * _GVISOR_HOST_TASKS_PER_PROCESS + self._settings.gvisor_min_pids

    def _worker_command(self, cls: _Class, session: bool) -> list[str]:
        """The container's main process: the worker (`runner.worker`), started by ``env -i`` with an
        empty environment (Docker always sets PATH and HOSTNAME); each job brings its tool's.

        Under gVisor it first sets RLIMIT_NPROC to the tool's pids limit, inherited by every tool:
        gVisor's kernel counts only the sandbox's processes (all of them the worker's uid, as the
        container's pids limit counts them under runc), so a fork bomb gets EAGAIN and the sandbox
        lives on. Never under runc: there the count is of the host uid's processes, container or not.
        """
        code = WORKER
        if self._runtime is not None:
            code = f"import resource; resource.setrlimit(resource.RLIMIT_NPROC, ({cls.pids}, {cls.pids}))\n" + code
        return ["env", "-i", self._settings.python, "-I", "-S", "-c", code, "session" if session else "pool"]

    def _create(self, cls: _Class, session: bool) -> _Box:
        """Create, attach and start one container (blocking: run in a thread)."""
        client = self._docker()
        staging = Path(tempfile.mkdtemp(prefix=self._staging_prefix, dir=_staging_root(self._staging_root)))
        try:
            for sub in ("in", "run"):
                (staging / sub).mkdir(mode=0o755)
            for name, text in _ETC.items():
                (staging / name).write_text(text)
                (staging / name).chmod(0o444)
            staging.chmod(0o755)
        except OSError as exc:
            remove_tree(staging)
            raise SandboxError(f"cannot prepare the staging directory {staging}: {exc}") from exc
        tmpfs_mb, out_mb = self._settings.tmpfs_mb, self._settings.out_mb
        command = self._worker_command(cls, session)
        container: Any = None
        handle: Any = None
        try:
            container = client.containers.create(
                cls.image, command=command, user="65534:65534",
                stdin_open=True, tty=False, working_dir="/tmp", hostname="sandbox",
                cap_drop=["ALL"], security_opt=["no-new-privileges", f"seccomp={docker_profile()}"],
                read_only=True, network_mode="none", runtime=self._runtime,
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={tmpfs_mb}m,nr_inodes=8192,mode=1777",
                       "/out": f"rw,nosuid,nodev,size={out_mb}m,nr_inodes={OUT_ENTRIES},mode=1777"},
                mem_limit=f"{cls.memory_mb}m", memswap_limit=f"{cls.memory_mb}m", pids_limit=self._pids_limit(cls),
                nano_cpus=int(cls.cpus * 1e9), log_config=LogConfig(type="none"),
                volumes={str(staging / "in"): {"bind": "/in", "mode": "ro"},
                         str(staging / "run"): {"bind": "/run/stockade", "mode": "ro"},
                         **{str(staging / name): {"bind": f"/etc/{name}", "mode": "ro"} for name in _ETC}},
                labels={"stockade.tier": self.tier, "stockade.owner": self._owner, _MAKER_LABEL: self._maker},
            )  # fmt: skip
            handle = container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            container.start()
        except Exception as exc:
            # Docker timing out under load, say: what was made so far goes now (an attach socket
            # left open, a container left created), not at the next sweep.
            raw_sock = getattr(handle, "_sock", None)
            if container is not None:
                self._destroy_now(_Box(container.id or "", raw_sock if isinstance(raw_sock, socket.socket)
                                       else socket.socket(), staging, handle, cls))  # fmt: skip
            else:
                remove_tree(staging)
            raise _translate(exc) from exc
        raw = getattr(handle, "_sock", None)  # the SDK wraps the hijacked connection's socket
        if not isinstance(raw, socket.socket):
            self._destroy_now(_Box(container.id or "", socket.socket(), staging, handle, cls))
            raise SandboxUnavailable("the container tiers need Docker on a local Unix socket")
        box = _Box(container.id or "", raw, staging, handle, cls)
        try:
            _await_ready(raw, self._settings.worker_start_timeout_s)
        except (OSError, SandboxError) as exc:
            self._destroy_now(box)
            raise SandboxError(f"{self.tier} worker did not start: {exc}") from exc
        raw.setblocking(False)
        return box

    @property
    def _staging_prefix(self) -> str:
        """How this instance's staging directories are named: by the process (`_STAGING_NAME`, for
        the orphan sweep) and by this instance (for `aclose`: others of this process live on)."""
        return f"c-{self._maker}-{self._owner}-"

    async def _start(self, cls: _Class, session: bool) -> _Box:
        """`_create` in a thread, safe to cancel: the container being started is finished all the
        same (a thread cannot be stopped), then removed like a used one, and `aclose` waits for it."""
        creating = asyncio.ensure_future(asyncio.to_thread(self._create, cls, session))
        self._creating.add(creating)
        creating.add_done_callback(self._creating.discard)
        try:
            return await asyncio.shield(creating)
        except asyncio.CancelledError:
            creating.add_done_callback(self._abandoned)
            raise

    def _abandoned(self, creating: asyncio.Future[_Box]) -> None:
        if not creating.cancelled() and creating.exception() is None:
            self._destroy(creating.result())

    def _relimit(self, box: _Box, cls: _Class) -> None:
        """Set a running container's memory, pids and CPU limits to ``cls`` (blocking: a thread's).

        Raises:
            SandboxError: Docker refused (the container holds more memory than the new limit).
        """
        api = self._docker().api
        update = {"Memory": cls.memory_mb << 20, "MemorySwap": cls.memory_mb << 20, "PidsLimit": cls.pids,
                  "NanoCpus": int(cls.cpus * 1e9)}  # fmt: skip
        # The SDK's update_container cannot set pids or NanoCpus (set at creation: CpuQuota would conflict).
        try:
            response = api.post(f"{api.base_url}/v{api.api_version}/containers/{box.id}/update", json=update)
            response.raise_for_status()
        except requests.exceptions.HTTPError as exc:
            # Docker's text names the container and runc's internals: logged, not handed to the caller.
            log.warning("sandbox_session_relimit_refused", tier=self.tier,
                        error=(exc.response.text.strip() if exc.response is not None else str(exc))[:500])  # fmt: skip
            raise SandboxError(
                f"the session's container could not be set to this call's limits ({cls.memory_mb} MiB, {cls.pids} "
                "pids): it holds more than they allow (its /tmp counts); the session's container and its /tmp "
                "are discarded, and its next call starts afresh"
            ) from exc
        except Exception as exc:
            raise _translate(exc) from exc
        box.cls = cls

    def _destroy_now(self, box: _Box) -> bool:
        """Close ``box``'s connection, remove its container and staging directory (blocking: a
        thread's). False if the engine did not remove the container: it may still be running, and
        is logged (``sandbox_remove_failed``) for whoever tries again."""
        # The SDK's wrapper holds a makefile reference: the socket's fd closes only when both do.
        if box.handle is not None:  # (None: the container was made, its attach failed)
            with contextlib.suppress(OSError):
                box.handle.close()
        with contextlib.suppress(OSError):
            box.sock.close()
        removed = True
        try:
            self._docker().api.remove_container(box.id, force=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # any engine failure: the container outlives its use, and that is said
            removed = False
            log.warning("sandbox_remove_failed", tier=self.tier, container=box.id[:12], attempt=box.removals + 1,
                        error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        remove_tree(box.staging)
        return removed

    def _destroy(self, box: _Box) -> None:
        """Queue a used container for removal by the housekeeper: not on any call's path."""
        self._used.append(box)
        self._wake_housekeeper()

    # -- pools and housekeeping -------------------------------------------------------------

    async def prewarm(self, limits: ResourceLimits, size: int | None = None) -> None:
        """Fill the pool for ``limits`` and wait until it holds ``size`` (default: pool_size) containers."""
        cls = self._class(limits)
        want = self._settings.pool_size if size is None else size
        queue = self._pools.setdefault(cls, asyncio.Queue())
        while queue.qsize() < want:
            await queue.put(await self._start(cls, False))

    def _refill(self, cls: _Class) -> None:
        self._pools.setdefault(cls, asyncio.Queue())
        self._wanted.add(cls)
        self._wake_housekeeper()

    def _wake_housekeeper(self) -> None:
        if self._closing:
            return  # aclose removes whatever is left
        if self._housekeeper is None or self._housekeeper.done():
            self._housekeeper = asyncio.get_running_loop().create_task(self._housekeep())
        self._chores.set()

    def _short_pool(self) -> _Class | None:
        for cls in list(self._wanted):
            if self._pools[cls].qsize() < self._settings.pool_size:
                return cls
            self._wanted.discard(cls)
        return None

    async def _housekeep(self) -> None:
        """Removes used containers and refills pools, one at a time, when no call is running.

        Container churn costs dockerd and the runtime far more CPU than a warm call takes; done
        between calls it slows every call on a small machine. It runs at once only when it is
        urgent: a pool ran dry, or too many used containers are waiting.
        """
        while not self._closing:
            await self._chores.wait()
            self._chores.clear()
            while not self._closing and ((short := self._short_pool()) is not None or self._used):
                urgent = (short is not None and self._pools[short].empty()) or len(self._used) > _MAX_USED_BACKLOG
                if not urgent and not await self._idle_for(self._settings.housekeeping_grace_s):
                    continue
                try:
                    if short is not None and (urgent or not self._used or self._pools[short].empty()):
                        box = await self._start(short, False)
                        await self._pools[short].put(box)
                    elif self._used:
                        await self._remove_used(self._used.pop(0))
                except SandboxError as exc:
                    # Do not spin on a broken engine: calls will start cold (and say why) meanwhile.
                    log.warning("sandbox_pool_refill_failed", tier=self.tier, error=str(exc))
                    if isinstance(exc, SandboxUnavailable):
                        self._reprobe(str(exc))
                    if short is not None:
                        self._wanted.discard(short)
                    await asyncio.sleep(1.0)

    async def _remove_used(self, box: _Box) -> None:
        """Remove a used container; one the engine failed to remove (it may still run the tool's
        processes) is queued again after a wait that grows, not left until `aclose`. The wait is
        a timer, not the housekeeper's: pools go on being refilled meanwhile."""
        if await asyncio.to_thread(self._destroy_now, box):
            return
        box.removals += 1
        if box.removals >= _REMOVE_ATTEMPTS:
            log.error("sandbox_remove_gave_up", tier=self.tier, container=box.id[:12], attempts=box.removals)
            return
        low, high = _REMOVE_BACKOFF_S
        self._retries[box.id] = asyncio.get_running_loop().call_later(
            min(high, low * 2 ** (box.removals - 1)), self._retry, box
        )

    def _retry(self, box: _Box) -> None:
        self._retries.pop(box.id, None)
        self._destroy(box)

    async def _idle_for(self, seconds: float) -> bool:
        """Wait until no call has been running for ``seconds``; False if one started meanwhile."""
        while self._inflight and not self._closing:
            self._idle.clear()
            await self._idle.wait()
        await asyncio.sleep(seconds)
        return self._inflight == 0 and not self._closing

    async def _acquire(self, spec: SandboxSpec) -> tuple[_Box, str, bool]:
        """A container for ``spec``: (box, how it started, whether to keep it afterwards)."""
        cls = self._class(spec.limits)
        if spec.session is not None:
            box = self._sessions.get(spec.session)
            if box is None:
                box = await self._start(cls, True)
                self._sessions[spec.session] = box
                return box, "cold", True
            if box.cls != cls:
                await self._session_limits(spec.session, box, cls)
            return box, "session", True
        queue = self._pools.get(cls)
        started = "cold"
        if queue is not None and not queue.empty():
            box, started = queue.get_nowait(), "warm"
        else:
            box = await self._start(cls, False)
        if self._settings.pool_size > 0:
            self._refill(cls)
        return box, started, False

    async def _session_limits(self, session: str, box: _Box, cls: _Class) -> None:
        """Put the session's container under this call's limits (``cls``) before the call runs in
        it: each call's limits are its own, whatever an earlier call of the session was allowed.

        Raises:
            SandboxError: the limits could not be changed. Under gVisor they never can (runsc has
                no ``update``): the session stays as it was, for calls with its limits. Otherwise
                the container's limits are no longer known: it is removed with the session.
        """
        if self._runtime is not None:
            was = box.cls
            raise SandboxError(
                f"session {session!r} runs under {was.memory_mb} MiB, {was.pids} pids, {was.cpus:g} CPUs; gVisor "
                f"cannot change a running sandbox's limits to this call's ({cls.memory_mb} MiB, {cls.pids} pids, "
                f"{cls.cpus:g} CPUs): give every call of a session the same limits, or close the session first"
            )
        try:
            await asyncio.to_thread(self._relimit, box, cls)
        except BaseException:
            self._sessions.pop(session, None)
            self._destroy(box)
            raise

    # -- running ----------------------------------------------------------------------------

    async def run(self, spec: SandboxSpec) -> RunResult:
        if not self._answered.is_set():
            await asyncio.to_thread(self._answered.wait, self._settings.tier_probe_timeout_s)
        problem = self.check()
        if problem is not None:
            raise SandboxUnavailable(f"{self.tier} tier unavailable: {problem}")
        lock = self._session_locks.setdefault(spec.session, asyncio.Lock()) if spec.session else None
        try:
            async with lock or contextlib.nullcontext():
                return await self._run(spec)
        except SandboxUnavailable as exc:
            self._reprobe(str(exc))  # the engine or the image went away: refuse until it is back
            raise

    async def _run(self, spec: SandboxSpec) -> RunResult:
        self._inflight += 1
        try:
            return await self._run_counted(spec)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _drop(self, box: _Box, session: str | None) -> None:
        """Destroy ``box`` like a used one, first taking it out of its session: a job cut short
        there (cancelled, or failed mid-exchange) may still be running, and a later job sent to it
        would get that job's frames as its reply. Its socket is shut at once for the same reason."""
        if session is not None and self._sessions.get(session) is box:
            self._sessions.pop(session)
        with contextlib.suppress(OSError):
            box.sock.shutdown(socket.SHUT_RDWR)
        self._destroy(box)

    async def _run_counted(self, spec: SandboxSpec) -> RunResult:
        started = time.perf_counter()
        spec, ca = with_interception(spec)
        box, how, keep = await self._acquire(spec)
        proxy: EgressProxy | None = None
        try:
            for leftover in (box.staging / "in").iterdir():
                leftover.unlink()  # a session's earlier inputs do not carry over
            inputs = stage_inputs(box.staging / "in", spec.inputs)
            if spec.egress:
                proxy = EgressProxy(box.staging / "run" / "egress.sock", spec.egress, spec.on_egress,
                                    hosts=self._settings.egress_hosts, injections=spec.injections,
                                    intercept=ca, upstream_ca=self._settings.egress_ca_file)  # fmt: skip
                await proxy.start()
            seal = secrets.token_hex(16)  # the worker's word that the job ended (FrameReader)
            header: dict[str, object] = {
                "kind": spec.kind, "argv": list(spec.argv), "cwd": "/tmp", "egress": bool(spec.egress), "seal": seal,
                "env": {"HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PATH": _PATH,
                        **_proxy_env(bool(spec.egress)), **spec.env},
                "outputs": {"max_files": spec.outputs.max_files, "max_bytes": spec.outputs.max_bytes,
                            "max_entries": OUT_ENTRIES} if spec.outputs else None,
            }  # fmt: skip
            reader, worker_err, timed_out = await self._exchange(box, encode_job(header, spec.stdin), spec, seal)
            died = reader.reply.exit is None
            state: dict[str, Any] = {}
            # Not when the host killed the container itself (timeout, output cap, protocol error).
            if died and not (timed_out or reader.reply.over_cap or reader.reply.malformed):
                state = await asyncio.to_thread(self._state, box, time.time() - (time.perf_counter() - started))
        except BaseException:
            keep = False
            raise
        finally:
            if proxy is not None:
                await proxy.aclose()
            if not keep:
                self._drop(box, spec.session)
            elif spec.session is not None and (box.sock.fileno() < 0):
                self._sessions.pop(spec.session, None)
        wall = time.perf_counter() - started
        self._check_not_killed(box, spec.session if keep else None, state)
        quarantine = None
        artifacts: tuple[Any, ...] = ()
        refused = tuple(reader.reply.refused)
        if spec.outputs is not None and (reader.reply.files or reader.reply.refused):
            q = Quarantine(self._settings.quarantine_dir, spec.call_id, spec.outputs)
            fresh = not q.directory.exists()
            try:
                for path, data in reader.reply.files:
                    q.add(path, data)
            except Exception as exc:
                # No record will point at what was copied so far: it goes (unless another call made it).
                if fresh:
                    remove_tree(q.directory)
                log.error("sandbox_outputs_not_stored", tier=self.tier, error=repr(exc)[:500])
                raise SandboxError(f"could not store the sandbox's /out: {type(exc).__name__}") from exc
            quarantine, artifacts, refused = str(q.directory), tuple(q.records), refused + tuple(q.refused)
        result = _verdict(reader, worker_err, timed_out, state, spec.limits, wall, self.tier)
        if keep and (timed_out or died or reader.reply.over_cap or reader.reply.malformed):
            self._drop(box, spec.session)  # a session box that failed is not reused
        return RunResult(
            result.verdict, result.exit_code, result.stdout, result.stderr, result.usage, self.tier, result.detail,
            start=how, inputs=inputs, artifacts=artifacts, refused=refused, quarantine=quarantine,
        )  # fmt: skip

    async def _exchange(self, box: _Box, job: bytes, spec: SandboxSpec, seal: str) -> tuple[FrameReader, bytes, bool]:
        loop = asyncio.get_running_loop()
        caps = spec.outputs.max_bytes if spec.outputs else 0
        reader = FrameReader(spec.limits.output_bytes, caps, seal=seal)
        demux = _Demux()
        worker_err = bytearray()
        deadline = loop.time() + spec.limits.timeout_s
        timed_out = False
        try:
            await loop.sock_sendall(box.sock, job)
        except OSError:
            return reader, b"worker is gone", False
        while not reader.reply.done:
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(loop.sock_recv(box.sock, 1 << 16), remaining)
            except TimeoutError:
                timed_out = True
                break
            except OSError:
                break
            if not data:
                break
            for stream, payload in demux.feed(data):
                if stream == 1:
                    reader.feed(payload)
                elif len(worker_err) < _WORKER_STDERR_CAP:
                    worker_err += payload[: _WORKER_STDERR_CAP - len(worker_err)]
            if reader.reply.over_cap or reader.reply.malformed:
                break
        if timed_out or reader.reply.over_cap or reader.reply.malformed:
            # Hang up first: dockerd cannot stop a container while its copy of the output to us is
            # blocked on a socket we no longer read (the kill then waited out the client's 30 s).
            with contextlib.suppress(OSError):
                box.sock.shutdown(socket.SHUT_RDWR)
            await asyncio.to_thread(self._kill, box)
        # Otherwise the worker has killed what the tool left running and waits for us to hang up;
        # the housekeeper does that (and the container's teardown) when no call is running.
        return reader, bytes(worker_err), timed_out

    def _check_not_killed(self, box: _Box, session: str | None, state: dict[str, Any]) -> None:
        """Fail the call if its worker was killed by a signal other than at the memory limit
        (`_killed_by`): the sandbox failed, not the tool. A session's container goes with it.

        Raises:
            SandboxError: the worker was killed mid-call.
        """
        signo = _killed_by(state)
        if signo is None:
            return
        if session is not None:
            self._drop(box, session)
        log.error("sandbox_worker_killed", tier=self.tier, container=box.id[:12], signal=signo)
        # Under gVisor the tool itself can: its kernel lets a process of PID 1's uid signal it.
        by_tool = ", or by the tool (gVisor lets it signal the worker)" if self.tier == "gvisor" else ""
        raise SandboxError(
            f"{self.tier} sandbox worker killed (signal {signo}) mid-call, not at the memory limit (the container "
            "was not OOM-killed): stopped from outside (docker kill, an operator, the host's OOM killer), its "
            f"runtime failed{by_tool}; the tool's run is lost"
        )

    def _kill(self, box: _Box) -> None:
        with contextlib.suppress(Exception):
            self._docker().api.kill(box.id)

    def _state(self, box: _Box, since: float) -> dict[str, Any]:
        """The container's state after its worker died mid-job (OOM, or gVisor taking the sandbox
        down) in a call that started at ``since`` (epoch seconds), with ``OOMKilled`` true if the
        container's memory cgroup killed a process meanwhile."""
        try:
            api = self._docker().api
            api.wait(box.id, timeout=10)
            state: dict[str, Any] = api.inspect_container(box.id)["State"]
            if not state.get("OOMKilled") and isinstance(code := state.get("ExitCode"), int) and code > 128:
                state["OOMKilled"] = self._oom_event(box, since)
        except Exception as exc:
            return {"Error": str(exc)}
        return state

    def _oom_event(self, box: _Box, since: float) -> bool:
        """Whether Docker logged an ``oom`` event for ``box`` since ``since``, waiting for it at most
        `_OOM_EVENT_WAIT_S`. dockerd sets ``State.OOMKilled`` only if the runtime's OOM event comes
        before its exit event; under gVisor it came a few milliseconds after, now and then (2 runs
        in 20), and a container killed at its memory limit read as killed from outside."""
        # Whole seconds (the SDK's type): the wait may run up to a second longer.
        until = math.ceil(time.time() + _OOM_EVENT_WAIT_S)
        events = self._docker().api.events(
            since=math.floor(since), until=until, filters={"container": box.id, "event": "oom"}, decode=True
        )
        try:
            return any(True for _ in events)  # the stream ends at `until`; the first event ends the wait
        finally:
            events.close()

    async def close_session(self, session: str) -> None:
        box = self._sessions.pop(session, None)
        self._session_locks.pop(session, None)
        if box is not None:
            await asyncio.to_thread(self._destroy_now, box)

    async def aclose(self) -> None:
        # Let the housekeeper finish the container it may be creating: cancelling it would leave
        # that container (and its attach socket) to nobody.
        self._closing = True
        for later in self._retries.values():  # those containers go with the rest of this instance's, below
            later.cancel()
        self._retries.clear()
        self._stopping.set()
        prober = self._prober
        if prober is not None:
            await asyncio.to_thread(prober.join, self._settings.tier_probe_timeout_s * 3)
        self._chores.set()
        self._idle.set()
        if self._housekeeper is not None:
            with contextlib.suppress(Exception):
                await self._housekeeper
        # Containers still starting for cancelled calls: each lands in _used when it is up.
        await asyncio.gather(*self._creating, return_exceptions=True)
        boxes = list(self._sessions.values()) + self._used
        self._used = []
        self._sessions.clear()
        for queue in self._pools.values():
            while not queue.empty():
                boxes.append(queue.get_nowait())
        await asyncio.gather(*(asyncio.to_thread(self._destroy_now, b) for b in boxes))
        client, self._client = self._client, None
        await asyncio.to_thread(self._remove_leftovers, client)

    def _remove_leftovers(self, client: docker.DockerClient | None) -> None:
        """Remove anything of ours still there (a container whose creation was interrupted, and
        staging directories), then close the client. One listing call: the high-level list
        inspects each container and races their removal."""
        if client is not None:
            with contextlib.suppress(Exception):
                if self._missing_socket() is None:
                    for found in client.api.containers(all=True, filters={"label": f"stockade.owner={self._owner}"}):
                        client.api.remove_container(found["Id"], force=True)
            client.close()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._staging_root):
                if entry.name.startswith(self._staging_prefix):
                    remove_tree(Path(entry.path))


# The process that made a container (a label) or staging directory (in its name, "c-<maker>-..."):
# "<pid namespace inode>-<pid>-<start time>" in hex, the start time in clock ticks since boot, so a
# reused pid is not taken for the maker. What a process that is gone left is nobody's.
_MAKER_LABEL = "stockade.maker"
_STAGING_NAME = re.compile(r"c-([0-9a-f]+-[0-9a-f]+-[0-9a-f]+)-.*")


def _maker() -> str:
    """This process, as `_MAKER_LABEL` names it."""
    return f"{_pid_namespace():x}-{os.getpid():x}-{_start_time(os.getpid()) or 0:x}"


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of its ``stat``), or None if it is gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    return int(stat_line.rsplit(b")", 1)[1].split()[19])


def _maker_gone(maker: str) -> bool:
    """Whether the process ``maker`` names no longer exists; False where this process cannot tell
    (another pid namespace, a malformed label)."""
    parts = maker.split("-")
    if len(parts) != 3 or not all(re.fullmatch(r"[0-9a-f]+", part) for part in parts):
        return False
    namespace, pid, start = (int(part, 16) for part in parts)
    if namespace != _pid_namespace():
        return False
    return _start_time(pid) != start


def _staging_root(root: Path) -> Path:
    """``root``, created if missing; refused unless it is a directory of ours that nobody else can
    write to (under a shared temporary directory another user could have made it first)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o711)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxUnavailable(f"staging directory {root} is not a private directory of this user: remove it, "
                                 "or set STOCKADE_RUNNER__CONTAINER_STAGING_DIR")  # fmt: skip
    return root


def _await_ready(sock: socket.socket, timeout_s: float) -> None:
    """Block until the worker's ready frame arrives (Docker's 8-byte header, then ``R`` + 0 length)."""
    sock.settimeout(timeout_s)
    expected = 8 + 5
    data = b""
    while len(data) < expected:
        chunk = sock.recv(expected - len(data))
        if not chunk:
            raise SandboxError("the worker exited before it was ready")
        data += chunk
    if data[0] != 1 or data[8:9] != b"R":
        raise SandboxError(f"unexpected first bytes from the worker: {data[:16]!r}")


def _proxy_env(enabled: bool) -> dict[str, str]:
    if not enabled:
        return {}
    url = "http://127.0.0.1:3128"
    return {"HTTP_PROXY": url, "HTTPS_PROXY": url, "http_proxy": url, "https_proxy": url, "NO_PROXY": ""}


def _killed_by(state: dict[str, Any]) -> int | None:
    """The signal that killed a worker which died mid-job, if the container's memory limit did not
    (``state``: Docker's ``State`` of the exited container; empty when the host killed it itself).

    Exit 128+N is only a death by signal N: ``docker kill``, an operator, the host's OOM killer, a
    runtime crash. Only ``OOMKilled`` (Docker's, set under runc and runsc alike when the container's
    memory cgroup killed a process, or `_state`'s from a late OOM event) says the memory limit did
    it. The worker itself never exits above 128.
    """
    code = state.get("ExitCode")
    if state.get("OOMKilled") or not isinstance(code, int) or not 128 < code < 128 + signal.NSIG:
        return None
    return code - 128


def _verdict(
    reader: FrameReader, worker_err: bytes, timed_out: bool, state: dict[str, Any], limits: ResourceLimits,
    wall: float, tier: str,
) -> RunResult:  # fmt: skip
    reply = reader.reply
    exit_info = reply.exit or {}
    code_value = exit_info.get("code")
    code = int(code_value) if isinstance(code_value, int | float) else None
    if code is None and "ExitCode" in state:
        code = int(state["ExitCode"])
    usage = Usage(wall_s=wall, cpu_s=float(exit_info.get("cpu_s", 0.0) or 0.0),
                  max_rss_kb=int(exit_info.get("max_rss_kb", 0) or 0))  # fmt: skip
    stdout, stderr = bytes(reply.stdout), bytes(reply.stderr)

    def verdict(v: Verdict, detail: str = "") -> RunResult:
        return RunResult(v, code, stdout, stderr, usage, tier, detail)

    if reply.over_cap:
        return verdict(Verdict.OUTPUT_LIMIT, f"output exceeded {limits.output_bytes} bytes")
    if timed_out:
        return verdict(Verdict.TIMEOUT, f"wall clock exceeded {limits.timeout_s:g}s")
    if reply.malformed:
        return verdict(Verdict.ERROR, f"worker protocol error: {reply.malformed}")
    if reply.exit is None:
        # The worker died mid-job: the kernel's (or gVisor's) OOM killer, or the sandbox went down
        # (a worker killed by a signal otherwise is `_killed_by`'s, raised before this).
        if state.get("OOMKilled"):
            return verdict(Verdict.MEMORY_LIMIT, f"killed at the {limits.memory_mb} MiB memory limit")
        err = worker_err.decode(errors="replace").strip()[-300:]
        return verdict(Verdict.ERROR, f"sandbox worker died (exit {code}): {err or state.get('Error', '')}")
    oom_kills = int(exit_info.get("oom_kills", 0) or 0)  # the job's own, not the container's running count
    if oom_kills > 0:
        # Whatever the exit code (as on bwrap): the kernel killed part of the tool, its work may be incomplete.
        return verdict(
            Verdict.MEMORY_LIMIT,
            f"the sandbox's processes together reached the {limits.memory_mb} MiB memory limit; "
            f"the kernel killed {oom_kills} of its processes",
        )
    if code == 0:
        return verdict(Verdict.OK)
    if any(marker in stderr for marker in _MEMORY_MARKERS):
        return verdict(Verdict.MEMORY_LIMIT, f"allocation failed under the {limits.memory_mb} MiB limit")
    return verdict(Verdict.NONZERO_EXIT, f"exit code {code}")

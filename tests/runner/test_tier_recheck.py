"""A container tier's availability: probed off the event loop, cached, and probed again with
backoff until Docker is back, without a restart. Docker "goes away" and "comes back" as a socat
relay from a socket of the test's own to the real engine's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner import ContainerSandbox, RunnerSettings, SandboxSpec, SandboxUnavailable, Verdict
from tests.conftest import sandbox_containers

ENGINE = "/var/run/docker.sock"
RECHECK_MAX_S = 0.4
ECHO = SandboxSpec(argv=("/bin/sh", "-c", "echo back"))


class Relay:
    """socat from ``path`` to Docker's socket, in a process group of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["socat", f"UNIX-LISTEN:{self.path},fork", f"UNIX-CONNECT:{ENGINE}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        for _ in range(200):
            if self.path.exists():
                return
            time.sleep(0.01)
        raise RuntimeError("socat did not create its socket")

    def stop(self) -> None:
        """Stop the relay and every connection it forked: the engine is gone for whoever used it."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self.process = None
        self.path.unlink(missing_ok=True)


@pytest.fixture
def relay() -> Iterator[Relay]:
    # A short directory: a Unix socket's path must fit in 108 bytes, which pytest's tmp_path may not.
    directory = Path(tempfile.mkdtemp(prefix="stockade-engine-", dir="/tmp"))
    relay = Relay(directory / "docker.sock")
    yield relay
    relay.stop()
    shutil.rmtree(directory, ignore_errors=True)


def settings_for(socket_path: Path, state: Path, **overrides: float) -> RunnerSettings:
    return RunnerSettings(
        state_dir=state, pool_size=0, docker_host=f"unix://{socket_path}",
        tier_recheck_min_s=0.05, tier_recheck_max_s=RECHECK_MAX_S, **overrides,  # type: ignore[arg-type]
    )  # fmt: skip


async def seconds_until_available(box: ContainerSandbox, limit_s: float = 15) -> float:
    started = time.monotonic()
    while box.check() is not None:
        assert time.monotonic() - started < limit_s, box.check()
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_an_unavailable_tier_comes_back_when_docker_does(relay: Relay, runner_state: Path) -> None:
    box = ContainerSandbox(settings_for(relay.path, runner_state), "docker")
    try:
        assert "unreachable" in (box.check() or "")
        with pytest.raises(SandboxUnavailable):
            await box.run(ECHO)
        await asyncio.sleep(1.0)  # probed again and again: the wait between probes is at its bound
        relay.start()
        back_after = await seconds_until_available(box)
        # Within one backoff interval, plus the probe itself (slow under a loaded engine).
        assert back_after < RECHECK_MAX_S + 1.5
        result = await box.run(ECHO)
        assert (result.verdict, result.stdout) == (Verdict.OK, b"back\n")
    finally:
        await box.aclose()


async def test_a_run_that_finds_docker_gone_makes_the_tier_unavailable_until_it_returns(
    relay: Relay, runner_state: Path
) -> None:
    relay.start()
    box = ContainerSandbox(settings_for(relay.path, runner_state), "docker")
    try:
        assert box.check() is None
        assert (await box.run(ECHO)).verdict is Verdict.OK
        relay.stop()
        with pytest.raises(SandboxUnavailable):
            await box.run(ECHO)
        assert "unreachable" in (box.check() or "")
        with pytest.raises(SandboxUnavailable):
            await box.run(ECHO)  # refused at once now, without trying Docker
        relay.start()
        assert await seconds_until_available(box) < RECHECK_MAX_S + 1.5
        assert (await box.run(ECHO)).verdict is Verdict.OK
    finally:
        await box.aclose()


class HungEngine:
    """A Unix socket that accepts connections and never answers: an engine that hangs."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(64)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.listener.accept()[0])

    def close(self) -> None:
        self.listener.close()
        for connection in self.accepted:
            connection.close()


async def test_check_answers_from_its_cache_while_the_engine_hangs(runner_state: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="stockade-engine-", dir="/tmp"))
    engine = HungEngine(directory / "docker.sock")
    box = ContainerSandbox(settings_for(directory / "docker.sock", runner_state, tier_probe_timeout_s=1.0), "gvisor")
    try:
        started = time.monotonic()
        assert box.check() is not None  # the first answer: the probe's, or "not answering" at its bound
        assert time.monotonic() - started < 1.5
        while len(engine.accepted) < 2:  # a second probe is now waiting on the hung engine
            assert time.monotonic() - started < 10
            await asyncio.sleep(0.01)
        slowest = 0.0
        for _ in range(1000):
            started = time.monotonic()
            problem = box.check()
            slowest = max(slowest, time.monotonic() - started)
        assert problem is not None
        assert "unreachable" in problem or "not answering" in problem
        assert slowest < 0.01
    finally:
        engine.close()
        await box.aclose()
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_used_container_the_engine_failed_to_remove_is_removed_once_it_answers(
    relay: Relay, runner_state: Path
) -> None:
    """A used container is removed between calls; when the engine did not answer, the failure was
    suppressed and the container (which may still run what the tool left behind) stayed until
    `aclose`. Now the removal is logged and tried again, waiting longer each time, and the
    container goes once the engine is back, with the sandbox still open."""
    relay.start()
    box = ContainerSandbox(settings_for(relay.path, runner_state, housekeeping_grace_s=0.5), "docker")
    try:
        assert (await box.run(ECHO)).verdict is Verdict.OK
        relay.stop()  # before the housekeeper's grace: its removal finds no engine
        await asyncio.sleep(1.5)
        assert len(sandbox_containers(box._owner)) == 1  # the instance's label
        relay.start()
        deadline = time.monotonic() + 15
        while sandbox_containers(box._owner):
            assert time.monotonic() < deadline, "the used container was never removed"
            await asyncio.sleep(0.1)
    finally:
        await box.aclose()


async def test_a_removal_the_engine_keeps_failing_does_not_hold_back_the_warm_pool(runner_state: Path) -> None:
    """An engine that fails one container's removal ("device or resource busy", as overlay2 does)
    while it creates others: the retries wait on timers, so the warm pool is refilled at once (a
    retry that slept in the housekeeper once held refills back for 20 s and more), and the
    container is removed when the engine lets it."""
    import docker  # noqa: PLC0415  (the engine's client, to fail one removal as the engine would)

    box = ContainerSandbox(RunnerSettings(state_dir=runner_state, pool_size=2, housekeeping_grace_s=0.05), "docker")
    try:
        assert (await box.run(ECHO)).verdict is Verdict.OK
        deadline = time.monotonic() + 60
        while not (box._pools and all(q.qsize() == 2 for q in box._pools.values()) and not box._used):
            assert time.monotonic() < deadline, "the warm pool never filled"
            await asyncio.sleep(0.1)
        api = box._docker().api
        real = api.remove_container
        stuck: list[str] = []

        def busy(container: str, **kwargs: object) -> None:
            if not stuck or container in stuck:
                stuck.append(container)
                raise docker.errors.APIError("driver overlay2 failed to remove root filesystem: resource busy")
            real(container, **kwargs)

        api.remove_container = busy
        try:
            assert (await box.run(ECHO)).verdict is Verdict.OK  # takes a warm container; its removal fails
            started = time.monotonic()
            while not all(q.qsize() == 2 for q in box._pools.values()):
                assert time.monotonic() - started < 10, "the pool waited on the failing removal"
                await asyncio.sleep(0.1)
            assert len(stuck) >= 1
        finally:
            api.remove_container = real
        deadline = time.monotonic() + 30
        while any(found["Id"] == stuck[0] for found in sandbox_containers(box._owner)):
            assert time.monotonic() < deadline, "the container whose removal failed was never removed"
            await asyncio.sleep(0.2)
    finally:
        await box.aclose()

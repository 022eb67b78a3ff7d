"""A sandbox that dies mid-call is the sandbox's failure, never a verdict on the tool: a container
or bwrap killed from outside is a `SandboxError` (the router audits it as ``sandbox.error``), not
``memory_limit`` or a plain nonzero exit. And a tool held at its pids limit under gVisor keeps its
sandbox, as it does on the other tiers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import docker
import pytest

from runner import BwrapSandbox, ContainerSandbox, ResourceLimits, RunnerSettings, SandboxError, SandboxSpec, Verdict
from tests.conftest import sandbox_containers

# Three processes spinning on CPU with a few MiB between them: nowhere near any memory limit.
SPINNERS = """
# {marker}
import os
for _ in range(2):
    if os.fork() == 0:
        break
while True:
    pass
"""

FORK_BOMB = """
import os, time
made = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        made += 1
except OSError as e:
    print(made, e.errno)
"""


def spinners(marker: str = "") -> SandboxSpec:
    code = SPINNERS.format(marker=marker)
    return SandboxSpec(argv=("python3", "-I", "-c", code), limits=ResourceLimits(timeout_s=30))


async def kill_containers_once_running(owner: str) -> int:
    """SIGKILL (``docker kill``) the sandbox's container a moment after it appears."""
    while not (found := sandbox_containers(owner)):  # noqa: ASYNC110  (polling the engine)
        await asyncio.sleep(0.1)
    await asyncio.sleep(2)
    client = docker.from_env()
    try:
        for item in found:
            client.api.kill(item["Id"])
    finally:
        client.close()
    return len(found)


async def test_a_container_killed_mid_call_is_a_sandbox_error_not_the_memory_limit(container: ContainerSandbox) -> None:
    """Exit 137 only says SIGKILL: the tool used a few MiB, so the memory limit did not do it."""
    killer = asyncio.create_task(kill_containers_once_running(container.owner))
    try:
        with pytest.raises(SandboxError, match=r"worker killed \(signal 9\) mid-call, not at the memory limit"):
            await container.run(spinners())
        assert await killer == 1
    finally:
        killer.cancel()


async def test_a_killed_session_container_is_replaced_for_the_next_call(container: ContainerSandbox) -> None:
    killer = asyncio.create_task(kill_containers_once_running(container.owner))
    try:
        with pytest.raises(SandboxError, match="killed"):
            await container.run(dataclasses.replace(spinners(), session="s"))
        await killer
    finally:
        killer.cancel()
    after = await container.run(SandboxSpec(argv=("sh", "-c", "echo again"), session="s"))
    await container.close_session("s")
    assert (after.verdict, after.stdout, after.start) == (Verdict.OK, b"again\n", "cold")


def bwrap_pids(marker: str) -> list[int]:
    """The bwrap processes (by name) running the tool that carries ``marker`` in its arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if comm == "bwrap" and marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


async def test_bwrap_killed_mid_call_is_a_sandbox_error_not_a_tool_failure(settings: RunnerSettings) -> None:
    """bwrap reports a signalled tool as 128+signo: bwrap's own status "killed by a signal", with no
    timeout or output cap behind it, is the sandbox dying."""
    sandbox = BwrapSandbox(settings)
    assert sandbox.check() is None
    marker = "stockade-kill-" + os.urandom(6).hex()

    async def kill_bwrap() -> list[int]:
        while not (found := bwrap_pids(marker)):  # noqa: ASYNC110  (polling /proc)
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        for pid in found:
            os.kill(pid, signal.SIGKILL)
        return found

    killer = asyncio.create_task(kill_bwrap())
    try:
        with pytest.raises(SandboxError, match=r"bwrap killed by signal 9 \(SIGKILL\) mid-call"):
            await sandbox.run(spinners(marker))
        assert await killer
    finally:
        killer.cancel()
        await sandbox.aclose()


async def test_a_fork_bomb_under_gvisor_is_held_at_the_pids_limit_and_keeps_its_sandbox(
    settings: RunnerSettings,
) -> None:
    """gVisor's own host threads once counted against the tool's pids limit: the sandbox went down
    mid-job (exit 2, the tool's output lost). The tool now gets EAGAIN at its limit, as on runc and
    bwrap, and its output comes back.

    The memory limit is raised out of the way: under gVisor each forked interpreter costs ~3 MiB of
    the sentry's memory (62 sleeping children peaked at 225-293 MiB, against 26 MiB under runc), so
    at the default 256 MiB this bomb was sometimes, and rightly, ended as ``memory_limit``."""
    sandbox = ContainerSandbox(settings, "gvisor")
    assert sandbox.check() is None
    limits = ResourceLimits(pids=64, timeout_s=20, memory_mb=1024)
    try:
        result = await sandbox.run(SandboxSpec(argv=("python3", "-I", "-c", FORK_BOMB), limits=limits))
    finally:
        await sandbox.aclose()
    assert result.verdict is Verdict.OK, (result.verdict, result.detail, result.stderr[-300:])
    made, errno = result.stdout.split()
    assert (int(errno), 32 <= int(made) < 64) == (11, True), result.stdout

"""Containers and staging directories of a router that died without closing its sandbox are
removed by the next one; those of a live router never are."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import docker
import pytest

from runner import ContainerSandbox, ResourceLimits, RunnerSettings, SandboxSpec, Verdict
from tests.conftest import sandbox_containers

CRASHING_ROUTER = """
import asyncio, os, signal, sys
from pathlib import Path
from runner import ContainerSandbox, ResourceLimits, RunnerSettings, SandboxSpec

async def main():
    box = ContainerSandbox(RunnerSettings(state_dir=Path(sys.argv[1]), pool_size=1), sys.argv[2])
    assert box.check() is None, box.check()
    await box.prewarm(ResourceLimits())
    await box.run(SandboxSpec(argv=("true",), session="s"))
    print(box.owner, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def staging_of(pid: int) -> list[str]:
    """Staging directories made by process ``pid`` (of this pid namespace)."""
    prefix = f"c-{os.stat('/proc/self/ns/pid').st_ino:x}-{pid:x}-"
    return [name for name in os.listdir(RunnerSettings().container_staging_dir) if name.startswith(prefix)]


async def wait_for(condition: object, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition() and time.monotonic() < end:  # type: ignore[operator]  # noqa: ASYNC110  (polling Docker)
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("tier", ["docker", "gvisor"])
async def test_what_a_killed_router_left_is_removed_and_a_live_ones_is_not(tier: str, runner_state: Path) -> None:
    settings = RunnerSettings(state_dir=runner_state, pool_size=1)
    live = ContainerSandbox(settings, tier)  # type: ignore[arg-type]
    assert live.check() is None
    await live.prewarm(ResourceLimits())
    await live.run(SandboxSpec(argv=("true",), session="kept"))
    crashed = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_ROUTER, str(runner_state), tier,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(crashed.communicate(), 120)
    assert crashed.returncode == -signal.SIGKILL, stderr[-2000:]
    owner = stdout.decode().strip()
    try:
        assert len(sandbox_containers(owner)) >= 2  # its warm container and its session's
        made = staging_of(crashed.pid)
        restarted = ContainerSandbox(settings, tier)  # type: ignore[arg-type]
        assert restarted.check() is None
        await wait_for(lambda: not sandbox_containers(owner))
        assert sandbox_containers(owner) == []
        assert made
        assert staging_of(crashed.pid) == []
        # The live router's containers are untouched, and it still serves its session.
        assert len(sandbox_containers(live.owner)) >= 2
        result = await live.run(SandboxSpec(argv=("true",), session="kept"))
        assert result.verdict is Verdict.OK
        await restarted.aclose()
    finally:
        await live.aclose()
        client = docker.from_env()
        for found in sandbox_containers(owner):  # without the fix: do not leak them past the test
            client.api.remove_container(found["Id"], force=True)
        client.close()
        for name in staging_of(crashed.pid):
            shutil.rmtree(RunnerSettings().container_staging_dir / name, ignore_errors=True)

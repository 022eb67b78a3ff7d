"""The docker and gvisor tiers: warm pools, cold starts, sessions and verdicts, on a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runner import (
    ContainerSandbox,
    EgressRule,
    InputFile,
    ResourceLimits,
    RunnerSettings,
    SandboxSpec,
    SandboxUnavailable,
    Verdict,
)
from runner.python import parse_result, python_job
from tests.conftest import ALLOWED_HOST, Upstream, sandbox_containers


@pytest.fixture
def settings(runner_state: Path) -> RunnerSettings:
    return RunnerSettings(state_dir=runner_state, pool_size=1, egress_hosts={ALLOWED_HOST: "127.0.0.1"})


@pytest.fixture(params=["docker", "gvisor"])
async def box(request: pytest.FixtureRequest, settings: RunnerSettings) -> AsyncIterator[ContainerSandbox]:
    sandbox = ContainerSandbox(settings, request.param)
    assert sandbox.check() is None
    yield sandbox
    await sandbox.aclose()


def job(source: str, **args: object) -> SandboxSpec:
    return python_job(source, "main", args, interpreter="/usr/bin/python3", limits=ResourceLimits())


async def test_first_call_is_cold_then_the_pool_serves_warm(box: ContainerSandbox) -> None:
    first = await box.run(job("def main(x):\n    return x + 1", x=1))
    assert (first.verdict, first.start, parse_result(first.stdout)) == (Verdict.OK, "cold", 2)
    await box.prewarm(ResourceLimits())
    second = await box.run(job("def main(x):\n    return x * 10", x=4))
    assert (second.verdict, second.start, parse_result(second.stdout)) == (Verdict.OK, "warm", 40)
    assert second.tier == box.tier


async def test_a_warm_container_is_never_reused(box: ContainerSandbox) -> None:
    await box.prewarm(ResourceLimits(), size=1)
    leave = job("def main():\n    open('/tmp/mark', 'w').write('left by call one')")
    look = job("import os\ndef main():\n    return os.path.exists('/tmp/mark')")
    await box.run(leave)
    await box.prewarm(ResourceLimits(), size=1)
    assert parse_result((await box.run(look)).stdout) is False


async def test_session_sandbox_keeps_state_within_a_session_only(box: ContainerSandbox) -> None:
    write = job("def main():\n    open('/tmp/notes', 'a').write('x')\n    return open('/tmp/notes').read()")
    spec_a = SandboxSpec(argv=write.argv, stdin=write.stdin, kind="python", session="s-a")
    spec_b = SandboxSpec(argv=write.argv, stdin=write.stdin, kind="python", session="s-b")
    runs = [await box.run(spec_a), await box.run(spec_a), await box.run(spec_b)]
    assert [parse_result(r.stdout) for r in runs] == ["x", "xx", "x"]
    assert [r.start for r in runs] == ["cold", "session", "cold"]
    await box.close_session("s-a")
    await box.close_session("s-b")
    assert sandbox_containers(box.owner) == []


async def test_each_session_job_with_egress_gets_a_bridge_and_one_without_finds_none(
    box: ContainerSandbox, upstream: Upstream
) -> None:
    """The bridge to the proxy lives for one job: the next job with egress starts its own, and a
    job without egress finds nothing listening on 127.0.0.1:3128."""
    fetch = f"""
import socket, ssl, sys, urllib.request
try:
    socket.create_connection(('127.0.0.1', 3128), timeout=5).close()
except OSError:
    sys.exit(print('no bridge'))
context = ssl.create_default_context(cafile='/in/ca.pem')
print(urllib.request.urlopen('https://{ALLOWED_HOST}:{upstream.port}/', context=context, timeout=10).read().decode())
"""
    egress = {"inputs": (InputFile("ca.pem", upstream.ca_pem),), "egress": (EgressRule(ALLOWED_HOST, upstream.port),)}
    outputs = []
    for with_egress in (True, True, False, True):
        spec = SandboxSpec(argv=("python3", "-I", "-c", fetch), session="s", **(egress if with_egress else {}))  # type: ignore[arg-type]
        result = await box.run(spec)
        outputs.append(result.stdout.decode().strip() or result.stderr.decode()[-300:])
    await box.close_session("s")
    hello = "hello from the allowlisted upstream"
    assert outputs == [hello, hello, "no bridge", hello]


async def test_command_tools_run_as_nobody_with_their_exit_code(box: ContainerSandbox) -> None:
    result = await box.run(SandboxSpec(argv=("/bin/sh", "-c", "id -u; echo oops >&2; exit 7")))
    assert (result.verdict, result.exit_code) == (Verdict.NONZERO_EXIT, 7)
    assert (result.stdout, result.stderr) == (b"65534\n", b"oops\n")


async def test_python_tool_errors_are_a_nonzero_exit_with_the_traceback(box: ContainerSandbox) -> None:
    result = await box.run(job("def main():\n    raise ValueError('bad input')"))
    assert result.verdict is Verdict.NONZERO_EXIT
    assert b"ValueError: bad input" in result.stderr


async def test_a_tool_flooding_its_output_is_stopped_at_once(box: ContainerSandbox) -> None:
    """Over the output cap the call ends within moments, not after Docker's client timeout."""
    flood = SandboxSpec(argv=("python3", "-I", "-c", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"),
                        limits=ResourceLimits(output_bytes=200_000, timeout_s=20))  # fmt: skip
    results = [await box.run(flood) for _ in range(3)]
    assert [r.verdict for r in results] == [Verdict.OUTPUT_LIMIT] * 3
    assert max(r.usage.wall_s for r in results) < 5


async def test_used_containers_are_destroyed(box: ContainerSandbox) -> None:
    await box.run(job("def main():\n    return 1"))
    await asyncio.sleep(0)  # let the background removal start
    for _ in range(100):
        running = sandbox_containers(box.owner)
        if len(running) <= 1:  # at most the one pooled replacement remains
            break
        await asyncio.sleep(0.1)
    assert len(running) <= 1


async def test_unbuilt_image_is_unavailable(settings: RunnerSettings) -> None:
    sandbox = ContainerSandbox(settings.model_copy(update={"image": "stockade-sandbox:no-such-tag"}), "docker")
    assert "build-image" in (sandbox.check() or "")
    with pytest.raises(SandboxUnavailable):
        await sandbox.run(job("def main():\n    return 1"))
    await sandbox.aclose()


async def test_unreachable_engine_is_unavailable(settings: RunnerSettings) -> None:
    sandbox = ContainerSandbox(settings.model_copy(update={"docker_host": "unix:///nonexistent.sock"}), "gvisor")
    assert "unreachable" in (sandbox.check() or "")
    await sandbox.aclose()

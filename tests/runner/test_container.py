"""The docker and gvisor tiers: warm pools, cold starts, sessions and verdicts, on a real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runner import (
    ContainerSandbox,
    EgressRule,
    InputFile,
    OutputCaps,
    ResourceLimits,
    RunnerSettings,
    SandboxError,
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


LIMITS_THEN_ALLOCATE = """
import os
for v1, v2 in (("memory/memory.limit_in_bytes", "memory.max"), ("pids/pids.max", "pids.max")):
    path = "/sys/fs/cgroup/" + (v1 if os.path.exists("/sys/fs/cgroup/" + v1) else v2)
    print(open(path).read().strip(), end=" ")
print(flush=True)
b = bytearray(200 << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
print("allocated")
"""


async def test_each_docker_session_call_runs_under_its_own_limits(settings: RunnerSettings) -> None:
    """A session's container is set to each call's limits: a later call allowed less than the
    first gets less, and one allowed more again gets more."""
    sandbox = ContainerSandbox(settings, "docker")
    assert sandbox.check() is None
    big, small = ResourceLimits(memory_mb=512, pids=256), ResourceLimits(memory_mb=64, pids=16)
    try:
        argv = ("python3", "-I", "-c", LIMITS_THEN_ALLOCATE)
        runs = [await sandbox.run(SandboxSpec(argv=argv, limits=limits, session="s")) for limits in (big, small, big)]
    finally:
        await sandbox.aclose()
    assert [(r.verdict, r.start) for r in runs] == [
        (Verdict.OK, "cold"), (Verdict.MEMORY_LIMIT, "session"), (Verdict.OK, "session")
    ], [(r.detail, r.stderr[-300:]) for r in runs]  # fmt: skip
    seen = [f"{512 << 20} 256 ", f"{64 << 20} 16 ", f"{512 << 20} 256 "]
    assert [r.stdout.decode().split("\n")[0] for r in runs] == seen


async def test_a_gvisor_session_refuses_a_call_with_other_limits_and_keeps_serving_its_own(
    settings: RunnerSettings,
) -> None:
    """runsc cannot change a running sandbox's limits: a session call that asks for others is
    refused (never run under the first call's), and the session goes on for calls with its limits."""
    sandbox = ContainerSandbox(settings, "gvisor")
    assert sandbox.check() is None
    big, small = ResourceLimits(memory_mb=512), ResourceLimits(memory_mb=64)
    try:
        first = await sandbox.run(SandboxSpec(argv=("true",), limits=big, session="s"))
        with pytest.raises(SandboxError, match="gVisor cannot change"):
            await sandbox.run(SandboxSpec(argv=("true",), limits=small, session="s"))
        again = await sandbox.run(SandboxSpec(argv=("true",), limits=big, session="s"))
    finally:
        await sandbox.aclose()
    assert [(r.verdict, r.start) for r in (first, again)] == [(Verdict.OK, "cold"), (Verdict.OK, "session")]


def staging_dirs(settings: RunnerSettings) -> set[str]:
    return {name for name in os.listdir(settings.container_staging_dir) if name.startswith("c-")}


async def cancel_while_starting(box: ContainerSandbox, settings: RunnerSettings, session: str | None) -> None:
    """Start a cold call and cancel it once its container is being made (its staging directory is there)."""
    before = staging_dirs(settings)
    call = asyncio.create_task(box.run(SandboxSpec(argv=("true",), session=session)))
    while staging_dirs(settings) <= before:  # noqa: ASYNC110  (polling the file system)
        await asyncio.sleep(0.005)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_a_call_cancelled_while_its_container_starts_leaves_nothing_behind(
    box: ContainerSandbox, settings: RunnerSettings
) -> None:
    """The container finishes starting (a thread cannot be stopped) and is then removed with its
    staging directory: soon after, or by `aclose` if that comes first."""
    before = staging_dirs(settings)
    await cancel_while_starting(box, settings, None)
    await cancel_while_starting(box, settings, "s")
    for _ in range(100):
        if not sandbox_containers(box.owner) and staging_dirs(settings) == before:
            break
        await asyncio.sleep(0.1)
    assert (sandbox_containers(box.owner), staging_dirs(settings) - before) == ([], set())
    await cancel_while_starting(box, settings, None)
    await box.aclose()
    assert (sandbox_containers(box.owner), staging_dirs(settings) - before) == ([], set())


async def test_a_session_call_cancelled_mid_job_never_hands_its_reply_to_the_next_call(box: ContainerSandbox) -> None:
    """The cancelled job may still be running in the session's container: the next call must get
    its own output (from a fresh container), never the cancelled job's frames."""
    first = await box.run(SandboxSpec(argv=("sh", "-c", "echo call-1"), session="s"))
    assert first.stdout == b"call-1\n"
    cut = asyncio.create_task(box.run(SandboxSpec(argv=("sh", "-c", "sleep 3; echo CANCELLED"), session="s")))
    await asyncio.sleep(1)
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut
    replies = [await box.run(SandboxSpec(argv=("sh", "-c", f"echo call-{n}"), session="s")) for n in (3, 4)]
    await box.close_session("s")
    assert [(r.verdict, r.stdout) for r in replies] == [(Verdict.OK, b"call-3\n"), (Verdict.OK, b"call-4\n")]


CHILD_OOM = """
import os
pid = os.fork()
if pid == 0:
    b = bytearray(200 << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    os._exit(0)
os.waitpid(pid, 0)
print("parent fine")
"""


async def test_an_oom_kill_is_the_jobs_verdict_and_not_the_next_session_jobs(box: ContainerSandbox) -> None:
    """A child the kernel killed at the memory limit makes the job's verdict memory_limit even
    though the tool exited 0 (as on bwrap); the session's next job is not blamed for it."""
    limits = ResourceLimits(memory_mb=128)
    oom = await box.run(SandboxSpec(argv=("python3", "-I", "-c", CHILD_OOM), limits=limits, session="s"))
    plain = await box.run(SandboxSpec(argv=("sh", "-c", "exit 3"), limits=limits, session="s"))
    await box.close_session("s")
    assert oom.verdict is Verdict.MEMORY_LIMIT, (oom.verdict, oom.detail, oom.stdout)
    assert (plain.verdict, plain.exit_code) == (Verdict.NONZERO_EXIT, 3), plain.detail


# What a tool (the worker's uid) can change of PID 1 that its children would inherit.
TAMPERING = {
    "a 4 KiB file cap": "resource.prlimit(1, resource.RLIMIT_FSIZE, (4096, 4096))",
    "the lowest priority": "os.setpriority(os.PRIO_PROCESS, 1, 19)",
    "the idle scheduler": "os.sched_setscheduler(1, os.SCHED_IDLE, os.sched_param(0))",
    "one CPU": "os.sched_setaffinity(1, {min(os.sched_getaffinity(1))})",
}
LOOK = """
import os, resource

def main():
    return [list(resource.getrlimit(resource.RLIMIT_FSIZE)), os.getpriority(os.PRIO_PROCESS, 0),
            os.sched_getscheduler(0), sorted(os.sched_getaffinity(0))]
"""


@pytest.mark.parametrize("change", list(TAMPERING))
async def test_a_session_job_that_changes_the_workers_limits_leaves_them_to_no_later_job(
    box: ContainerSandbox, change: str
) -> None:
    """The tool runs as the worker's uid, so it can lower the worker's rlimits (prlimit on PID 1),
    renice it, put it on the idle scheduler or one CPU, which every later job of the session would
    inherit. The next job is not run (an error naming why) and the container goes; the one after
    runs in a fresh sandbox as the first did."""
    tamper = job(f"import os, resource\ndef main():\n    {TAMPERING[change]}\n    return 'done'\n")
    look = job(LOOK)
    first = await box.run(SandboxSpec(argv=look.argv, stdin=look.stdin, kind="python", session="s"))
    changed = await box.run(SandboxSpec(argv=tamper.argv, stdin=tamper.stdin, kind="python", session="s"))
    refused = await box.run(SandboxSpec(argv=look.argv, stdin=look.stdin, kind="python", session="s"))
    fresh = await box.run(SandboxSpec(argv=look.argv, stdin=look.stdin, kind="python", session="s"))
    await box.close_session("s")
    if changed.verdict is not Verdict.OK:  # the tier does not let a tool do it (gVisor: the idle scheduler)
        assert "Operation not permitted" in changed.stderr.decode() or "Errno" in changed.stderr.decode()
        assert (refused.verdict, fresh.verdict) == (Verdict.OK, Verdict.OK)
        return
    assert parse_result(changed.stdout) == "done"
    assert refused.verdict is Verdict.ERROR
    assert "changed the sandbox's own resource limits or priority" in refused.detail
    assert fresh.verdict is Verdict.OK, fresh.detail
    assert parse_result(fresh.stdout) == parse_result(first.stdout)
    assert fresh.start == "cold"


SCAN_OWN_MEMORY = r"""
import os, re

def main(secret=""):
    found = set()
    pattern = re.compile(rb"S3CRET-OF-JOB-ONE-[0-9a-f]{16}")
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or fields[-1] in ("[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for at in range(start, end, 1 << 20):
                try:
                    mem.seek(max(at - 64, start))
                    data = mem.read(min(end, at + (1 << 20)) - max(at - 64, start))
                except (OSError, OverflowError):
                    break
                found.update(match.decode() for match in pattern.findall(data))
    return sorted(found)
"""


async def test_a_session_python_job_finds_nothing_of_an_earlier_jobs_arguments_in_its_memory(
    box: ContainerSandbox,
) -> None:
    """A python tool runs in a fork of the worker and can read all of its own memory: the
    session's later jobs must be forked from a process that never held an earlier job's
    arguments or environment (not even in freed memory)."""
    secret, placeholder = (f"S3CRET-OF-JOB-ONE-{os.urandom(8).hex()}" for _ in range(2))
    first = dataclasses.replace(job(SCAN_OWN_MEMORY, secret=secret), session="s", env={"CREDENTIAL": placeholder})
    later = dataclasses.replace(job(SCAN_OWN_MEMORY), session="s")
    results = [await box.run(first), await box.run(later)]
    await box.close_session("s")
    assert [r.start for r in results] == ["cold", "session"]
    found = [parse_result(r.stdout) for r in results]
    assert {secret, placeholder} <= set(found[0]), found  # the scan sees a job's own
    assert found[1] == [], found


async def test_a_session_call_gets_none_of_an_earlier_calls_outputs(box: ContainerSandbox) -> None:
    """``/out`` is emptied after every session call, collected or not, however the tool left it
    (nested deep, directories made read-only)."""
    leave = """
import os
open("/out/first.txt", "w").write("one")
path = "/out"
for _ in range(200):
    path += "/d"
    os.mkdir(path)
    open(path + "/f", "w").write("x")
os.chmod("/out/d/d", 0o500)
os.chmod("/out/d", 0)
"""
    look = "import os\nopen('/out/second.txt', 'w').write('two')\nprint(sorted(os.listdir('/out')))"
    first = await box.run(SandboxSpec(argv=("python3", "-I", "-c", leave), session="s"))
    second = await box.run(SandboxSpec(argv=("python3", "-I", "-c", look), session="s", outputs=OutputCaps(),
                                       call_id="c-second"))  # fmt: skip
    await box.close_session("s")
    assert (first.verdict, second.verdict, second.start) == (Verdict.OK, Verdict.OK, "session"), second.stderr
    assert second.stdout == b"['second.txt']\n"
    assert [record.path for record in second.artifacts] == ["second.txt"]


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

"""The bwrap tier against hostile and greedy jobs: real bubblewrap, real kernel limits."""

from __future__ import annotations

import ast
import asyncio
import os
import resource
import socket
import textwrap
import time
from pathlib import Path

import pytest

from runner import (
    BwrapSandbox,
    ResourceLimits,
    RunnerSettings,
    SandboxSpec,
    SandboxUnavailable,
    Verdict,
    python_job,
)
from runner.bwrap import _PREPARE
from runner.python import parse_result

SETTINGS = RunnerSettings()


@pytest.fixture
def sandbox() -> BwrapSandbox:
    return BwrapSandbox(SETTINGS)


def py(code: str, **limits: float) -> SandboxSpec:
    return SandboxSpec(argv=("/usr/bin/python3", "-I", "-c", textwrap.dedent(code)), limits=ResourceLimits(**limits))  # type: ignore[arg-type]


def sandbox_uids() -> set[int]:
    """Host uids of live processes in the sandbox uid range."""
    found = set()
    low, high = SETTINGS.uid_base, SETTINGS.uid_base + SETTINGS.max_concurrent
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                state = next((x for x in status.splitlines() if x.startswith("State:")), "")
                if low <= uid < high and "Z" not in state.split()[1:2]:
                    found.add(uid)
    return found


async def wait_until_gone(deadline_s: float = 3.0) -> set[int]:
    end = time.monotonic() + deadline_s
    while (left := sandbox_uids()) and time.monotonic() < end:  # noqa: ASYNC110  (polling /proc)
        await asyncio.sleep(0.05)
    return left


async def test_python_job_returns_its_result_and_usage(sandbox: BwrapSandbox) -> None:
    job = python_job(
        "def main(a, b):\n    print('noise')\n    return {'sum': a + b}",
        "main",
        {"a": 2, "b": 3},
        interpreter=SETTINGS.python,
        limits=ResourceLimits(),
    )
    result = await sandbox.run(job)
    assert result.verdict is Verdict.OK
    assert parse_result(result.stdout) == {"sum": 5}
    assert result.stderr == b"noise\n"  # the tool's prints never mix with its result
    assert result.tier == "bwrap"
    assert result.usage.wall_s > 0
    assert result.usage.cpu_s > 0
    assert result.usage.max_rss_kb > 1000


async def test_runs_as_an_unprivileged_host_uid_per_sandbox(sandbox: BwrapSandbox) -> None:
    """As root, each concurrent sandbox gets its own host uid (RLIMIT_NPROC counts per uid)."""
    assert os.geteuid() == 0, "the test command runs as root, as CI does"
    job = py("import os, time; print(os.getuid()); time.sleep(1)")
    runs = asyncio.gather(*(sandbox.run(job) for _ in range(3)))
    await asyncio.sleep(0.5)
    seen = sandbox_uids()
    results = await runs
    assert all(r.stdout.strip() == b"65534" for r in results)  # nobody, inside
    assert len(seen) == 3
    assert all(SETTINGS.uid_base <= uid < SETTINGS.uid_base + SETTINGS.max_concurrent for uid in seen)


async def test_sandbox_cannot_see_host_files(sandbox: BwrapSandbox, tmp_path: Path) -> None:
    canary = tmp_path / "canary.txt"
    canary.write_text("host secret")
    project = Path(__file__).resolve().parents[2]
    job = py(f"""
        import os
        for p in ({str(canary)!r}, {str(project / "pyproject.toml")!r}, "/etc/shadow", "/etc/passwd",
                  "/root", "/home", "/var", "/run", "/srv"):
            print(p, os.path.exists(p))
        print("tmp", sorted(os.listdir("/tmp")))
        print("etc", sorted(os.listdir("/etc")))
    """)
    result = await sandbox.run(job)
    lines = result.stdout.decode().splitlines()
    assert result.verdict is Verdict.OK, result.stderr
    assert all(line.endswith("False") for line in lines[:9]), lines
    assert lines[9] == "tmp []"
    assert set(eval(lines[10][4:])) <= {"ld.so.cache", "localtime", "alternatives"}  # noqa: S307


async def test_sandbox_has_no_network(sandbox: BwrapSandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        job = py(f"""
            import socket
            print(open("/proc/net/dev").read().count(":"))
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as exc:
                print("refused", exc.errno)
        """)
        result = await sandbox.run(job)
        interfaces, outcome = result.stdout.decode().split("\n")[:2]
        assert interfaces == "1"  # only the sandbox's own loopback
        assert outcome.startswith("refused")
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's listener
    finally:
        server.close()


async def test_environment_is_empty_even_in_pid_1(sandbox: BwrapSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOST_CANARY_SECRET", "hunter2")
    job = py("""
        import os
        print(sorted(os.environ))
        leaked = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if b"hunter2" in open(f"/proc/{pid}/environ", "rb").read():
                        leaked.append(pid)
                except OSError:
                    pass
        print(leaked)
    """)
    result = await sandbox.run(job)
    names, leaked = result.stdout.decode().splitlines()
    assert "HOST_CANARY_SECRET" not in names
    assert leaked == "[]"


async def test_timeout_kills_the_whole_process_tree(sandbox: BwrapSandbox) -> None:
    job = SandboxSpec(
        argv=("/bin/sh", "-c", "setsid sleep 300 & (sleep 300 &) ; sleep 300"),
        limits=ResourceLimits(timeout_s=1),
    )
    started = time.monotonic()
    result = await sandbox.run(job)
    assert result.verdict is Verdict.TIMEOUT
    assert time.monotonic() - started < 3
    assert await wait_until_gone() == set()


async def test_cancelling_a_run_kills_the_sandbox(sandbox: BwrapSandbox) -> None:
    task = asyncio.create_task(sandbox.run(SandboxSpec(argv=("/bin/sleep", "300"))))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await wait_until_gone() == set()


async def test_cpu_share_holds_a_spinning_tool_until_the_wall_clock(sandbox: BwrapSandbox) -> None:
    """With a cgroup, ``cpus`` is a share (its CPU quota), not a budget of CPU seconds: a spinning
    tool is throttled, and the wall clock ends it."""
    result = await sandbox.run(py("while True: pass", timeout_s=2, cpus=0.25))
    assert result.verdict is Verdict.TIMEOUT
    assert "wall clock" in result.detail
    assert result.usage.wall_s < 4


async def test_without_a_cgroup_the_cpu_time_limit_is_a_timeout() -> None:
    """Where no cgroup is usable and settings accept that, per-process rlimits still apply."""
    sandbox = BwrapSandbox(RunnerSettings(cgroup_parent="cgroup.procs", cgroup_required=False))
    result = await sandbox.run(py("while True: pass", timeout_s=10, cpus=0.1))
    assert result.verdict is Verdict.TIMEOUT
    assert "CPU" in result.detail
    assert 0.9 <= result.usage.cpu_s < 3


async def test_without_a_usable_cgroup_the_tier_is_unavailable() -> None:
    """Fail closed: no cgroup (here, a parent that cannot be a directory) means no sandbox."""
    sandbox = BwrapSandbox(RunnerSettings(cgroup_parent="cgroup.procs"))
    problem = sandbox.check() or ""
    assert "cgroup" in problem
    assert "STOCKADE_RUNNER__CGROUP_REQUIRED" in problem
    with pytest.raises(SandboxUnavailable):
        await sandbox.run(SandboxSpec(argv=("/bin/true",)))


async def test_output_is_capped_while_streaming(sandbox: BwrapSandbox) -> None:
    result = await sandbox.run(py("import sys\nwhile True: sys.stdout.write('x' * 65536)", output_bytes=100_000))
    assert result.verdict is Verdict.OUTPUT_LIMIT
    assert len(result.stdout) + len(result.stderr) == 100_000


async def test_memory_limit(sandbox: BwrapSandbox) -> None:
    result = await sandbox.run(py("blob = bytearray(600 << 20)", memory_mb=128))
    assert result.verdict is Verdict.MEMORY_LIMIT


async def test_fork_bomb_is_contained_by_the_process_limit(sandbox: BwrapSandbox) -> None:
    job = py(
        """
        import os, time
        made = 0
        try:
            for _ in range(10_000):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                made += 1
        except OSError as exc:
            print(made, exc.errno)
    """,
        pids=16,
        timeout_s=10,
    )
    result = await sandbox.run(job)
    made, errno = result.stdout.split()
    assert int(made) < 16
    assert int(errno) == 11  # EAGAIN: the per-uid process limit held
    assert await wait_until_gone() == set()


async def test_tmp_is_a_private_size_capped_tmpfs(sandbox: BwrapSandbox) -> None:
    job = py("""
        try:
            with open("/tmp/fill", "wb") as f:
                for _ in range(200):
                    f.write(b"\\0" * (1 << 20))
            print("filled")
        except OSError as exc:
            print("stopped", exc.errno)
    """)
    result = await sandbox.run(job)
    assert result.stdout.split()[0] == b"stopped"  # 64 MiB tmpfs (or the file size limit) stopped it


async def test_large_stdin_is_delivered_whole(sandbox: BwrapSandbox) -> None:
    result = await sandbox.run(SandboxSpec(argv=("/usr/bin/wc", "-c"), stdin=b"y" * (3 << 20)))
    assert result.stdout.strip() == str(3 << 20).encode()


async def test_nonzero_exit_is_reported(sandbox: BwrapSandbox) -> None:
    result = await sandbox.run(SandboxSpec(argv=("/bin/sh", "-c", "echo oops >&2; exit 3")))
    assert result.verdict is Verdict.NONZERO_EXIT
    assert result.exit_code == 3
    assert result.stderr == b"oops\n"


async def test_nested_user_namespaces_are_refused(sandbox: BwrapSandbox) -> None:
    result = await sandbox.run(
        py("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
    """)
    )
    rc, errno = result.stdout.split()
    assert rc == b"-1"
    assert int(errno) != 0


async def test_nothing_runs_when_the_move_into_the_cgroup_fails(tmp_path: Path) -> None:
    """The sandbox's first process execs the rest only once it is in every hierarchy of its group."""
    marker = tmp_path / "ran"
    mover = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", _PREPARE, "sh", "65536", "2048", "64", "-", "-",
        str(tmp_path / "no-such-group" / "cgroup.procs"), "--",
        "/usr/bin/touch", str(marker), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await mover.communicate()
    assert mover.returncode == 125
    assert stderr.startswith(b"stockade: could not enter the sandbox cgroup")
    assert not marker.exists()


async def test_missing_bwrap_is_unavailable_not_a_crash() -> None:
    sandbox = BwrapSandbox(RunnerSettings(bwrap="no-such-bwrap-binary"))
    assert "apt-get install bubblewrap" in (sandbox.check() or "")
    with pytest.raises(SandboxUnavailable):
        await sandbox.run(SandboxSpec(argv=("/bin/true",)))


READ_LIMITS = """
import resource
names = ("AS", "FSIZE", "NOFILE", "CORE", "CPU", "NPROC")
print({n: resource.getrlimit(getattr(resource, "RLIMIT_" + n)) for n in names})
"""


@pytest.mark.parametrize("cgroup", [True, False], ids=["with-cgroup", "rlimits-only"])
async def test_the_tool_runs_under_exactly_the_rlimits_it_was_given(cgroup: bool) -> None:
    """Soft and hard rlimits both, so the tool cannot raise them; CPU and process count only
    where no cgroup bounds the sandbox as a whole."""
    settings = SETTINGS if cgroup else RunnerSettings(cgroup_parent="cgroup.procs", cgroup_required=False)
    sandbox = BwrapSandbox(settings)
    result = await sandbox.run(py(READ_LIMITS, memory_mb=300, timeout_s=7, pids=40))
    assert result.verdict is Verdict.OK, result
    seen = ast.literal_eval(result.stdout.decode())
    unlimited = resource.RLIM_INFINITY
    assert seen["AS"] == (300 << 20, 300 << 20)
    assert seen["FSIZE"] == (settings.file_size_mb << 20,) * 2
    assert seen["NOFILE"] == (settings.open_files,) * 2
    assert seen["CORE"] == (0, 0)
    if cgroup:
        assert seen["CPU"] == (unlimited, unlimited)  # the cgroup's quota and the timeout bound it
    else:
        assert seen["CPU"] == (7, 7)
        assert seen["NPROC"] == (40, 40)


async def test_nothing_runs_when_an_rlimit_cannot_be_set(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    mover = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", _PREPARE, "sh", "not-a-number", "2048", "64", "-", "-", "--",
        "/usr/bin/touch", str(marker), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await mover.communicate()
    assert mover.returncode == 125
    assert b"stockade: could not set the sandbox rlimits" in stderr
    assert not marker.exists()

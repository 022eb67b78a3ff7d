"""The bwrap tier's own cgroup and tmpfs: all of a sandbox's processes together are held to its
memory, pids and CPU limits; its /tmp is capped in files as well as bytes; nothing of either
outlives the sandbox; and the sandbox's mountinfo names no host path."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from runner import BwrapSandbox, EgressRule, InputFile, OutputCaps, ResourceLimits, RunnerSettings, SandboxSpec, Verdict
from runner.cgroup import CONTROLLERS, Cgroups
from runner.files import mount_tmpfs
from tests.containment.test_containment import sandbox_uid_processes

MiB = 1 << 20

# Eight children each take and touch 100 MiB, then hold it for two seconds; the parent reports how
# each ended (9: killed). Under RLIMIT_AS alone all eight fit: 800 MiB against a 256 MiB limit.
EIGHT_CHILDREN = """
import os, time
children = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        blob = b"\\1" * (100 << 20)
        time.sleep(2)
        os._exit(0)
    children.append(pid)
print(*(os.waitpid(pid, 0)[1] & 0x7F for pid in children))
"""


def py(code: str, **limits: float) -> SandboxSpec:
    return SandboxSpec(argv=("/usr/bin/python3", "-I", "-c", textwrap.dedent(code)), limits=ResourceLimits(**limits))  # type: ignore[arg-type]


def cgroup_mounts() -> list[Path]:
    """Where this host mounts cgroup hierarchies (v1 and v2)."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[fields.index("-") + 1] in ("cgroup", "cgroup2"):
            mounts.append(Path(fields[4]))
    return mounts


def cgroups_under(name: str) -> list[Path]:
    """Every cgroup directory, in every hierarchy, that is or lies below a directory ``name``."""
    found = []
    for mount in cgroup_mounts():
        for current, _dirs, _files in os.walk(mount):
            if name in Path(current).relative_to(mount).parts:
                found.append(Path(current))
    return found


def memory_high_water(name: str) -> int:
    """The memory high-water mark of the cgroup ``name`` (hierarchical: its children's included)."""
    for group in cgroups_under(name):
        for marker in ("memory.max_usage_in_bytes", "memory.peak"):  # v1, v2
            if group.name == name and (group / marker).exists():
                return int((group / marker).read_text())
    raise AssertionError(f"no memory cgroup {name}")


def host_staging_mounts(state_dir: Path) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(state_dir) in line]


@pytest.fixture
def parent() -> str:
    """A cgroup parent of this test's own, so concurrent runs elsewhere do not count."""
    return "stockade-test-" + os.urandom(4).hex()


@pytest.fixture
async def bwrap(runner_state: Path, parent: str) -> AsyncIterator[BwrapSandbox]:
    """The bwrap tier, its sandboxes' cgroups under ``parent`` below this process's own cgroup."""
    box = BwrapSandbox(RunnerSettings(state_dir=runner_state, cgroup_parent=parent))
    assert box.check() is None
    yield box
    await box.aclose()


@pytest.fixture
async def delegated(runner_state: Path, parent: str) -> AsyncIterator[BwrapSandbox]:
    """The bwrap tier with an absolute cgroup parent (as if delegated to stockade), which stays
    after the runs: its hierarchical memory high-water mark includes its removed children's."""
    box = BwrapSandbox(RunnerSettings(state_dir=runner_state, cgroup_parent="/" + parent))
    assert box.check() is None
    yield box
    await box.aclose()
    for group in sorted(cgroups_under(parent), key=lambda p: len(p.parts), reverse=True):
        group.rmdir()


async def no_sandbox_processes() -> bool:
    for _ in range(80):
        if not sandbox_uid_processes():
            return True
        await asyncio.sleep(0.1)
    return False


# -- memory ---------------------------------------------------------------------------------


async def test_processes_together_are_held_to_the_memory_limit(delegated: BwrapSandbox, parent: str) -> None:
    result = await delegated.run(py(EIGHT_CHILDREN, memory_mb=256, timeout_s=30))
    assert result.verdict is Verdict.MEMORY_LIMIT, (result.verdict, result.detail, result.stderr[-300:])
    assert "256 MiB" in result.detail
    killed = result.stdout.split().count(b"9")
    assert killed >= 4  # at most two of the eight 100 MiB children fit at once
    # It got close to the limit and never past it, but for the kernel's grace to OOM-killed
    # processes (a charge batch, so that they can exit); unconfined it would have passed 800 MiB.
    high_water = memory_high_water(parent)
    assert 200 * MiB < high_water <= 257 * MiB
    assert [group.name for group in cgroups_under(parent)] == [parent] * len(CONTROLLERS)  # its group is gone
    after = await delegated.run(py("print('still fine')"))
    assert (after.verdict, after.stdout) == (Verdict.OK, b"still fine\n")


async def test_an_oom_kill_of_the_tool_itself_is_a_memory_limit(bwrap: BwrapSandbox, parent: str) -> None:
    """The tool is one process under RLIMIT_AS, but its /tmp files count in its memory too."""
    job = py(
        """
        import os
        blob = b"\\1" * (90 << 20)
        with open("/tmp/fill", "wb") as f:
            for _ in range(60):
                f.write(b"\\1" * (1 << 20))
        print("not reached")
        """,
        memory_mb=128,
        timeout_s=20,
    )
    result = await bwrap.run(job)
    assert result.verdict is Verdict.MEMORY_LIMIT, (result.verdict, result.detail, result.stderr[-300:])
    assert b"not reached" not in result.stdout
    assert cgroups_under(parent) == []


# -- processes and CPU ----------------------------------------------------------------------


async def test_fork_bomb_is_held_by_the_sandbox_pids_limit(bwrap: BwrapSandbox, parent: str) -> None:
    """With a cgroup there is no per-uid RLIMIT_NPROC: the group's pids.max is what stops it."""
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
        timeout_s=20,
    )
    result = await bwrap.run(job)
    made, errno = result.stdout.split()
    assert 8 <= int(made) < 16  # bwrap and the tool count too
    assert int(errno) == 11  # EAGAIN
    assert await no_sandbox_processes()
    assert cgroups_under(parent) == []


async def test_cpu_hog_gets_about_its_share(bwrap: BwrapSandbox) -> None:
    """Two processes spinning for two seconds under ``cpus=0.5`` get about one CPU second between
    them (on two or more idle CPUs, unthrottled, they would get four)."""
    job = py(
        """
        import os, time
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                end = time.monotonic() + 2
                while time.monotonic() < end:
                    pass
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        times = os.times()
        print(times.children_user + times.children_system)
        """,
        cpus=0.5,
        timeout_s=20,
    )
    result = await bwrap.run(job)
    assert result.verdict is Verdict.OK, result.stderr[-300:]
    cpu = float(result.stdout)
    assert 0.1 < cpu <= 0.5 * result.usage.wall_s * 1.25 + 0.1


# -- /tmp -----------------------------------------------------------------------------------


async def test_files_in_tmp_stop_at_the_inode_cap(bwrap: BwrapSandbox, runner_state: Path) -> None:
    job = py("""
        made = 0
        try:
            for i in range(200_000):
                open(f"/tmp/f{i}", "w").close()
                made += 1
            print("all", made)
        except OSError as exc:
            print("stopped", made, exc.errno)
    """)
    result = await bwrap.run(job)
    assert result.verdict is Verdict.OK, result.stderr[-300:]
    stopped, made, errno = result.stdout.split()
    assert stopped == b"stopped"
    assert int(errno) == 28  # ENOSPC
    assert RunnerSettings().tmpfs_inodes <= int(made) <= RunnerSettings().tmpfs_inodes + 16  # and the staging's own
    assert host_staging_mounts(runner_state) == []
    assert list((runner_state / "bwrap").iterdir()) == []
    again = await bwrap.run(py("import os; print(len(os.listdir('/tmp')))"))
    assert again.stdout == b"0\n"  # every sandbox starts with an empty /tmp of its own


# -- cleanup --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "limits", "verdict"),
    [
        ("print('done')", {}, Verdict.OK),
        ("import time; time.sleep(60)", {"timeout_s": 1}, Verdict.TIMEOUT),
        (EIGHT_CHILDREN, {"memory_mb": 128, "timeout_s": 20}, Verdict.MEMORY_LIMIT),
        ("import sys; sys.exit(3)", {}, Verdict.NONZERO_EXIT),
    ],
    ids=["ok", "timeout", "oom-kill", "nonzero"],
)
async def test_the_cgroup_goes_with_the_sandbox(
    bwrap: BwrapSandbox, parent: str, runner_state: Path, code: str, limits: dict[str, float], verdict: Verdict
) -> None:
    result = await bwrap.run(py(code, **limits))
    assert result.verdict is verdict, (result.detail, result.stderr[-300:])
    assert cgroups_under(parent) == []  # the sandbox's group, and the parent made for it
    assert host_staging_mounts(runner_state) == []
    assert await no_sandbox_processes()


async def test_concurrent_sandboxes_each_have_a_group_of_their_own(bwrap: BwrapSandbox, parent: str) -> None:
    runs = asyncio.gather(*(bwrap.run(py("import time; time.sleep(1.5)")) for _ in range(6)))
    await asyncio.sleep(0.8)
    groups = {group.name for group in cgroups_under(parent) if group.name != parent}
    results = await runs
    assert [r.verdict for r in results] == [Verdict.OK] * 6
    assert len(groups) == 6
    assert cgroups_under(parent) == []


async def test_the_cgroup_goes_with_a_cancelled_sandbox(bwrap: BwrapSandbox, parent: str) -> None:
    task = asyncio.create_task(bwrap.run(py("import time; time.sleep(60)", timeout_s=30)))
    for _ in range(100):
        if cgroups_under(parent):
            break
        await asyncio.sleep(0.02)
    assert cgroups_under(parent), "the sandbox's cgroup was never made"
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cgroups_under(parent) == []
    assert await no_sandbox_processes()


async def test_removing_a_cgroup_kills_what_is_left_in_it(parent: str) -> None:
    """Whatever is still in a sandbox's group when it ends (the pid namespace normally takes it
    all) is killed, and the group removed."""
    group = Cgroups.detect(parent).create(ResourceLimits())
    script = 'for join do echo 0 >"$join"; done; exec sleep 60'
    process = await asyncio.create_subprocess_exec("/bin/sh", "-c", script, "sh", *group.join)
    for _ in range(200):
        if group.members():
            break
        await asyncio.sleep(0.01)
    assert group.members() == {process.pid}
    await group.remove()
    assert await asyncio.wait_for(process.wait(), 5) == -signal.SIGKILL
    assert cgroups_under(parent) == []


async def test_groups_left_by_a_killed_process_are_removed_at_start_up(parent: str) -> None:
    group = Cgroups.detect(parent).create(ResourceLimits())
    parents = [Path(procs).parent.parent for procs in group.procs]
    await group.remove()
    gone = await asyncio.create_subprocess_exec("/bin/true")
    await gone.wait()
    for directory in parents:
        (directory / f"{gone.pid}-0badc0de").mkdir(parents=True)
    alive = [directory / f"{os.getpid()}-600dc0de" for directory in parents]
    for directory in alive:
        directory.mkdir()
    Cgroups.detect(parent)
    assert sorted(cgroups_under(parent)) == sorted([*parents, *alive])  # only the dead process's went
    for directory in [*alive, *parents]:
        directory.rmdir()


async def test_staging_left_by_a_killed_process_is_removed_at_start_up(runner_state: Path, parent: str) -> None:
    gone = await asyncio.create_subprocess_exec("/bin/true")
    await gone.wait()
    namespace = f"{os.stat('/proc/self/ns/pid').st_ino:x}"
    stale = runner_state / "bwrap" / f"b-{namespace}-{gone.pid:x}-stale"
    live = runner_state / "bwrap" / f"b-{namespace}-{os.getpid():x}-live"
    stale.mkdir(parents=True)
    live.mkdir()
    assert mount_tmpfs(stale, size_mb=1, inodes=64, uid=0)
    (stale / "out").mkdir()
    assert mount_tmpfs(stale / "out", size_mb=1, inodes=64, uid=0)
    (stale / "out" / "left.txt").write_text("left behind")
    BwrapSandbox(RunnerSettings(state_dir=runner_state, cgroup_parent=parent))
    assert not stale.exists()
    assert host_staging_mounts(runner_state) == []
    assert live.exists()  # its maker still runs


def test_v2_is_used_where_it_offers_every_controller_else_v1(parent: str) -> None:
    cgroups = Cgroups.detect(parent)
    own = Path("/proc/self/cgroup").read_text().splitlines()
    v2_path = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
    unified = next(m for m in cgroup_mounts() if (m / "cgroup.controllers").exists())
    offered = (unified / v2_path.lstrip("/") / "cgroup.controllers").read_text().split()
    assert cgroups.version == (2 if set(CONTROLLERS) <= set(offered) else 1)


# -- what the sandbox can learn about the host ------------------------------------------------


async def test_mountinfo_names_no_host_path(bwrap: BwrapSandbox, runner_state: Path) -> None:
    job = SandboxSpec(
        argv=("/usr/bin/python3", "-I", "-c", "print(open('/proc/self/mountinfo').read())"),
        inputs=(InputFile("data.txt", b"input"),),
        outputs=OutputCaps(),
        egress=(EgressRule("api.allowed.test", 443),),
    )
    result = await bwrap.run(job)
    assert result.verdict is Verdict.OK, result.stderr[-300:]
    text = result.stdout.decode()
    roots = {fields[4]: fields[3] for fields in (line.split() for line in text.splitlines() if line)}
    # Each is bound from a tmpfs made for this run: its root there, not a path on the host.
    assert roots["/tmp"] == "/tmp"
    assert roots["/in"] == "/in"
    assert roots["/run/stockade"] == "/run"
    assert roots["/out"] == "/"
    for host_path in (str(runner_state), "/var/lib", "/bwrap/", "/root", "/home", "/work"):
        assert host_path not in text

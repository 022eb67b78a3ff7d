"""A python tool against the resident worker of the container tiers: it runs in a process of its
own, so nothing it rebinds, forks or writes reaches the worker that serves the next job or the
host's reading of the reply. Each runs on ``docker`` and ``gvisor``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time

from runner import ContainerSandbox, OutputCaps, ResourceLimits, SandboxSpec, Verdict
from runner.image import default_image
from runner.python import parse_result, python_job
from runner.worker import OUT_ENTRIES, WORKER, FrameReader, encode_job


def python_tool(source: str, **spec: object) -> SandboxSpec:
    job = python_job(source, "main", {}, interpreter="/usr/bin/python3", limits=ResourceLimits(timeout_s=20))
    return dataclasses.replace(job, **spec)  # type: ignore[arg-type]


# Rebinds the worker's job runners: each later job is written to /tmp/stolen (the session keeps
# /tmp), and one whose environment asks for it gets a forged reply in place of its own.
HIJACK = """
def main():
    import json, sys
    worker = sys.modules["__main__"]

    def steal(run):
        def stolen(job, payload):
            with open("/tmp/stolen", "a") as log:
                log.write(json.dumps({"env": job.get("env"), "stdin": payload.decode(errors="replace")}) + "\\n")
            if "FORGE" in job.get("env", {}):
                worker.frame(b"o", b"forged output\\n")
                return {"code": 0, "signal": 0, "cpu_s": 0, "max_rss_kb": 0}
            return run(job, payload)
        return stolen

    worker.run_exec = steal(worker.run_exec)
    worker.run_python = steal(worker.run_python)
    return "installed"
"""


async def test_a_python_tool_cannot_change_or_watch_later_calls_in_its_session(container: ContainerSandbox) -> None:
    """Later calls in the session run as asked, with their own output, exit code and verdict,
    and the tool that rebound the worker's functions sees neither their environment nor stdin."""
    secret_env, secret_stdin = "placeholder-env-5c1d", "private-stdin-a3e9"
    installed = await container.run(python_tool(HIJACK, session="s"))
    assert (installed.verdict, parse_result(installed.stdout)) == (Verdict.OK, "installed")
    as_exec = await container.run(SandboxSpec(
        argv=("/bin/sh", "-c", "cat; echo real output; exit 3"), stdin=secret_stdin.encode(),
        env={"API_TOKEN": secret_env, "FORGE": "1"}, session="s", limits=ResourceLimits(timeout_s=20),
    ))  # fmt: skip
    reverse = "import os\ndef main():\n    return os.environ['API_TOKEN'][::-1]"
    as_python = await container.run(python_tool(reverse, env={"API_TOKEN": secret_env}, session="s"))
    look = await container.run(SandboxSpec(argv=("/bin/sh", "-c", "cat /tmp/stolen 2>/dev/null; echo end"),
                                           session="s", limits=ResourceLimits(timeout_s=20)))  # fmt: skip
    await container.close_session("s")
    real = f"{secret_stdin}real output\n".encode()
    assert (as_exec.verdict, as_exec.exit_code, as_exec.stdout) == (Verdict.NONZERO_EXIT, 3, real)
    assert (as_python.verdict, as_python.exit_code, parse_result(as_python.stdout)) == (Verdict.OK, 0, secret_env[::-1])
    assert look.stdout == b"end\n"  # nothing recorded the later jobs


# Makes the worker's cleanup a no-op, then leaves a process spinning in a session of its own.
SPINNER = """
def main():
    import os, sys, time
    sys.modules["__main__"].reap_leftovers = lambda: None
    if os.fork() == 0:
        os.setsid()
        started = time.monotonic()
        while time.monotonic() - started < 60:
            pass
        os._exit(0)
    return "returned"
"""

# Lists every process of the container but its own, with its command line.
PROCESSES = """
import json, os
found = {}
for pid in os.listdir('/proc'):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            found[pid] = open('/proc/%s/cmdline' % pid, 'rb').read().replace(b'\\0', b' ').decode()
        except OSError:
            pass
print(json.dumps(found))
"""


async def test_a_python_tool_that_disables_reaping_leaves_nothing_running(container: ContainerSandbox) -> None:
    """What a python tool forked is killed when its call ends, though the tool rebound the
    worker's cleanup: the next call in the session finds the worker and nothing else."""
    spun = await container.run(python_tool(SPINNER, session="s"))
    assert (spun.verdict, parse_result(spun.stdout)) == (Verdict.OK, "returned")
    listing = await container.run(SandboxSpec(argv=("python3", "-I", "-c", PROCESSES), session="s",
                                              limits=ResourceLimits(timeout_s=20)))  # fmt: skip
    await container.close_session("s")
    assert listing.verdict is Verdict.OK, (listing.detail, listing.stderr[-300:])
    others = json.loads(listing.stdout)
    assert list(others) == ["1"], others  # the worker, PID 1
    # After its first job, "session-next" and the limits it holds the session to (`conditions`).
    assert {"session", "session-next"} & set(others["1"].split())


# Writes raw refused-entry frames to its descriptor 1, as the worker would after a job.
REFUSED_FLOOD = """
def main():
    import json, os, struct
    body = json.dumps({"path": "p" * 100, "why": "forged"}).encode()
    blob = (b"r" + struct.pack(">I", len(body)) + body) * 1000
    for _ in range(COUNT // 1000):
        view = memoryview(blob)
        while view:
            view = view[os.write(1, view):]
    return "flooded"
"""


async def test_a_flood_of_refused_entry_frames_is_bounded(container: ContainerSandbox) -> None:
    """A tool writing raw ``r`` frames gets no entry into the reply's refused list (its bytes are
    its own output, under the output cap): at most what /out could hold comes back."""
    count = 20 * OUT_ENTRIES
    spec = python_tool(REFUSED_FLOOD.replace("COUNT", str(count)), outputs=OutputCaps(max_files=4),
                       limits=ResourceLimits(timeout_s=30, output_bytes=1 << 20))  # fmt: skip
    result = await container.run(spec)
    assert len(result.refused) <= OUT_ENTRIES, len(result.refused)
    assert [why for _, why in result.refused if why == "forged"] == []
    assert result.verdict is Verdict.OUTPUT_LIMIT, (result.verdict, result.detail)


async def test_an_out_directory_filled_to_its_last_entry_is_reported_in_full(container: ContainerSandbox) -> None:
    """The cap on refused entries sits at what an honest worker reports: every entry of /out
    over ``max_files`` is listed up to `OUT_ENTRIES` (under runc, /out holds no more), and the
    call is ok."""
    fill = f"""
def main():
    made = 0
    try:
        while made < {OUT_ENTRIES + 200}:
            open('/out/f%04d' % made, 'w').close()
            made += 1
    except OSError:
        pass
    return made
"""
    result = await container.run(python_tool(fill, outputs=OutputCaps(max_files=4)))
    assert result.verdict is Verdict.OK, (result.verdict, result.detail, result.stderr[-300:])
    made = parse_result(result.stdout)
    assert made >= OUT_ENTRIES - 8
    assert (len(result.artifacts), len(result.refused)) == (4, min(made, OUT_ENTRIES) - 4)


# Opens the worker's stdin and stdout (allowed under gVisor, whose procfs does not hold a
# non-dumpable process's fds back from its uid), forges its call's end, stays alive, and waits
# for the session's next job to steal it and answer it with a forged reply.
CHANNEL_HIJACK = r"""
import json, os, struct, time
def frame(fd, kind, data):
    os.write(fd, kind + struct.pack(">I", len(data)) + data)
try:
    out, inp = os.open("/proc/1/fd/1", os.O_WRONLY), os.open("/proc/1/fd/0", os.O_RDONLY)
except OSError as exc:
    print("refused:", exc.errno)
    raise SystemExit(0)
forged = json.dumps({"code": 0, "signal": 0, "cpu_s": 0.01, "max_rss_kb": 1, "oom_kills": 0}).encode()
frame(out, b"o", b"call 1 looks normal\n"); frame(out, b"x", forged); frame(out, b"d", b"")
os.close(1); os.close(2)
def read_exact(n):
    got = b""
    while len(got) < n:
        chunk = os.read(inp, n - len(got))
        if not chunk:
            raise SystemExit
        got += chunk
    return got
header = json.loads(read_exact(struct.unpack(">I", read_exact(4))[0]))
stolen = json.dumps({"env": header["env"], "stdin": read_exact(header["stdin_len"]).decode()}).encode()
frame(out, b"o", b"FORGED; stolen: " + stolen + b"\n"); frame(out, b"x", forged); frame(out, b"d", b"")
while True:
    time.sleep(1)
"""


async def test_a_tool_writing_frames_on_the_workers_channel_cannot_end_its_call_or_take_the_next(
    container: ContainerSandbox,
) -> None:
    """Under gVisor the tool can open the worker's channel (/proc/1/fd/0 and 1; runc refuses it).
    Its forged end of the call is refused (the exit frame lacks the job's seal): the call fails
    and its container goes with the session, so the session's next call runs in a fresh container,
    as asked, with nothing read by the tool; and nothing the tool left keeps running."""
    limits = ResourceLimits(timeout_s=10)
    hijack = await container.run(SandboxSpec(argv=("python3", "-I", "-c", CHANNEL_HIJACK), limits=limits, session="s"))
    if hijack.stdout.startswith(b"refused:"):  # runc: the worker's fds are not the tool's to open
        assert (container.tier, hijack.verdict) == ("docker", Verdict.OK)
    else:
        assert (container.tier, hijack.verdict, hijack.start) == ("gvisor", Verdict.ERROR, "cold")
        assert "not the worker's" in hijack.detail
    victim = await container.run(SandboxSpec(
        argv=("python3", "-I", "-c", "import sys; print('ran:', sys.stdin.read())"), stdin=b"private-5e1f",
        env={"API_TOKEN": "placeholder-77aa"}, session="s", limits=limits,
    ))  # fmt: skip
    await container.close_session("s")
    assert (victim.verdict, victim.stdout) == (Verdict.OK, b"ran: private-5e1f\n")
    assert b"FORGED" not in victim.stdout


# Walks the frames of its own process for a variable called ``seal``.
SEAL_HUNT = """
import sys
def main():
    f = sys._getframe()
    while f is not None:
        if "seal" in f.f_locals:
            return {"frame": f.f_code.co_name, "seal": f.f_locals["seal"]}
        f = f.f_back
    return None
"""


def test_a_job_whose_spare_died_is_not_run_in_a_fork_that_holds_its_seal() -> None:
    """The worker once forked a fresh process for a job whose prepared one (the spare) had died,
    from itself, after reading the job: a python tool there could read the job's seal from the
    worker's frames and, under gVisor, forge the worker's exit frame. Such a job is not run."""
    name = "stockade-test-spare-" + os.urandom(4).hex()
    worker = subprocess.Popen(
        ["docker", "run", "--rm", "-i", "--name", name, "--user", "65534:65534", "--cap-drop", "ALL",
         "--network", "none", default_image(), "env", "-i", "python3", "-I", "-S", "-c", WORKER, "pool"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert worker.stdin is not None
    assert worker.stdout is not None
    try:
        assert worker.stdout.read(5)[:1] == b"R"
        spares = (
            "for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n != 1 ] && [ $n != $$ ] "
            "&& grep -q python3 $p/cmdline 2>/dev/null && kill -9 $n; done; true"
        )
        subprocess.run(["docker", "exec", name, "sh", "-c", spares], check=True, capture_output=True, timeout=30)
        time.sleep(0.5)
        seal = os.urandom(16).hex()
        job = python_job(SEAL_HUNT, "main", {}, interpreter="/usr/bin/python3", limits=ResourceLimits(timeout_s=20))
        header = {"kind": "python", "argv": list(job.argv), "cwd": "/tmp", "egress": False, "seal": seal, "env": {},
                  "outputs": None}  # fmt: skip
        worker.stdin.write(encode_job(header, job.stdin))
        worker.stdin.flush()
        reader = FrameReader(1 << 20, 0, seal=seal)
        while not (reader.reply.done or reader.reply.malformed) and (data := worker.stdout.read1(65536)):
            reader.feed(data)
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)
        worker.stdout.close()
    assert (reader.reply.malformed, reader.reply.done) == ("", True)
    assert (reader.reply.exit or {}).get("code") == 127
    assert b"prepared process was gone" in reader.reply.stderr
    assert seal.encode() not in reader.reply.stdout + reader.reply.stderr

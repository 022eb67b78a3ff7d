"""Attacks on what the container tiers add around the tool: the egress bridge, the resident
worker, and the bind mounts. Each runs on ``docker`` and ``gvisor`` and counts what got through.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from runner import ContainerSandbox, EgressRule, ResourceLimits, RunnerSettings, RunResult, SandboxSpec, Verdict
from runner.python import parse_result, python_job
from tests.conftest import ALLOWED_HOST, Upstream
from tests.containment.test_containment import no_leftovers

# Each attack is a program run through the proxy; it prints one JSON line of what it observed.
ATTACKS = {
    # More connections at once than the proxy serves for one call, each held open by an unfinished
    # request head: those past its cap are answered 503 at once; none takes the sandbox down.
    "many_connections": """
import json, select, socket, time
socks = []
for _ in range(150):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(('127.0.0.1', 3128))
    socks.append(s)
stage, answers = dict.fromkeys(socks, 0), {}
finish, deadline = time.monotonic() + 0.5, time.monotonic() + 20
while len(answers) < len(socks) and time.monotonic() < deadline:
    now = time.monotonic()
    writing = [s for s in socks if stage[s] == 0 or (stage[s] == 1 and now > finish)]
    readable, writable, _ = select.select([s for s in socks if stage[s] == 2], writing, [], 0.1)
    for s in writable:
        try:
            s.send(b'CONNECT evil.test:443 HTTP/1.1\\r\\nHost: evil.test:443\\r\\n' if stage[s] == 0 else b'\\r\\n')
            stage[s] += 1
        except OSError:
            stage[s], answers[s] = 3, b''
    for s in readable:
        try:
            answers[s] = s.recv(12)
        except OSError:
            answers[s] = b''
        stage[s] = 3
replies = list(answers.values())
through = sum(r.startswith(b'HTTP/1.1 2') for r in replies)
print(json.dumps({"refused": replies.count(b'HTTP/1.1 403'), "busy": replies.count(b'HTTP/1.1 503'),
                  "closed": replies.count(b''), "through": through, "unanswered": len(socks) - len(answers)}))
""",
    # Destinations outside the allowlist, as tunnels and as plain HTTP.
    "denied_hosts": """
import json, socket
through = 0
for target in ('evil.test:443', 'HOSTNAME:1', '169.254.169.254:80', '127.0.0.1:22'):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    s.sendall(('CONNECT %s HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n' % (target, target)).encode())
    through += not s.recv(100).startswith(b'HTTP/1.1 403')
    s.close()
s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
s.sendall(b'GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\\r\\nHost: 169.254.169.254\\r\\n\\r\\n')
through += not s.recv(100).startswith(b'HTTP/1.1 403')
print(json.dumps({"through": through}))
""",
    # Bytes that are not HTTP, a head past the proxy's limit, and connections cut mid-request.
    "garbage": """
import json, os, socket
answers = []
for i in range(30):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    try:
        s.sendall(os.urandom(4000) + b'\\r\\n\\r\\n' if i % 3 else b'GET http://x/ HTTP/1.1\\r\\nX: ' + b'a' * 100000)
        answers.append(s.recv(12))
    except OSError:
        answers.append(b'')
    s.close()
for _ in range(100):
    s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
    s.send(os.urandom(64))
    s.close()
print(json.dumps({"through": sum(a.startswith(b'HTTP/1.1 2') for a in answers)}))
""",
    # A child keeps a tunnel open past the tool's end.
    "lingering_tunnel": """
import json, os, socket, time
s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
s.sendall(b'CONNECT HOST HTTP/1.1\\r\\nHost: HOST\\r\\n\\r\\n')
ok = s.recv(12) == b'HTTP/1.1 200'
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print(json.dumps({"tunnels": int(ok)}))
""",
    # Megabytes pushed into a tunnel as fast as the bridge takes them.
    "flood": """
import json, os, socket
s = socket.create_connection(('127.0.0.1', 3128), timeout=10)
s.sendall(b'CONNECT HOST HTTP/1.1\\r\\nHost: HOST\\r\\n\\r\\n')
ok = s.recv(12) == b'HTTP/1.1 200'
chunk, sent = os.urandom(1 << 16), 0
try:
    while sent < 8 << 20:
        s.sendall(chunk)
        sent += len(chunk)
except OSError:
    pass
print(json.dumps({"tunnels": int(ok), "sent": sent}))
""",
}
ROUNDS = 1  # each attack once per tier; 10 rounds (50 calls) is the soak the fix was measured with


def attack(name: str, upstream: Upstream, **spec: object) -> SandboxSpec:
    host = f"{ALLOWED_HOST}:{upstream.port}"
    code = ATTACKS[name].replace("HOSTNAME", ALLOWED_HOST).replace("HOST", host)
    return SandboxSpec(argv=("python3", "-I", "-c", code), limits=ResourceLimits(timeout_s=30),
                       egress=(EgressRule(ALLOWED_HOST, upstream.port),), **spec)  # type: ignore[arg-type]  # fmt: skip


def observed(result: RunResult) -> dict[str, int]:
    assert result.verdict is Verdict.OK, (result.verdict, result.detail, result.stderr[-500:])
    found: dict[str, int] = json.loads(result.stdout.decode().splitlines()[-1])
    return found


async def test_proxy_attacks_always_end_in_a_verdict_with_nothing_through(
    container: ContainerSandbox, upstream: Upstream
) -> None:
    """The sandbox survives every attack on its egress bridge (no "worker died"), and the
    proxy lets nothing through that the allowlist does not name."""
    results: dict[str, list[RunResult]] = {name: [] for name in ATTACKS}
    for _ in range(ROUNDS):
        for name in ATTACKS:
            results[name].append(await container.run(attack(name, upstream)))
    runs = [r for rs in results.values() for r in rs]
    deaths = [r.detail for r in runs if r.verdict is not Verdict.OK]
    assert deaths == [], deaths
    refusable = results["denied_hosts"] + results["garbage"] + results["many_connections"]
    assert sum(observed(r)["through"] for r in refusable) == 0
    # Every one of the 150 connections ended: refused (403) by the allowlist, or, past the proxy's
    # cap on one call's connections at once, turned away as busy (503; closed before the tool
    # read the answer when it was still sending its head).
    ended = [observed(r) for r in results["many_connections"]]
    assert all(o["refused"] >= 1 and o["unanswered"] == 0 and o["refused"] + o["busy"] + o["closed"] == 150
               for o in ended), ended  # fmt: skip
    assert [observed(r)["tunnels"] for r in results["lingering_tunnel"] + results["flood"]] == [1] * 2 * ROUNDS
    assert all(r.usage.wall_s < 15 for r in runs), [round(r.usage.wall_s, 1) for r in runs]
    assert await no_leftovers(container)


async def test_the_tool_cannot_read_the_workers_environment(container: ContainerSandbox, upstream: Upstream) -> None:
    """Neither an ``exec`` tool (another process) nor a ``python`` tool (the worker's own process)
    finds the worker's environment, its memory, or an earlier job's placeholder in any
    /proc/*/environ it can read."""
    earlier, current = "placeholder-earlier-7f3a", "placeholder-current-91c2"
    egress = attack("lingering_tunnel", upstream).egress
    await container.run(SandboxSpec(argv=("true",), env={"API_TOKEN": earlier}, session="s", egress=egress))
    read_all = """
import json, os
me = str(os.getpid())
found, memory = [], []
for pid in os.listdir('/proc'):
    if pid.isdigit() and (pid != me or not EXCLUDE_SELF):
        try:
            found.append(open('/proc/%s/environ' % pid, 'rb').read().decode(errors='replace'))
        except OSError:
            pass
    if pid.isdigit() and pid != me:
        try:
            open('/proc/%s/mem' % pid, 'rb').close()
            memory.append(pid)
        except OSError:
            pass
RETURN
"""
    exec_tool = read_all.replace("EXCLUDE_SELF", "True").replace(
        "RETURN", "print(json.dumps({'environ': found, 'mem': memory, 'own': dict(os.environ)}))"
    )
    python_tool = "def main():\n" + "\n".join("    " + line for line in read_all.splitlines()).replace(
        "EXCLUDE_SELF", "False"
    ).replace("RETURN", "return {'environ': found, 'mem': memory, 'own': dict(os.environ)}")
    as_exec = await container.run(SandboxSpec(argv=("python3", "-I", "-c", exec_tool), env={"API_TOKEN": current},
                                              session="s", egress=egress))  # fmt: skip
    as_python = await container.run(dataclasses.replace(
        python_job(python_tool, "main", {}, interpreter="/usr/bin/python3", limits=ResourceLimits()),
        env={"API_TOKEN": current}, session="s", egress=egress,
    ))  # fmt: skip
    await container.close_session("s")
    reports = [json.loads(as_exec.stdout), parse_result(as_python.stdout)]
    leaked = [text for report in reports for text in report["environ"] if text]
    assert leaked == []  # the worker's environment is empty, and the bridge's is the worker's
    assert [report["mem"] for report in reports] == [[], []]  # the exec tool can open no other process's memory
    # Each tool has its own job's environment, and nothing of the earlier job's.
    assert [report["own"].get("API_TOKEN") for report in reports] == [current, current]
    assert all(report["own"]["HTTPS_PROXY"] == "http://127.0.0.1:3128" for report in reports)
    assert earlier not in as_exec.stdout.decode() + as_python.stdout.decode()


async def test_mountinfo_names_no_host_path_of_the_binds(container: ContainerSandbox, settings: RunnerSettings) -> None:
    """Bind sources come from a neutral staging root; Docker's own /etc files (under its data
    root, with the host's resolvers) are replaced."""
    result = await container.run(
        SandboxSpec(argv=("/bin/sh", "-c", "cat /proc/self/mountinfo; echo ===; cat /etc/resolv.conf"))
    )
    mountinfo, resolv = result.stdout.decode().split("===\n")
    binds = {"/in", "/run/stockade", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}
    roots = {fields[4]: fields[3] for fields in (line.split() for line in mountinfo.splitlines()) if fields[4] in binds}
    assert set(roots) == binds
    revealing = [root for root in roots.values() if "/var/lib" in root or str(settings.state_dir) in root]
    assert revealing == []
    assert str(settings.state_dir) not in mountinfo
    assert "/var/lib/docker/containers" not in mountinfo
    host_resolvers = [line for line in Path("/etc/resolv.conf").read_text().splitlines() if line.strip()]
    assert [line for line in host_resolvers if line in resolv] == []

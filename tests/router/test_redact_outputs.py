"""Redaction of what a call brings back, end to end through `ControlPlane.call`: a large output
with many secrets registered is redacted without stalling the event loop, and a secret in an
``/out`` file's name or in a file that is not UTF-8 reaches neither the agent, the quarantine
nor the audit log."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import ControlPlane
from router.audit import AuditFilter
from router.redact import REDACTOR
from tests.conftest import python_tool

SECRET = "sk-live-4f9a8b7c6d5e"


@pytest.fixture
def many_secrets() -> Iterator[None]:
    """Sixty secrets registered, as with the tokens of sixty calls in flight, and SECRET."""
    values = ["eyJhbGciOiJFZERTQSJ9." + secrets.token_urlsafe(300) + "." + secrets.token_urlsafe(64) for _ in range(60)]
    for i, value in enumerate(values):
        REDACTOR.add(value, f"tok{i}", until=time.time() + 300)
    REDACTOR.add(SECRET, "out-key", until=time.time() + 300)
    yield
    for value in [*values, SECRET]:
        REDACTOR.discard(value)


BIG = f"""
def main(mib):
    return "a" * ((mib << 20) - 64) + " {SECRET[:8]}" + "{SECRET[8:]}"
"""


async def test_a_large_output_is_redacted_without_stalling_the_event_loop(
    plane: ControlPlane, many_secrets: None
) -> None:
    """With sixty secrets registered, a 4 MiB output stalls the loop (other calls, the HTTP API)
    for about 100 ms here (the audit append hashing the event): it used to be 2.3 s, each secret's
    forms searched in turn, on the loop, and again in the audit log. The bound leaves room for a
    loaded machine on both sides."""
    await plane.register(python_tool("big", BIG, sandbox={"limits": {"output_bytes": 8 << 20, "memory_mb": 512}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    assert (await plane.call(session, "big", {"mib": 1})).ok  # imports and first runs: not what is measured
    stall = 0.0
    done = False

    async def ticker() -> None:
        nonlocal stall
        while not done:
            started = time.perf_counter()
            await asyncio.sleep(0.005)
            stall = max(stall, time.perf_counter() - started - 0.005)

    ticking = asyncio.create_task(ticker())
    result = await plane.call(session, "big", {"mib": 4})
    done = True
    await ticking
    assert result.ok, result.stderr[-800:]
    assert result.output.endswith(" [REDACTED:out-key]")
    assert SECRET not in result.stdout
    assert stall < 0.6, f"the event loop stalled {stall * 1000:.0f} ms"
    assert SECRET not in plane.settings.audit.path.read_text()


OUT = f"""
def main():
    import os
    key = "{SECRET[:8]}" + "{SECRET[8:]}"  # as an upstream echoed it back
    open("/out/" + key + ".txt", "w").write("named")
    os.mkdir("/out/dir-" + key)
    open("/out/dir-" + key + "/inner.txt", "w").write("inside")
    open("/out/page.html", "wb").write(("caf\\xe9 token=" + key).encode("latin-1"))
    open("/out/blob.bin", "wb").write(bytes([0, 255, 128]) + key.upper().encode() + bytes([200]))
    open("/out/x-" + key, "w").write("first")
    open("/out/x-REDACTED=out-key", "w").write("second, its name taken already")
    return sorted(os.listdir("/out"))
"""


async def test_a_secret_in_an_out_file_name_or_in_a_file_that_is_not_utf8_is_redacted(
    plane: ControlPlane, many_secrets: None
) -> None:
    """A file named after the secret is moved to its redacted name, written as the runner allows
    (``REDACTED=<label>``; refused, and removed, when that name is taken); a Latin-1 page and a
    binary file have the secret replaced in their bytes. The agent, the quarantine and the audit
    log hold the secret nowhere."""
    await plane.register(python_tool("out", OUT, sandbox={"outputs": {"max_files": 16}}))
    session = await plane.open_session("agent-1", "alice@example.com")
    result = await plane.call(session, "out", {})
    assert result.ok, result.stderr[-800:]
    assert result.quarantine is not None
    assert sorted(a.path for a in result.artifacts) == [
        "REDACTED=out-key.txt", "blob.bin", "dir-REDACTED=out-key/inner.txt", "page.html", "x-REDACTED=out-key",
    ]  # fmt: skip
    quarantine = Path(result.quarantine)
    on_disk = {str(p.relative_to(quarantine)): p.read_bytes() for p in quarantine.rglob("*") if p.is_file()}
    assert on_disk == {
        "REDACTED=out-key.txt": b"named",
        "dir-REDACTED=out-key/inner.txt": b"inside",
        "page.html": b"caf\xe9 token=[REDACTED:out-key]",
        "blob.bin": b"\x00\xff\x80[REDACTED:out-key]\xc8",
        "x-REDACTED=out-key": b"second, its name taken already",
    }
    assert not any(SECRET in str(p) for p in quarantine.rglob("*"))  # no directory left named after it
    for artifact in result.artifacts:
        assert artifact.size == len(on_disk[artifact.path])
    audit = plane.settings.audit.path.read_text()
    assert SECRET not in audit
    assert SECRET.upper() not in audit
    (execution,) = await plane.audit.query(AuditFilter(decision_id=result.decision_id, kind="execution"))
    assert execution.result is not None
    assert execution.result["refused_outputs"] == [
        {"path": "x-REDACTED=out-key", "why": "its name holds a secret, and the redacted name is taken or invalid"}
    ]

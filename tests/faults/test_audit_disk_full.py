"""The audit log on a small tmpfs filled to the last byte: appends fail without touching the file,
calls are denied and nothing runs, readiness says so, and everything resumes when space returns,
in this process and after a restart."""

from __future__ import annotations

import asyncio
from asyncio import Event
from pathlib import Path

import httpx
import pytest

from router import AuditError, ControlPlane, Settings
from router.audit import AuditEvent, AuditFilter, JsonlAuditLog, timestamp
from router.interfaces.api import create_app
from router.settings import AuditSettings, StoreSettings
from runner import RunnerSettings
from tests.conftest import external_tool, python_tool
from tests.faults.conftest import fill, small_tmpfs


def _event(i: int) -> AuditEvent:
    # More than a page: every append needs new space on the full disk.
    return AuditEvent(kind="decision", decision_id=f"d-{i}", timestamp=timestamp(), outcome="allow",
                      result={"padding": "x" * 5000})  # fmt: skip


async def test_a_full_disk_leaves_the_log_exactly_as_it_was_and_appends_resume(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", 256) as disk:
        log = JsonlAuditLog(disk / "audit.jsonl")
        for i in range(5):
            await log.append(_event(i))
        filler = fill(disk)
        before = (disk / "audit.jsonl").read_bytes()
        failures = 0
        for i in range(5, 25):  # larger events than the last free bytes: partial writes happen
            with pytest.raises(AuditError, match=r"short write|No space left"):
                await log.append(_event(i))
            failures += 1
        assert (disk / "audit.jsonl").read_bytes() == before  # no half line, nothing torn
        assert "cannot take an append" in (await log.check() or "")

        filler.unlink()  # space returns
        assert await log.check() is None
        appended = await log.append(_event(99))
        assert appended.seq == 6
        await log.aclose()

        restarted = JsonlAuditLog(disk / "audit.jsonl")
        assert (await restarted.append(_event(100))).seq == 7
        report = await restarted.verify()
        assert (report.ok, report.events, failures) == (True, 7, 20)
        await restarted.aclose()


def runs(state: Path) -> int:
    """Sandbox runs so far, as the host sees them: each run leaves its /out in a quarantine folder."""
    quarantine = state / "quarantine"
    return len(list(quarantine.iterdir())) if quarantine.exists() else 0


async def test_calls_are_denied_while_the_disk_is_full_and_served_again_after(
    tmp_path: Path, runner_state: Path
) -> None:
    with small_tmpfs(tmp_path / "disk", 512) as disk:
        settings = Settings(
            audit=AuditSettings(path=disk / "audit.jsonl"), runner=RunnerSettings(state_dir=runner_state)
        )
        async with ControlPlane.from_settings(settings) as plane:
            source = "def main(**kw):\n    open('/out/ran', 'w').write('x')\n    return 1\n"
            await plane.register(python_tool("touch", source, sandbox={"outputs": {"max_files": 1, "max_bytes": 10}}))
            session = await plane.open_session("agent-1", "alice@example.com")
            first = await plane.call(session, "touch", {})
            assert (first.status, first.artifacts[0].path, runs(runner_state)) == ("completed", "ran", 1)
            ready = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(plane)),
                                      base_url="http://router")  # fmt: skip
            assert (await ready.get("/readyz")).status_code == 200

            filler = fill(disk)
            # Appends may still use room the readiness probe reserved; once that is gone, none gets by.
            for _ in range(200):
                if (await plane.call(session, "touch", {})).status == "denied":
                    break
            ran = runs(runner_state)
            results = [await plane.call(session, "touch", {}) for _ in range(10)]
            assert {(r.status, tuple(r.reasons)) for r in results} == {("denied", ("audit.unavailable",))}
            assert runs(runner_state) == ran  # denied before the sandbox: nothing ran
            response = await ready.get("/readyz")
            assert (response.status_code, response.json()["checks"]["audit"]) == (503, False)

            filler.unlink()
            assert (await plane.call(session, "touch", {})).status == "completed"  # no restart needed
            assert (await ready.get("/readyz")).status_code == 200
            assert (await plane.audit.verify()).ok
            await ready.aclose()


async def test_no_endorsement_is_in_force_without_a_record_of_it(tmp_path: Path) -> None:
    """Nothing unaudited: with the audit disk full, an endorsement is in force only if its request
    was recorded before it took effect, and the caller is told whenever a record failed; with
    space back, endorsing works as ever."""
    with small_tmpfs(tmp_path / "disk", 512) as disk:
        async with ControlPlane.from_settings(Settings(audit=AuditSettings(path=disk / "audit.jsonl"))) as plane:
            await plane.register(external_tool("read_file", capabilities=["reads_untrusted"]))
            await plane.register(external_tool(
                "pay", risk="medium", capabilities=["financial", "sends_external"], destination_args=["iban"],
                input_schema={"type": "object", "properties": {"iban": {"type": "string"}}},
            ))  # fmt: skip
            session = await plane.open_session("agent-1", "alice@example.com", ["Pay the bills I read"])
            bill = {"iban": "DE89370400440532013000"}
            reads = []
            for _ in range(6):
                read = await plane.call(session, "read_file", {"name": "bill.txt"})
                await plane.report(session, read.call_id, {"text": "IBAN DE89 3704 0044 0532 0130 00"})
                reads.append(read.call_id)

            filler = fill(disk)
            told = 0
            for call_id in reads:  # room the readiness probe reserved may take a few appends first
                try:
                    await plane.endorse(session, call_id, by="alice@example.com")
                except AuditError:
                    told += 1
            filler.unlink()
            assert told > 0
            records = await plane.audit.query(AuditFilter(kind="endorsement"))
            requested = {e.call_id for e in records if e.outcome == "requested"}
            in_force = {s.rsplit(":", 1)[1] for s in (await plane.store.load_session(session)).endorsed}  # type: ignore[union-attr]
            assert in_force - requested == set()  # in force without a record: none
            # Once space is back: a fresh endorsement is recorded, then in force, then confirmed.
            fresh = await plane.call(session, "read_file", {"name": "bill.txt"})
            await plane.report(session, fresh.call_id, {"text": "IBAN DE89 3704 0044 0532 0130 00"})
            await plane.endorse(session, fresh.call_id, by="alice@example.com")
            assert (await plane.call(session, "pay", bill)).status == "awaiting_report"
            outcomes = [e.outcome for e in await plane.audit.query(AuditFilter(kind="endorsement"))]
            assert outcomes[-2:] == ["requested", "endorsed"]
            assert (await plane.audit.verify()).ok


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_no_approval_is_in_force_before_its_record(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    """An approver's grant was made redeemable before it was written, and taken back only when
    the write failed: meanwhile a retry of the held call (on any router sharing the store) could
    redeem it, and the call ran with no approval on record. Watched from the store while the
    audit disk is full, a grant that could not be recorded is never seen approved; with space
    back, approving works as ever."""
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    settings = Settings(audit=AuditSettings(path=tmp_path / "disk" / "audit.jsonl"), store=StoreSettings(url=url))
    with small_tmpfs(tmp_path / "disk", 512):
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(external_tool("drop_table", risk="critical", capabilities=["mutates_state"]))
            session = await plane.open_session("agent-1", "alice@example.com")
            held = [await plane.call(session, "drop_table", {"table": f"t{n}"}) for n in range(6)]
            assert {h.status for h in held} == {"pending_approval"}

            filler = fill(tmp_path / "disk")
            unrecorded_but_seen_approved = []
            told = 0
            for call in held:  # room the readiness probe reserved may take a few appends first
                approval_id = call.approval_id
                assert approval_id is not None
                seen: set[str] = set()
                done = Event()

                async def watch(approval_id: str = approval_id, seen: set[str] = seen, done: Event = done) -> None:
                    while not done.is_set():
                        stored = await plane.store.get_approval(approval_id)
                        seen.add(stored.status.value if stored is not None else "gone")
                        await asyncio.sleep(0)

                watcher = asyncio.create_task(watch())
                try:
                    await plane.approve(approval_id, "oncall")
                except AuditError:
                    told += 1
                    if "approved" in seen:
                        unrecorded_but_seen_approved.append(approval_id)
                done.set()
                await watcher
            filler.unlink()
            assert told > 0
            assert unrecorded_but_seen_approved == []
            records = await plane.audit.query(AuditFilter(kind="approval"))
            recorded = {e.result["id"] for e in records if e.outcome == "approved"}
            for call in held:  # in force only with a record
                assert call.approval_id is not None
                stored = await plane.store.get_approval(call.approval_id)
                assert stored is not None
                assert stored.status.value == "pending" or call.approval_id in recorded
            last = held[-1]
            assert last.approval_id is not None
            if last.approval_id not in recorded:
                await plane.approve(last.approval_id, "oncall")
            ran = await plane.call(session, "drop_table", {"table": "t5"})
            assert ran.status == "awaiting_report"
            assert (await plane.audit.verify()).ok

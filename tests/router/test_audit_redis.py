"""The Redis audit stream: routers on different hosts append to one verifiable chain, with signed
checkpoints; a local spool keeps what the stream cannot take; a stream that went backwards is refused."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from router import AuditError, ControlPlane, Settings
from router.audit import GENESIS_HASH, AuditEvent, AuditFilter, line_hash, timestamp
from router.audit.checkpoint import Checkpoint, SigningKey
from router.audit.jsonl import LogOptions
from router.audit.layout import LogLayout
from router.audit.merkle import CompactRange, verify_inclusion
from router.audit.redis import CHECKPOINTS, HEAD, STREAM, RedisAuditLog
from router.audit.verify import verify_log
from router.settings import AuditSettings, StoreSettings
from tests.conftest import external_tool, free_port

STOCKADE = Path(sys.executable).parent / "stockade"


def event(i: int, writer: str, **fields: object) -> AuditEvent:
    return AuditEvent.model_validate({"kind": "decision", "decision_id": f"d-{writer}-{i}", "timestamp": timestamp(),
                                      "outcome": "allow", "agent": writer, "tool": "echo", **fields})  # fmt: skip


def xrange(db: redis.Redis, key: str) -> list[tuple[str, dict[str, str]]]:
    """A stream's entries (id, fields), as the test's decoding client reads them."""
    return cast("list[tuple[str, dict[str, str]]]", db.xrange(key))


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True)


def keyed(tmp_path: Path, **changes: object) -> LogOptions:
    options = {"signer": SigningKey.load_or_create(tmp_path / "keys" / "audit.key"), "checkpoint_interval_s": 3600,
               "publish_dir": tmp_path / "published", **changes}  # fmt: skip
    return LogOptions(**options)  # type: ignore[arg-type]


async def test_two_writers_interleave_into_one_chain(redis_url: str) -> None:
    one, two = RedisAuditLog(redis_url), RedisAuditLog(redis_url)
    try:
        await asyncio.gather(*(log.append(event(i, name)) for i in range(50) for name, log in (("a", one), ("b", two))))
        report = await one.verify()
        assert (report.ok, report.events) == (True, 100)
        assert len(await two.query(AuditFilter(agent="b"))) == 50
        assert [e.seq for e in await one.query(AuditFilter(limit=3))] == [1, 2, 3]
        events = await one.query(AuditFilter())
        assert [e.seq for e in events] == list(range(1, 101))
        assert [e.prev_hash for e in events] == [GENESIS_HASH] + [e.hash for e in events[:-1]]
    finally:
        await one.aclose()
        await two.aclose()


async def test_stream_entries_hold_the_line_and_its_hash_and_the_head_the_tree(redis_url: str) -> None:
    log = RedisAuditLog(redis_url)
    try:
        appended = [await log.append(event(i, "a")) for i in range(5)]
    finally:
        await log.aclose()
    db = client(redis_url)
    try:
        entries = xrange(db, STREAM)
        head = db.hgetall(HEAD)
    finally:
        db.close()
    assert [set(fields) for _, fields in entries] == [{"event", "hash"}] * 5
    tree = CompactRange()
    for (_, fields), written in zip(entries, appended, strict=True):
        line = fields["event"].encode()
        assert fields["hash"] == line_hash(line).hex() == written.hash
        assert "hash" not in json.loads(line)
        tree.append(line_hash(line))
    assert (int(head["seq"]), head["hash"]) == (5, appended[-1].hash)
    assert CompactRange.from_json(json.loads(head["tree"])) == tree


async def test_checkpoints_are_signed_chained_and_published(tmp_path: Path, redis_url: str) -> None:
    options = keyed(tmp_path)
    one, two = RedisAuditLog(redis_url, options=options), RedisAuditLog(redis_url, options=options)
    try:
        for i in range(3):
            await one.append(event(i, "a"))
        first = await one.checkpoint()
        assert first is not None
        assert await two.checkpoint() == first  # nothing appended since: the same checkpoint
        for i in range(4):
            await two.append(event(i, "b"))
        second = await one.checkpoint()  # any router signs the head, whoever appended
        assert second is not None
        assert (first.size, second.size, second.prev) == (3, 7, first.digest())
        assert all(c.verify(options.signer.verify_key) for c in (first, second))  # type: ignore[union-attr]
        assert await two.checkpoints() == [first, second]
        db = client(redis_url)
        try:
            head = db.hgetall(HEAD)
        finally:
            db.close()
        assert Checkpoint.model_validate_json(head["checkpoint"]) == second
        assert head["checkpoint_digest"] == second.digest()
        assert CompactRange.from_json(json.loads(head["tree"])).root().hex() == second.root
        published = sorted(p.name for p in (tmp_path / "published").iterdir())
        assert published == [f"{c.size:012d}-{c.digest()[:16]}.json" for c in (first, second)]
        report = await two.verify()
        assert (report.ok, report.events, report.signed) == (True, 7, 7)
    finally:
        await one.aclose()
        await two.aclose()


async def test_concurrent_checkpoints_from_two_routers_keep_one_chain(tmp_path: Path, redis_url: str) -> None:
    options = keyed(tmp_path)
    one, two = RedisAuditLog(redis_url, options=options), RedisAuditLog(redis_url, options=options)
    try:
        for round_ in range(10):
            await asyncio.gather(one.append(event(round_, "a")), two.append(event(round_, "b")))
            await asyncio.gather(one.checkpoint(), two.checkpoint())
        checkpoints = await one.checkpoints()
        assert [c.prev for c in checkpoints[1:]] == [c.digest() for c in checkpoints[:-1]]
        assert sorted({c.size for c in checkpoints}) == [c.size for c in checkpoints]  # one per size, growing
        assert checkpoints[-1].size == 20
        report = await one.verify()
        assert (report.ok, report.signed) == (True, 20)
    finally:
        await one.aclose()
        await two.aclose()


async def test_the_tail_is_signed_at_shutdown(tmp_path: Path, redis_url: str) -> None:
    log = RedisAuditLog(redis_url, options=keyed(tmp_path))
    for i in range(4):
        await log.append(event(i, "a"))
    await log.aclose()
    reader = RedisAuditLog(redis_url, options=keyed(tmp_path))
    try:
        assert [c.size for c in await reader.checkpoints()] == [4]
        report = await reader.verify()
        assert (report.ok, report.signed, report.notes) == (True, 4, ())
    finally:
        await reader.aclose()


async def test_a_deleted_entry_breaks_the_chain_where_it_was(redis_url: str) -> None:
    log = RedisAuditLog(redis_url)
    try:
        for i in range(5):
            await log.append(event(i, "a"))
        db = client(redis_url)
        third = xrange(db, STREAM)[2][0]
        db.xdel(STREAM, third)
        db.close()
        report = await log.verify()
        assert (report.ok, report.broken_seq) == (False, 3)
        assert "deleted" in report.problem
    finally:
        await log.aclose()


MASKS = (("/input/args/card", False), ("/input/args/pin", True))
CARD = {"args": {"card": "4111-1111-1111-1111", "pin": "8642"}}


async def test_masked_values_never_reach_redis(tmp_path: Path, redis_url: str) -> None:
    log = RedisAuditLog(redis_url, options=keyed(tmp_path, masks=MASKS))
    try:
        await log.append(event(1, "a", input=CARD))
        report = await log.verify()
        assert (report.ok, report.events) == (True, 1)
    finally:
        await log.aclose()
    db = client(redis_url)
    try:
        entries = xrange(db, STREAM)
        dumped = json.dumps([entries, db.hgetall(HEAD), xrange(db, CHECKPOINTS)])
    finally:
        db.close()
    assert "4111-1111-1111-1111" not in dumped
    assert '"8642"' not in dumped
    stored = json.loads(entries[0][1]["event"])
    assert stored["input"]["args"]["card"] == "[masked]"
    assert stored["input"]["args"]["pin"] == "sha256:" + hashlib.sha256(b'"8642"').hexdigest()
    assert stored["labels"]["masked"] == "/input/args/card,/input/args/pin"


async def test_append_returns_the_event_as_written_when_masks_apply(tmp_path: Path, redis_url: str) -> None:
    """The event `append` hands back carries the hash of the masked line: its fields must be that
    line's too, not the unmasked values (which would then travel on from the caller)."""
    log = RedisAuditLog(redis_url, options=keyed(tmp_path, masks=MASKS))
    try:
        written = await log.append(event(1, "a", input=CARD))
        stored = (await log.query(AuditFilter()))[0]
    finally:
        await log.aclose()
    assert written.hash == stored.hash
    assert written.input == stored.input
    assert written.labels == stored.labels


async def test_a_control_plane_audits_into_the_stream(tmp_path: Path, redis_url: str) -> None:
    settings = Settings(audit=AuditSettings(backend="redis", path=tmp_path / "unused.jsonl",
                                            signing_key=tmp_path / "keys" / "audit.key"),
                        store=StoreSettings(url=redis_url))  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        await plane.register(external_tool("echo"))
        session = await plane.open_session("agent", "alice@example.com")
        result = await plane.call(session, "echo", {})
        trail = await plane.audit.query(AuditFilter(decision_id=result.decision_id))
        assert [e.kind for e in trail] == ["decision"]
        assert (await plane.audit.verify()).ok
    assert not (tmp_path / "unused.jsonl").exists()
    reader = RedisAuditLog(
        redis_url, options=LogOptions(signer=SigningKey.load_or_create(tmp_path / "keys" / "audit.key"))
    )
    try:
        report = await reader.verify()
        assert report.ok
        assert report.signed == report.events > 0  # signed at shutdown
    finally:
        await reader.aclose()


async def test_a_router_moved_between_backends_keeps_one_anchor_per_log(tmp_path: Path, redis_url: str) -> None:
    """A router that wrote the JSONL log, then moved to the Redis stream (scaling out) and back,
    with its settings otherwise the same. The stream's rollback guard once read the JSONL log's
    anchor: a new stream was refused (\"went backwards\"), and the JSONL log, back again, was held
    to the stream's checkpoint and could never verify. Each backend keeps its own anchor."""
    audit = AuditSettings(path=tmp_path / "log" / "audit.jsonl", signing_key=tmp_path / "keys" / "audit.key")

    async def calls(settings: Settings, n: int) -> None:
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(external_tool("echo"))
            session = await plane.open_session("agent", "alice@example.com")
            for _ in range(n):
                assert (await plane.call(session, "echo", {})).status == "awaiting_report"  # allowed: external
            problems = await plane.readiness_problems()
            assert not any(problems.values()), problems

    await calls(Settings(audit=audit), 5)
    redis_audit = audit.model_copy(update={"backend": "redis", "spool_dir": tmp_path / "spool"})
    await calls(Settings(audit=redis_audit, store=StoreSettings(url=redis_url)), 12)
    await calls(Settings(audit=audit), 2)
    key = SigningKey.load_or_create(audit.signing_key)
    report = verify_log(LogLayout(audit.path), keys=[key.verify_key])
    assert (report.ok, report.problem, report.signed) == (True, "", report.events), report


def test_the_stream_needs_the_stores_redis(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match="STOCKADE_STORE__URL"):
        ControlPlane.from_settings(Settings(audit=AuditSettings(backend="redis", signing_key=tmp_path / "key")))


# Every scenario below spools an event, and the spool's append takes a flock; each runs in a child
# process so that a hang there fails its test instead of the whole run.


def _scenario(name: str, *args: str) -> None:
    scenario = globals()[name]
    asyncio.run(scenario(args[0], Path(args[1]), *args[2:]))


def in_child(name: str, *args: str, timeout_s: float = 20) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_scenario, args=(name, *args))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"{name} did not finish within {timeout_s:g}s: an append that spools hangs")
    assert child.exitcode == 0, f"{name} failed in its process (its traceback is in the captured stderr)"


def test_events_the_stream_cannot_take_are_spooled_and_chained_in_first_when_it_answers(
    tmp_path: Path, redis_url: str
) -> None:
    in_child("_spooled_then_drained", redis_url, str(tmp_path))


def test_two_routers_on_one_host_claim_spools_of_their_own(tmp_path: Path, redis_url: str) -> None:
    in_child("_two_spools_on_one_host", redis_url, str(tmp_path))


@pytest.mark.parametrize("loss", ["flushed", "tail trimmed and head rolled back"])
def test_a_stream_that_went_backwards_is_refused_until_an_operator_accepts_it(
    tmp_path: Path, redis_url: str, loss: str
) -> None:
    in_child("_went_backwards", redis_url, str(tmp_path), loss)


def test_a_loss_hidden_by_another_router_appending_past_it_is_still_seen(tmp_path: Path, redis_url: str) -> None:
    in_child("_loss_hidden_by_another_router", redis_url, str(tmp_path))


async def _spooled_then_drained(redis_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    down = RedisAuditLog(f"redis://127.0.0.1:{free_port()}/12", timeout_s=0.3, spool_dir=spool, instance="r1")
    refused = 0
    for i in range(3):
        with pytest.raises(AuditError, match="Redis"):
            await down.append(event(i, "while-down"))
        refused += 1
    assert "unreachable" in (await down.check() or "")
    await down.aclose()
    spooled = (spool / "r1.jsonl").read_bytes().splitlines()
    assert [json.loads(line)["decision_id"] for line in spooled] == [f"d-while-down-{i}" for i in range(3)]

    back = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")  # the restarted router takes its spool back
    try:
        assert await back.check() is None  # the readiness probe drains the spool
        after = await back.append(event(9, "after"))
        assert after.seq == refused + 1
        events = await back.query(AuditFilter())
        assert [e.decision_id for e in events] == [*(f"d-while-down-{i}" for i in range(3)), "d-after-9"]
        assert [e.labels.get("spool") for e in events[:3]] == [f"r1.jsonl#{i}" for i in (1, 2, 3)]
        assert (spool / "r1.jsonl").stat().st_size == 0  # emptied once all were in
        report = await back.verify()
        assert (report.ok, report.events) == (True, 4)
    finally:
        await back.aclose()


@pytest.mark.parametrize("change", ["one deleted", "two swapped", "a deny made an allow"])
def test_a_spool_changed_while_it_waited_is_on_record_when_drained(tmp_path: Path, redis_url: str, change: str) -> None:
    in_child("_spool_changed", redis_url, str(tmp_path), change)


async def _spool_changed(redis_url: str, tmp_path: Path, change: str) -> None:
    """Refusals spooled while Redis was down, then one deleted, two swapped, or a deny edited to
    an allow, before the drain: each went into the stream as it was, and verify said nothing.
    The drain follows the spool's own chain and records where it breaks, before the rest."""
    spool = tmp_path / "spool"
    down = RedisAuditLog(f"redis://127.0.0.1:{free_port()}/12", timeout_s=0.3, spool_dir=spool, instance="r1")
    for i in range(5):
        with pytest.raises(AuditError, match="Redis"):
            await down.append(event(i, "while-down", outcome="deny"))
    await down.aclose()
    path = spool / "r1.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    if change == "one deleted":
        del lines[1]
    elif change == "two swapped":
        lines[1], lines[2] = lines[2], lines[1]
    else:
        lines[3] = lines[3].replace(b'"outcome":"deny"', b'"outcome":"allow"')
    path.write_bytes(b"".join(lines))

    back = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")
    try:
        assert await back.check() is None  # drained
        events = await back.query(AuditFilter())
        broken = [e for e in events if e.outcome == "audit_spool_broken"]
        assert len(broken) == 1, [e.outcome for e in events]
        assert broken[0].result is not None
        assert broken[0].result["seq"] == {"one deleted": 2, "two swapped": 2, "a deny made an allow": 5}[change]
        assert len([e for e in events if e.decision_id.startswith("d-while-down")]) == len(lines)  # nothing dropped
    finally:
        await back.aclose()


async def _two_spools_on_one_host(_: str, tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/12"  # nothing listens there
    one = RedisAuditLog(url, timeout_s=0.3, spool_dir=tmp_path, instance="r")
    two = RedisAuditLog(url, timeout_s=0.3, spool_dir=tmp_path, instance="r")
    try:
        for log, name in ((one, "one"), (two, "two")):
            with pytest.raises(AuditError):
                await log.append(event(1, name))
    finally:
        await one.aclose()
        await two.aclose()
    assert b"d-one-1" in (tmp_path / "r.jsonl").read_bytes()
    assert b"d-two-1" in (tmp_path / "r.1.jsonl").read_bytes()


async def _went_backwards(redis_url: str, tmp_path: Path, loss: str) -> None:
    spool = tmp_path / "spool"
    log = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")
    for i in range(5):
        await log.append(event(i, "a"))
    db = client(redis_url)
    try:
        if loss == "flushed":
            db.flushdb()
        else:
            entries = xrange(db, STREAM)
            db.xdel(STREAM, *(entry_id for entry_id, _ in entries[3:]))  # the tail lost
            tree = CompactRange()
            for _, fields in entries[:3]:
                tree.append(bytes.fromhex(fields["hash"]))
            db.hset(HEAD, mapping={"seq": "3", "hash": entries[2][1]["hash"], "tree": json.dumps(tree.to_json())})
        with pytest.raises(AuditError, match="went backwards"):
            await log.append(event(5, "a"))
        assert "went backwards" in (await log.check() or "")
        await log.aclose()

        restarted = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")  # remembers across a restart
        with pytest.raises(AuditError, match="went backwards"):
            await restarted.append(event(6, "a"))
        await restarted.aclose()
        spooled = [json.loads(line)["decision_id"] for line in (spool / "r1.jsonl").read_bytes().splitlines()]
        assert spooled == ["d-a-5", "d-a-6"]  # refused, and on record locally

        (spool / "r1.jsonl.redis-head").unlink()  # the operator looked into it and accepts the new head
        accepted = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")
        try:
            kept = 0 if loss == "flushed" else 3
            written = await accepted.append(event(7, "a"))
            assert written.seq == kept + 3  # the two spooled events went in first
            labels = [e.labels.get("spool") for e in await accepted.query(AuditFilter())]
            assert labels[kept:] == ["r1.jsonl#1", "r1.jsonl#2", None]
            report = await accepted.verify()
            assert (report.ok, report.events) == (True, kept + 3)
        finally:
            await accepted.aclose()
    finally:
        db.close()


async def _loss_hidden_by_another_router(redis_url: str, tmp_path: Path) -> None:
    mine = RedisAuditLog(redis_url, spool_dir=tmp_path / "spool-a", instance="a")
    other = RedisAuditLog(redis_url)
    try:
        for i in range(3):
            await mine.append(event(i, "a"))
        db = client(redis_url)
        try:
            db.flushdb()
        finally:
            db.close()
        for i in range(5):  # the stream grows past where this router was, on a different chain
            await other.append(event(i, "b"))
        with pytest.raises(AuditError, match="went backwards"):
            await mine.append(event(3, "a"))
    finally:
        await mine.aclose()
        await other.aclose()


async def test_stockade_audit_prove_reads_the_stream_and_anyone_with_the_public_key_can_check_it(
    redis_url: str, tmp_path: Path
) -> None:
    options = keyed(tmp_path)
    log = RedisAuditLog(redis_url, options=options)
    for i in range(1, 21):
        await log.append(event(i, "prover"))
    checkpoint = await log.checkpoint()
    await log.aclose()
    assert checkpoint is not None
    assert checkpoint.size == 20
    # A checkpoint at 21 (its signature zeros), added by anyone who can write to the Redis: never proven against.
    fake = checkpoint.model_copy(update={"size": 21, "prev": checkpoint.digest(),
                                         "signature": base64.b64encode(bytes(64)).decode()})  # fmt: skip
    db = client(redis_url)
    try:
        db.xadd(CHECKPOINTS, {"checkpoint": fake.signed_text()})
    finally:
        db.close()
    env = {**os.environ, "STOCKADE_AUDIT__BACKEND": "redis", "STOCKADE_STORE__URL": redis_url,
           "STOCKADE_AUDIT__SIGNING_KEY": str(tmp_path / "none" / "audit.key")}  # no key (nor .pub) here  # fmt: skip
    argv = [str(STOCKADE), "audit", "prove", "--seq", "3", "--seq", "20", "--json"]
    unkeyed = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60,
                                      check=False)  # fmt: skip
    assert unkeyed.returncode == 2, unkeyed.stderr  # no public key here: nothing tells a signed checkpoint
    assert "--public-key" in unkeyed.stderr
    argv += ["--public-key", str(tmp_path / "keys" / "audit.key.pub")]
    said = await asyncio.to_thread(subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60,
                                   check=False)  # fmt: skip
    assert said.returncode == 0, said.stderr
    proofs = json.loads(said.stdout)
    assert [p["seq"] for p in proofs] == [3, 20]
    assert options.signer is not None
    for proof in proofs:
        signed = Checkpoint.model_validate(proof["checkpoint"])
        assert signed.verify(options.signer.verify_key)
        assert signed.size == 20
        leaf = line_hash(proof["line"].encode())
        assert leaf.hex() == proof["leaf_hash"]
        nodes = [bytes.fromhex(node) for node in proof["proof"]]
        assert verify_inclusion(leaf, proof["index"], signed.size, nodes, bytes.fromhex(signed.root))
        # The same proof for another event's line does not check out.
        other = line_hash(proof["line"].replace('"prover"', '"forger"').encode())
        assert not verify_inclusion(other, proof["index"], signed.size, nodes, bytes.fromhex(signed.root))
    beyond = await asyncio.to_thread(subprocess.run, [*argv[:3], "--seq", "21", *argv[-2:]], env=env,
                                     capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert beyond.returncode == 1
    assert "not covered by the latest checkpoint" in beyond.stdout + beyond.stderr


def test_a_drained_event_whose_answer_was_lost_is_chained_once(tmp_path: Path, redis_url: str) -> None:
    in_child("_drained_answer_lost", redis_url, str(tmp_path))


async def _drained_answer_lost(redis_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    down = RedisAuditLog(f"redis://127.0.0.1:{free_port()}/12", timeout_s=0.3, spool_dir=spool, instance="r1")
    with pytest.raises(AuditError):
        await down.append(event(0, "while-down"))
    await down.aclose()

    back = RedisAuditLog(redis_url, timeout_s=0.5, spool_dir=spool, instance="r1")
    script, calls = back._append, []

    async def answer_lost(keys: list[str], args: list[str]) -> object:
        """The first put (the drain's) runs in Redis, but its answer never arrives (a timeout, Redis killed)."""
        answer = await script(keys, args)
        calls.append(answer)
        if len(calls) == 1:
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return answer

    back._append = answer_lost  # type: ignore[assignment]
    try:
        with pytest.raises(AuditError, match="Timeout"):
            await back.append(event(1, "first"))  # the drain's put landed: this call is denied and spooled
        await back.append(event(2, "second"))  # the next drain finds the spooled event in the stream
        events = await back.query(AuditFilter())
        assert [e.decision_id for e in events] == ["d-while-down-0", "d-first-1", "d-second-2"]
        assert [e.labels.get("spool") for e in events] == ["r1.jsonl#1", "r1.jsonl#2", None]
        report = await back.verify()
        assert (report.ok, report.events) == (True, 3)
    finally:
        await back.aclose()


NOT_UTF8 = b'{"seq":4,"kind":"\xff\xfe"}'


async def test_an_entry_that_is_not_utf8_is_reported_broken_where_it_is(redis_url: str) -> None:
    log = RedisAuditLog(redis_url)
    raw = redis.Redis.from_url(redis_url)
    try:
        for i in range(3):
            await log.append(event(i, "a"))
        bad = raw.xadd(STREAM, {"event": NOT_UTF8, "hash": "00"})
        after = await log.append(event(3, "a"))  # the head is the router's: it chains past the entry
        assert after.seq == 4
        report = await log.verify()
        assert (report.ok, report.broken_seq, report.line) == (False, 4, 4)
        assert bad.decode() in report.problem
        events = await log.query(AuditFilter())
        assert [e.decision_id for e in events] == [f"d-a-{i}" for i in range(4)]
    finally:
        raw.close()
        await log.aclose()


def test_a_spool_drains_past_an_entry_that_is_not_utf8(tmp_path: Path, redis_url: str) -> None:
    in_child("_drain_past_not_utf8", redis_url, str(tmp_path))


async def _drain_past_not_utf8(redis_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    down = RedisAuditLog(f"redis://127.0.0.1:{free_port()}/12", timeout_s=0.3, spool_dir=spool, instance="r1")
    with pytest.raises(AuditError):
        await down.append(event(0, "while-down"))
    await down.aclose()
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.xadd(STREAM, {"event": b"\xff not an event", "hash": "00"})  # in the drain's look-back window
    finally:
        raw.close()

    back = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")
    try:
        assert await back.check() is None
        written = await back.append(event(1, "after"))
        assert written.seq == 2
        assert [e.decision_id for e in await back.query(AuditFilter())] == ["d-while-down-0", "d-after-1"]
    finally:
        await back.aclose()


async def test_a_tail_cut_after_the_last_checkpoint_is_seen_against_the_head(tmp_path: Path, redis_url: str) -> None:
    log = RedisAuditLog(redis_url, options=keyed(tmp_path))
    db = client(redis_url)
    try:
        for i in range(5):
            await log.append(event(i, "a"))
        await log.checkpoint()
        for i in range(5, 8):
            await log.append(event(i, "a"))
        db.xdel(STREAM, *(entry_id for entry_id, _ in xrange(db, STREAM)[-2:]))  # no router signed since
        report = await log.verify()
        assert (report.ok, report.broken_seq) == (False, 7)
        assert "7..8 were cut off" in report.problem
    finally:
        db.close()
        await log.aclose()


def test_a_spool_torn_by_a_crash_is_drained_up_to_its_last_whole_line(tmp_path: Path, redis_url: str) -> None:
    in_child("_torn_spool", redis_url, str(tmp_path))


async def _torn_spool(redis_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    down = RedisAuditLog(f"redis://127.0.0.1:{free_port()}/12", timeout_s=0.3, spool_dir=spool, instance="r1")
    for i in range(2):
        with pytest.raises(AuditError):
            await down.append(event(i, "while-down"))
    await down.aclose()
    torn = b'{"seq":3,"prev_hash":"ab","kind":"deci'
    with (spool / "r1.jsonl").open("ab") as handle:
        handle.write(torn)  # the router crashed mid-write

    back = RedisAuditLog(redis_url, spool_dir=spool, instance="r1")
    try:
        assert await back.check() is None  # drained, the torn line set aside
        written = await back.append(event(9, "after"))
        assert written.seq == 4
        events = await back.query(AuditFilter())
        assert [e.decision_id for e in events][:2] == ["d-while-down-0", "d-while-down-1"]
        assert events[2].outcome == "audit_torn_tail"
        assert events[2].result is not None
        assert events[2].result["sha256"] == hashlib.sha256(torn).hexdigest()
        assert (spool / events[2].result["set_aside"]).read_bytes() == torn
        assert events[3].decision_id == "d-after-9"
        assert (await back.verify()).ok
    finally:
        await back.aclose()


async def test_many_routers_appending_at_once_are_all_chained(redis_url: str) -> None:
    logs = [RedisAuditLog(redis_url) for _ in range(16)]
    try:
        written = await asyncio.gather(
            *(log.append(event(i, f"r{n}")) for i in range(40) for n, log in enumerate(logs)), return_exceptions=True
        )
        assert [w for w in written if isinstance(w, BaseException)] == []  # no call denied for contention
        report = await logs[0].verify()
        assert (report.ok, report.events) == (True, 16 * 40)
    finally:
        for log in logs:
            await log.aclose()


async def test_a_stream_rolled_back_behind_what_another_router_appended_is_refused_by_every_router(
    redis_url: str, tmp_path: Path
) -> None:
    """Redis restored from an older copy: router A's last events are gone, router B's (older) are
    still there. B once chained onto the old head, said it was ready, and signed the fork with the
    real key, so the publish directory held two signed histories. Every router now holds the
    stream to the largest head it saw it reach (its probes and the checkpoints it read), kept
    beside the key across restarts: B refuses to append or sign, /readyz says why, and so does a
    router started afresh with that anchor."""
    key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")

    def options(name: str) -> LogOptions:
        return LogOptions(signer=key, checkpoint_interval_s=3600, publish_dir=tmp_path / "published",
                          anchor=tmp_path / "keys" / f"anchor-{name}.json")  # fmt: skip

    a = RedisAuditLog(redis_url, spool_dir=tmp_path / "spool-a", instance="a", options=options("a"))
    b = RedisAuditLog(redis_url, spool_dir=tmp_path / "spool-b", instance="b", options=options("b"))
    db = client(redis_url)
    try:
        for i in range(1, 6):
            await b.append(event(i, "b"))
        for i in range(6, 21):
            await a.append(event(i, "a"))
        signed = await a.checkpoint()
        assert signed is not None
        assert signed.size == 20
        assert await b.check() is None  # B's probe sees the head at 20
        assert await b.checkpoint() == signed  # and reads the signed checkpoint: nothing new to sign
        # The restore: the stream, its head and its checkpoints as they were at seq 10.
        lines = [fields["event"] for _, fields in xrange(db, STREAM)][:10]
        db.delete(STREAM, CHECKPOINTS)
        tree = CompactRange()
        for line in lines:
            db.xadd(STREAM, {"event": line, "hash": line_hash(line.encode()).hex()})
            tree.append(line_hash(line.encode()))
        db.hset(HEAD, mapping={"seq": "10", "hash": line_hash(lines[-1].encode()).hex(),
                               "tree": json.dumps(tree.to_json())})  # fmt: skip
        db.hdel(HEAD, "checkpoint", "checkpoint_digest")
        with pytest.raises(AuditError, match="went backwards"):
            await b.append(event(21, "b"))
        assert "went backwards" in (await b.check() or "")
        with pytest.raises(AuditError, match="went backwards"):
            await b.checkpoint()
        assert db.hget(HEAD, "seq") == "10"  # nothing chained onto the restored head
        assert [p.name[:12] for p in (tmp_path / "published").iterdir()] == ["000000000020"]  # no fork signed
        # A fresh router with A's anchor (restarted after the restore) refuses at its first append.
        fresh = RedisAuditLog(redis_url, options=options("a"))
        try:
            with pytest.raises(AuditError, match="saw it reach seq 20"):
                await fresh.append(event(22, "a"))
        finally:
            await fresh.aclose()
    finally:
        db.close()
        await a.aclose()
        await b.aclose()


async def test_a_head_without_a_seq_is_a_readiness_problem_not_an_exception(redis_url: str) -> None:
    """Anyone with access to Redis can write the head: a seq that is not a number once made the
    probe behind /readyz raise; it is reported."""
    log = RedisAuditLog(redis_url)
    db = client(redis_url)
    try:
        await log.append(event(1, "a"))
        db.hset(HEAD, "seq", "seven")
        assert "holds no seq: 'seven'" in (await log.check() or "")
    finally:
        db.close()
        await log.aclose()


@pytest.mark.parametrize("reader", ["checkpoint", "check"])
async def test_an_append_ending_while_the_head_is_read_is_no_regression(
    tmp_path: Path, redis_url: str, reader: str
) -> None:
    """The timed checkpoint (and the readiness probe) read the head, then held it to what the
    router had seen by the time the answer came back: one of its own appends ending in between
    (its answer on another connection) made a head read just before it look like a stream gone
    backwards, and the router refused every append from then on (seen once in a Redis outage
    test under load). A read is now held to what was seen before it was sent."""
    log = RedisAuditLog(redis_url, options=keyed(tmp_path))
    await log.append(event(1, "r"))
    command = "hmget" if reader == "checkpoint" else "hget"
    real = getattr(log._redis, command)
    appended = asyncio.Event()

    async def head_read_then_delayed(*args: Any) -> Any:
        answer = await real(*args)  # the head as Redis holds it now
        await appended.wait()  # its answer arrives after an append of this router has ended
        return answer

    setattr(log._redis, command, head_read_then_delayed)
    reading = asyncio.create_task(log.checkpoint() if reader == "checkpoint" else log.check())
    await asyncio.sleep(0.05)
    await log.append(event(2, "r"))
    appended.set()
    outcome = await reading
    assert log.regressed is None
    assert outcome is None if reader == "check" else outcome is not None
    await log.append(event(3, "r"))  # the router goes on
    await log.aclose()

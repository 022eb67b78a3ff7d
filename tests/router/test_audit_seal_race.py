"""A segment sealed while a query reads the log: it must be in the answer, or the query must say
it is not. The writer seals by renaming the active file into the segments directory, so a reader
that listed the segments just before and opens the active file just after sees the events in
neither. The seal is made to land exactly there: the real `LogLayout.parts` runs, and a real
writer (its own thread, its own event loop) appends past the segment limit right after it."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

from router.audit import AuditEvent, timestamp
from router.audit.checkpoint import SigningKey
from router.audit.index import AuditQuery, EventFilter, index_dir_of, index_log
from router.audit.jsonl import JsonlAuditLog, LogOptions
from router.audit.layout import LogLayout, Part


class Writer:
    """A real JSONL log with 4 KiB segments, appended to from a thread of its own (as another
    process would: the reader's thread never waits on it)."""

    def __init__(self, tmp_path: Path) -> None:
        key = SigningKey.load_or_create(tmp_path / "keys" / "audit.key")
        options = LogOptions(signer=key, checkpoint_interval_s=3600, segment_max_bytes=4096)
        self.path = tmp_path / "log" / "audit.jsonl"
        self.path.parent.mkdir()
        self.log = JsonlAuditLog(self.path, durability="relaxed", options=options)
        self.appended = 0

    def append(self, count: int) -> None:
        async def go() -> None:
            for _ in range(count):
                self.appended += 1
                await self.log.append(AuditEvent.model_validate({
                    "decision_id": f"d-{self.appended}", "timestamp": timestamp(), "kind": "decision",
                    "outcome": "allow", "result": {"pad": "x" * 200},
                }))  # fmt: skip

        thread = threading.Thread(target=lambda: asyncio.run(go()))
        thread.start()
        thread.join()

    def close(self) -> None:
        thread = threading.Thread(target=lambda: asyncio.run(self.log.aclose()))
        thread.start()
        thread.join()


@pytest.fixture
def writer(tmp_path: Path) -> Writer:
    return Writer(tmp_path)


def seal_after_next_listing(monkeypatch: pytest.MonkeyPatch, writer: Writer, count: int) -> list[bool]:
    """Right after the next listing of the log's parts, the writer appends ``count`` events (sealing
    the active segment); returns the switch that arms it."""
    listed: Callable[[LogLayout], list[Part]] = LogLayout.parts
    armed = [False]

    def parts(self: LogLayout) -> list[Part]:
        found = listed(self)
        if armed[0]:
            armed[0] = False
            writer.append(count)
        return found

    monkeypatch.setattr(LogLayout, "parts", parts)
    return armed


def test_a_segment_sealed_while_a_query_lists_the_log_is_still_in_its_answer(
    monkeypatch: pytest.MonkeyPatch, writer: Writer
) -> None:
    writer.append(30)
    armed = seal_after_next_listing(monkeypatch, writer, 15)
    with AuditQuery(writer.path) as query:
        armed[0] = True  # the query's next refresh lists, then the writer seals under it
        seqs = [row[0] for row in query.events(EventFilter(), columns=("seq",))]
    assert not armed[0]
    assert seqs == list(range(1, writer.appended + 1))
    writer.close()


def test_a_pager_never_skips_a_segment_sealed_between_its_pages(
    monkeypatch: pytest.MonkeyPatch, writer: Writer
) -> None:
    writer.append(30)
    armed = seal_after_next_listing(monkeypatch, writer, 15)
    with AuditQuery(writer.path) as query:  # long-lived, as the HTTP API's
        delivered = [row[0] for row in query.events(EventFilter(), columns=("seq",))]
        writer.append(3)
        armed[0] = True
        while page := [row[0] for row in query.events(EventFilter(after_seq=delivered[-1]), columns=("seq",))]:
            delivered += page
    assert delivered == list(range(1, writer.appended + 1))
    writer.close()


def test_an_index_file_that_lost_rows_is_not_used(writer: Writer) -> None:
    """An index file that lost rows, its marker still naming the segment's bytes: its footers no
    longer hold one row per seq of the segment, so the segment is read from the log, and every
    query, a seq range or a filter, answers the events the log's files hold."""
    writer.append(40)
    writer.close()
    index_log(writer.path)
    marker = sorted((index_dir_of(writer.path) / "segments").glob("*.json"))[1]
    file = index_dir_of(writer.path) / json.loads(marker.read_text())["files"][0]
    first = int(marker.name[:12])
    shrunk = file.with_name("shrunk.parquet")
    duckdb.connect().execute(
        f"COPY (SELECT * FROM read_parquet('{file}') WHERE seq <> {first + 1}) TO '{shrunk}' (FORMAT parquet)"  # noqa: S608  (the test's own path)
    )
    shrunk.replace(file)
    with AuditQuery(writer.path) as query:
        assert query.unindexed == [marker.stem]
        assert [row[0] for row in query.events(EventFilter(), columns=("seq",))] == list(range(1, 41))
        rows = list(query.events(EventFilter(after_seq=first - 1, to_seq=first + 3), columns=("seq", "hash", "event")))
        assert [row[0] for row in rows] == list(range(first, first + 4))
        assert first + 1 in [row[0] for row in query.events(EventFilter(kind="decision"), columns=("seq",))]

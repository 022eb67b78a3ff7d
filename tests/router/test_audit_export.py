"""Exports of a real log (written through `JsonlAuditLog.append`, partly indexed): each format holds
the selected events, and its proof file proves each one against the log's signed checkpoint with
nothing but the public key."""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest

from router.audit import line_hash
from router.audit.checkpoint import Checkpoint, VerifyKey
from router.audit.export import CSV_COLUMNS, export_events, proof_path
from router.audit.index import EventFilter
from router.audit.merkle import verify_inclusion
from tests.router.test_audit_query import (
    BIG,
    HOSTILE,
    START,
    Calls,
    Log,
    append,
    audit_log,  # noqa: F401  (the query tests' log fixture, used here too)
    documents,
    expected,
    stockade,
)


@pytest.fixture
def log_copy(tmp_path: Path, audit_log: Log) -> Log:  # noqa: F811  (the imported fixture)
    """A copy of the query tests' log (indexed segments, one not indexed, an active one)."""
    shutil.copytree(audit_log.path.parent, tmp_path / "log")
    return Log(tmp_path / "log" / "audit.jsonl", tmp_path / "log" / "keys" / "audit.key")


def checked_proofs(log: Log, export: Path) -> tuple[dict[str, Any], dict[int, str]]:
    """The export's proof document, every proof checked against its checkpoint, and the checkpoint
    checked against the log's public key; the leaf hash of each exported seq."""
    proof = json.loads(proof_path(export).read_text())
    checkpoint = Checkpoint.model_validate(proof["checkpoint"])
    assert checkpoint.verify(VerifyKey.load(log.key.with_name(log.key.name + ".pub")))
    root = bytes.fromhex(checkpoint.root)
    leaves = {}
    for item in proof["proofs"]:
        assert item["index"] == item["seq"] - 1
        assert verify_inclusion(bytes.fromhex(item["leaf_hash"]), item["index"], checkpoint.size,
                                [bytes.fromhex(node) for node in item["proof"]], root)  # fmt: skip
        leaves[item["seq"]] = item["leaf_hash"]
    assert proof["events"] == len(leaves)
    return proof, leaves


def test_a_jsonl_export_is_the_lines_as_written_each_proven(tmp_path: Path, log_copy: Log) -> None:
    target = tmp_path / "out" / "export.jsonl"
    target.parent.mkdir()
    done = export_events(log_copy.path, target)
    docs = documents(log_copy.path)
    assert done.events == len(docs)
    assert done.left_out == 0
    assert target.read_bytes() == b"".join(d["_line"] + b"\n" for d in docs)
    _, leaves = checked_proofs(log_copy, target)
    assert leaves == {d["seq"]: line_hash(d["_line"]).hex() for d in docs}
    assert max(len(line) for line in target.read_bytes().splitlines()) > len(BIG)


def test_an_export_selects_by_time_or_by_seq(tmp_path: Path, log_copy: Log) -> None:
    since, until = START + timedelta(days=1), START + timedelta(days=2, hours=3)
    by_time = export_events(log_copy.path, tmp_path / "t.jsonl", where=EventFilter(since=since, until=until))
    by_seq = export_events(log_copy.path, tmp_path / "s.jsonl", where=EventFilter(after_seq=99, to_seq=250))
    lines = {d["_line"]: d["seq"] for d in documents(log_copy.path)}
    time_seqs = [lines[line] for line in (tmp_path / "t.jsonl").read_bytes().splitlines()]
    assert time_seqs == expected(log_copy.path, EventFilter(since=since, until=until))
    assert by_time.events
    assert [lines[line] for line in (tmp_path / "s.jsonl").read_bytes().splitlines()] == list(range(100, 251))
    assert (by_seq.first_seq, by_seq.last_seq) == (100, 250)
    checked_proofs(log_copy, tmp_path / "s.jsonl")


def test_events_after_the_latest_checkpoint_are_left_out_and_counted(tmp_path: Path, log_copy: Log) -> None:
    checkpoints = log_copy.path.with_name(log_copy.path.name + ".checkpoints")
    kept = checkpoints.read_text().splitlines(keepends=True)
    last = Checkpoint.model_validate_json(kept[-2])
    checkpoints.write_text("".join(kept[:-1]))  # as if the last events were appended after it
    done = export_events(log_copy.path, tmp_path / "e.jsonl")
    total = len(documents(log_copy.path))
    assert (done.events, done.left_out, done.checkpoint_size) == (last.size, total - last.size, last.size)
    checked_proofs(log_copy, tmp_path / "e.jsonl")


def test_ocsf_records_carry_the_required_fields_and_the_event(tmp_path: Path, log_copy: Log) -> None:
    export_events(log_copy.path, tmp_path / "o.jsonl", fmt="ocsf")
    _, leaves = checked_proofs(log_copy, tmp_path / "o.jsonl")
    classes = {"decision": 6003, "approval": 6003, "credential": 3002, "execution": 1007, "egress": 4002,
               "error": 6003}  # fmt: skip
    docs = {d["seq"]: d for d in documents(log_copy.path)}
    for line in (tmp_path / "o.jsonl").read_text().splitlines():
        record = json.loads(line)
        event = record["unmapped"]
        document = docs[event["seq"]]
        for field in ("activity_id", "category_uid", "class_uid", "type_uid", "severity_id", "status_id", "time"):
            assert isinstance(record[field], int), field
        assert record["class_uid"] == classes[document["kind"]]
        assert record["type_uid"] == record["class_uid"] * 100 + record["activity_id"]
        assert record["metadata"]["product"]["name"] == "stockade"
        assert record["metadata"]["uid"] == document["decision_id"]
        assert record["metadata"]["version"].startswith("1.")
        at = datetime.fromisoformat(document["timestamp"].replace("Z", "+00:00"))
        assert record["time"] == int(at.timestamp() * 1000)
        assert event["hash"] == leaves[event["seq"]] == line_hash(document["_line"]).hex()
        assert {k: v for k, v in event.items() if k != "hash"} == {
            k: v for k, v in document.items() if k not in ("_line", "hash", "decision_id", "timestamp")
        }
        if document["kind"] == "egress":
            assert record["dst_endpoint"]["hostname"] == document["result"]["host"]
            assert record["action_id"] == (1 if document["outcome"] == "allow" else 2)


def test_csv_holds_the_promoted_columns_and_hostile_text_survives(tmp_path: Path, log_copy: Log) -> None:
    done = export_events(log_copy.path, tmp_path / "c.csv", fmt="csv")
    _, leaves = checked_proofs(log_copy, tmp_path / "c.csv")
    with (tmp_path / "c.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert len(rows) == done.events
    assert {int(r["seq"]): r["hash"] for r in rows} == leaves
    agents = {r["agent"] for r in rows}
    assert "agent-'c" in agents
    notes = {r["approver"] for r in rows if r["kind"] == "approval" and r["approver"]}
    assert "o'brien" in notes
    assert any(json.loads(r["credential"]) == ["gh'token"] for r in rows if r["kind"] == "credential")


def test_parquet_holds_every_column_and_the_lines_as_written(tmp_path: Path, log_copy: Log) -> None:
    done = export_events(log_copy.path, tmp_path / "p.parquet", fmt="parquet")
    _, leaves = checked_proofs(log_copy, tmp_path / "p.parquet")
    query = "SELECT seq, hash, event FROM read_parquet(?) ORDER BY seq"
    rows = duckdb.connect().execute(query, [str(tmp_path / "p.parquet")]).fetchall()
    docs = documents(log_copy.path)
    assert len(rows) == done.events == len(docs)
    for (seq, digest, event), document in zip(rows, docs, strict=True):
        assert (seq, event.encode()) == (document["seq"], document["_line"])
        assert digest == leaves[seq]


def test_hostile_text_in_events_survives_every_format(tmp_path: Path, log_copy: Log) -> None:
    calls = Calls(seed=3)
    calls.at = START + timedelta(days=9)
    asyncio.run(append(log_copy.path, log_copy.key, calls.session(3)))
    since = EventFilter(since=datetime(2026, 3, 10, tzinfo=UTC))
    for fmt in ("jsonl", "ocsf", "csv", "parquet"):
        done = export_events(log_copy.path, tmp_path / f"h.{fmt}", fmt=fmt, where=since)
        assert done.events == len(expected(log_copy.path, since)) > 0
        checked_proofs(log_copy, tmp_path / f"h.{fmt}")
    text = (tmp_path / "h.ocsf").read_text()
    assert any(
        h in text
        for h in ("'; DROP TABLE events; --", "nul\\u0000byte", HOSTILE[4].encode("utf-8", "backslashreplace").decode())
    )


def test_stockade_audit_export_writes_the_file_and_its_proof(tmp_path: Path, log_copy: Log) -> None:
    target = tmp_path / "cli.jsonl"
    result = stockade("audit", "export", "--path", str(log_copy.path), "--format", "jsonl", "--from-seq", "5",
                      "--to-seq", "9", "-o", str(target), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["events"] == 5
    assert [json.loads(line)["seq"] for line in target.read_text().splitlines()] == [5, 6, 7, 8, 9]
    checked_proofs(log_copy, target)
    backwards = stockade("audit", "export", "--path", str(log_copy.path), "--from-seq", "9", "--to-seq", "5", "-o",
                         str(tmp_path / "x.jsonl"))  # fmt: skip
    assert backwards.returncode == 2
    assert "--from-seq" in backwards.stderr

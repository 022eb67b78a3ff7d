"""Exports of a real log (written through `JsonlAuditLog.append`, partly indexed): each format holds
the selected events, and its proof file proves each one against the log's signed checkpoint with
nothing but the public key."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest

from router.audit import AuditEvent, line_hash
from router.audit.checkpoint import Checkpoint, SigningKey, VerifyKey
from router.audit.export import CSV_COLUMNS, export_events, proof_path, verify_export
from router.audit.index import EventFilter
from router.audit.merkle import verify_inclusion
from router.audit.ocsf import to_ocsf
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
    csv.field_size_limit(1 << 27)  # the event column holds whole lines, one of 1 MiB
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
    pub = str(log_copy.key.with_name(log_copy.key.name + ".pub"))
    result = stockade("audit", "export", "--path", str(log_copy.path), "--format", "jsonl", "--from-seq", "5",
                      "--to-seq", "9", "-o", str(target), "--json", "--public-key", pub)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["events"] == 5
    assert [json.loads(line)["seq"] for line in target.read_text().splitlines()] == [5, 6, 7, 8, 9]
    checked_proofs(log_copy, target)
    backwards = stockade("audit", "export", "--path", str(log_copy.path), "--from-seq", "9", "--to-seq", "5", "-o",
                         str(tmp_path / "x.jsonl"))  # fmt: skip
    assert backwards.returncode == 2
    assert "--from-seq" in backwards.stderr


# -- verifying an export with nothing but the public key -------------------------------------------

FORMULAS = ['=HYPERLINK("http://x","y")', "+1+1", "-2+3", "@SUM(A1)", "\tlead", "\rcr"]


def public_key(log: Log) -> VerifyKey:
    return VerifyKey.load(log.key.with_name(log.key.name + ".pub"))


def exported(tmp_path: Path, log: Log, fmt: str, where: EventFilter | None = None) -> Path:
    target = tmp_path / f"export.{fmt}"
    export_events(log.path, target, fmt=fmt, where=where)  # type: ignore[arg-type]
    return target


def rewrite_proof(export: Path, change: Any = None) -> None:
    """What someone holding only the export can do to its proof: anything but sign (here: drop or
    reorder proof entries, and put the file's new sha256 in)."""
    lines = proof_path(export).read_text().split("\n")
    head, items = lines[0], [line.rstrip(",") for line in lines[1:-2]]
    if change is not None:
        items = change(items)
    document = json.loads(head.removesuffix(',"proofs":[') + "}")
    document["file_sha256"] = hashlib.sha256(export.read_bytes()).hexdigest()
    document["events"] = len(items)
    leaves = hashlib.sha256()
    for item in map(json.loads, items):
        leaves.update(b"%d:%s\n" % (item["seq"], item["leaf_hash"].encode()))
    document["leaves_sha256"] = leaves.hexdigest()
    head = json.dumps(document, separators=(",", ":"))[:-1] + ',"proofs":['
    proof_path(export).write_text(head + "\n" + ",\n".join(items) + "\n]}\n")


@pytest.mark.parametrize("fmt", ["jsonl", "ocsf", "csv", "parquet"])
def test_an_untouched_export_verifies_with_the_public_key_alone(tmp_path: Path, log_copy: Log, fmt: str) -> None:
    by_seq = EventFilter(after_seq=20, to_seq=180)
    check = verify_export(exported(tmp_path, log_copy, fmt, by_seq), public_key(log_copy))
    assert (check.ok, check.problem, check.events) == (True, "", 160)
    assert check.selection == {"filter": {}, "after_seq": 20, "to_seq": 180, "complete": True}
    filtered = EventFilter(kind="decision", agent="agent-'c")
    check = verify_export(exported(tmp_path, log_copy, fmt, filtered), public_key(log_copy))
    assert (check.ok, check.problem, check.events) == (True, "", len(expected(log_copy.path, filtered)))
    assert check.selection is not None
    assert check.selection["filter"] == {"agent": "agent-'c", "kind": "decision"}
    assert check.selection["complete"] is False


def test_an_ocsf_record_rewritten_around_its_hash_is_caught(tmp_path: Path, log_copy: Log) -> None:
    export = exported(tmp_path, log_copy, "ocsf")
    lines = export.read_bytes().split(b"\n")
    record = json.loads(lines[3])
    record["status_id"], record["status"], record["actor"]["app_name"] = 1, "Success", "innocent-bot"
    record["unmapped"]["agent"] = "innocent-bot"
    lines[3] = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    export.write_bytes(b"\n".join(lines))
    rewrite_proof(export)
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.record, check.seq) == (False, 4, record["metadata"]["sequence"])
    assert "OCSF fields are not those of its line" in check.problem
    # The line itself rewritten as well: its hash is no longer the proven leaf.
    record["raw_data"] = record["raw_data"].replace('"agent":"', '"agent":"innocent-', 1)
    lines[3] = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    export.write_bytes(b"\n".join(lines))
    rewrite_proof(export)
    assert not verify_export(export, public_key(log_copy)).ok


def test_a_csv_row_rewritten_around_its_hash_is_caught(tmp_path: Path, log_copy: Log) -> None:
    export = exported(tmp_path, log_copy, "csv")
    csv.field_size_limit(1 << 27)
    with export.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    header = rows[0]
    rows[2][header.index("agent")], rows[2][header.index("outcome")] = "innocent-bot", "allow"
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    export.write_text(out.getvalue(), encoding="utf-8")
    rewrite_proof(export)
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.record, check.seq) == (False, 2, int(rows[2][0]))
    assert "cells are not those of its line" in check.problem


@pytest.mark.parametrize("cell", ['=HYPERLINK("http://127.0.0.1/x?"&A1,"click")', "-1", "12 ", "\u0661\u0662"])
def test_a_csv_line_offset_cell_holding_anything_but_digits_is_caught(tmp_path: Path, log_copy: Log, cell: str) -> None:
    """``line_offset`` is the one cell a CSV row's line does not hold, so it cannot be checked
    against it: only its form can, a byte offset or nothing. Else, with the export unsigned (the
    exporter did not hold the signing key), a spreadsheet formula put there still verified."""
    export = exported(tmp_path, log_copy, "csv")
    csv.field_size_limit(1 << 27)
    with export.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    offset = rows[0].index("line_offset")
    assert any(row[offset] for row in rows[1:])  # offsets as exported: digits, or nothing
    assert all(row[offset].isdigit() or not row[offset] for row in rows[1:])
    rows[3][offset] = cell
    out = io.StringIO()
    csv.writer(out, lineterminator="\n", quoting=csv.QUOTE_ALL).writerows(rows)
    export.write_text(out.getvalue(), encoding="utf-8")
    rewrite_proof(export)
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.record, check.seq) == (False, 3, int(rows[3][0]))
    assert "line_offset cell is not a byte offset" in check.problem


def test_a_parquet_row_rewritten_around_its_hash_is_caught(tmp_path: Path, log_copy: Log) -> None:
    export = exported(tmp_path, log_copy, "parquet")
    forged = tmp_path / "forged.parquet"
    duckdb.connect().execute(
        "COPY (SELECT * REPLACE (CASE WHEN seq = 30 THEN 'innocent-bot' ELSE agent END AS agent) "  # noqa: S608  (test's paths)
        f"FROM read_parquet('{export}')) TO '{forged}' (FORMAT parquet)"
    )
    shutil.copy(proof_path(export), proof_path(forged))
    rewrite_proof(forged)
    check = verify_export(forged, public_key(log_copy))
    assert (check.ok, check.seq) == (False, 30)
    assert "columns are not those of its line" in check.problem
    # The event text rewritten too, its hash column with it: the leaf is computed, never read.
    duckdb.connect().execute(
        'COPY (SELECT * REPLACE (CASE WHEN seq = 30 THEN replace(event, \'"outcome":"\', \'"outcome":"x\') '  # noqa: S608
        "ELSE event END AS event, CASE WHEN seq = 30 THEN sha256('\\x00'::BLOB || encode(replace(event, "
        '\'"outcome":"\', \'"outcome":"x\'))) ELSE hash END AS hash) '
        f"FROM read_parquet('{export}')) TO '{forged}' (FORMAT parquet)"
    )
    rewrite_proof(forged)
    check = verify_export(forged, public_key(log_copy))
    assert (check.ok, check.seq) == (False, 30)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_events_dropped_or_reordered_with_their_proofs_are_caught(tmp_path: Path, log_copy: Log, fmt: str) -> None:
    """Whoever holds the export can drop or reorder records and their proof entries alike; a range
    exported whole must hold every seq of it, in order, each chained to the one before."""
    export = exported(tmp_path, log_copy, fmt, EventFilter(after_seq=10, to_seq=60))
    original, proof = export.read_bytes(), proof_path(export).read_bytes()
    skip = 1 if fmt == "csv" else 0  # the CSV's header
    lines = original.split(b"\n")
    del lines[skip + 5]
    export.write_bytes(b"\n".join(lines))
    rewrite_proof(export, lambda items: items[:5] + items[6:])
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.seq, check.problem) == (False, 17, "events 16..16 of the range are missing")
    proof_path(export).write_bytes(proof)
    lines = original.split(b"\n")
    lines[skip + 2], lines[skip + 7] = lines[skip + 7], lines[skip + 2]
    export.write_bytes(b"\n".join(lines))
    rewrite_proof(export, lambda items: [*items[:2], items[7], *items[3:7], items[2], *items[8:]])
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.record, check.problem) == (False, 3, "events 13..17 of the range are missing")
    proof_path(export).write_bytes(proof)
    lines = original.split(b"\n")
    export.write_bytes(b"\n".join([*lines[:-3], b""]))  # the last two events cut off, and their proofs
    rewrite_proof(export, lambda items: items[:-2])
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.problem) == (False, "events 59..60 of the range are missing at its end")


def test_a_narrowed_selection_shows_and_a_signed_one_cannot_be_narrowed(tmp_path: Path, log_copy: Log) -> None:
    export = tmp_path / "signed.jsonl"
    key = SigningKey.load_or_create(log_copy.key)
    export_events(log_copy.path, export, where=EventFilter(after_seq=10, to_seq=60), signer=key)
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.signed_selection) == (True, True)
    lines = export.read_bytes().split(b"\n")
    export.write_bytes(b"\n".join([*lines[:-3], b""]))

    def narrowed(items: list[str]) -> list[str]:
        return items[:-2]

    rewrite_proof(export, narrowed)
    head = proof_path(export).read_text().split("\n", 1)
    document = json.loads(head[0].removesuffix(',"proofs":[') + "}")
    document["selection"]["to_seq"] = 58
    proof_path(export).write_text(json.dumps(document)[:-1] + ',"proofs":[\n' + head[1])
    check = verify_export(export, public_key(log_copy))
    assert (check.ok, check.problem) == (False, "the proof's header signature does not verify: it was altered")


def test_a_filtered_export_holds_only_matching_events(tmp_path: Path, log_copy: Log) -> None:
    everything = exported(tmp_path, log_copy, "jsonl")
    items = (i.rstrip(",") for i in proof_path(everything).read_text().split("\n")[1:-2])
    proofs = {json.loads(item)["seq"]: item for item in items}
    export = tmp_path / "decisions.jsonl"
    export_events(log_copy.path, export, where=EventFilter(kind="decision"))
    other = next(d for d in documents(log_copy.path) if d["kind"] != "decision" and d["seq"] > 5)
    # A record that does not match, put where its seq belongs with its genuine proof: only the filter tells.
    records = sorted([*export.read_bytes().split(b"\n")[:-1], other["_line"]], key=lambda line: json.loads(line)["seq"])
    export.write_bytes(b"\n".join(records) + b"\n")
    rewrite_proof(export, lambda items: sorted([*items, proofs[other["seq"]]], key=lambda i: json.loads(i)["seq"]))
    check = verify_export(export, public_key(log_copy))
    seq = other["seq"]
    assert (check.ok, check.seq, check.problem) == (False, seq, f"seq {seq} does not match the selection's filter")


@pytest.mark.parametrize(
    "value",
    [
        "1e16",
        "10000000000000000.0",
        "-0",
        "1e-7",
        "null",
        "1.5e+300",
        '{"c": {"d": -0.0}, "b": [1e16, "ü"], "a": null}',
    ],
)
def test_an_export_filtered_by_an_argument_holds_its_events_and_verifies(
    tmp_path: Path, log_copy: Log, value: str
) -> None:
    """The export selects with the index and its verifier with the Python twin: however an argument
    is written (DuckDB writes 1e+16 as 10000000000000000.0), both select the same events."""
    where = EventFilter(args=(("v", value),))
    target = tmp_path / "v.jsonl"
    done = export_events(log_copy.path, target, where=where)
    want = expected(log_copy.path, where)
    assert done.events > 0
    assert [json.loads(line)["seq"] for line in target.read_bytes().splitlines()] == want[: done.events]
    assert done.events + done.left_out == len(want)
    check = verify_export(target, public_key(log_copy))
    assert (check.ok, check.problem, check.events) == (True, "", done.events)


def test_csv_cells_that_a_spreadsheet_would_run_are_quoted_and_still_verify(tmp_path: Path, log_copy: Log) -> None:
    events = [
        AuditEvent.model_validate({"decision_id": f"f-{i}", "timestamp": "2026-03-12T10:00:00.000000Z",
                                   "kind": "decision", "agent": formula, "tool": formula, "outcome": "deny"})
        for i, formula in enumerate(FORMULAS)
    ]  # fmt: skip
    asyncio.run(append(log_copy.path, log_copy.key, events))
    export = exported(tmp_path, log_copy, "csv", EventFilter(tool=FORMULAS[0]))
    csv.field_size_limit(1 << 27)
    with export.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["agent"] for r in rows] == ["'" + FORMULAS[0]]
    everything = exported(tmp_path, log_copy, "csv", EventFilter(since=datetime(2026, 3, 12, tzinfo=UTC)))
    with everything.open(newline="", encoding="utf-8") as handle:
        cells = [cell for row in csv.reader(handle) for cell in row[:-1]]
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    assert {"'" + f for f in FORMULAS} <= set(cells)
    assert verify_export(everything, public_key(log_copy)).ok


def test_an_execution_an_external_tool_reported_is_a_success_in_ocsf() -> None:
    document = {"kind": "execution", "outcome": "reported", "tool": "search", "result": {"verdict": "reported"}}
    record = to_ocsf(document, "0" * 64)
    assert (record["status_id"], record["status"], record["severity_id"]) == (1, "Success", 1)
    failed = to_ocsf({**document, "outcome": "timeout"}, "0" * 64)
    assert (failed["status_id"], failed["severity_id"]) == (2, 3)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`stockade` with ``env`` added to this process's environment."""
    return subprocess.run([str(Path(sys.executable).parent / "stockade"), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, check=False)  # fmt: skip


def test_stockade_audit_verify_export_checks_an_export_with_the_public_key_and_names_a_tampered_record(
    tmp_path: Path, log_copy: Log
) -> None:
    pub = str(log_copy.key.with_name(log_copy.key.name + ".pub"))
    target = tmp_path / "cli.csv"
    # On the router's host the exporter holds the log's key: the selection is signed.
    holder = {"STOCKADE_AUDIT__SIGNING_KEY": str(log_copy.key)}
    done = cli(holder, "audit", "export", "--path", str(log_copy.path), "--format", "csv", "--from-seq", "5",
               "--to-seq", "40", "-o", str(target))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "not signed" not in done.stderr
    good = stockade("audit", "verify-export", str(target), "--public-key", pub, "--json")
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    assert (report["ok"], report["events"], report["signed_selection"]) == (True, 36, True)

    csv.field_size_limit(1 << 27)
    with target.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    outcome = rows[0].index("outcome")
    rows[10][outcome] = "allow" if rows[10][outcome] != "allow" else "deny"  # record 10: the header is row 0
    with target.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle, lineterminator="\n", quoting=csv.QUOTE_ALL).writerows(rows)
    bad = stockade("audit", "verify-export", str(target), "--public-key", pub)
    assert bad.returncode == 1
    assert "FAILED at record 10" in bad.stderr

    # Another key than the one that signed the log's checkpoints never signs its exports, nor
    # chooses their checkpoint: that one's own key signed none (exit 1), the log's public key does.
    stranger = {"STOCKADE_AUDIT__SIGNING_KEY": str(tmp_path / "other" / "audit.key")}
    SigningKey.load_or_create(tmp_path / "other" / "audit.key")
    refused = cli(stranger, "audit", "export", "--path", str(log_copy.path), "-o", str(tmp_path / "u.jsonl"))
    assert refused.returncode == 1, refused.stderr
    assert "no checkpoint signed by the log's public key" in refused.stderr
    unsigned = cli(stranger, "audit", "export", "--path", str(log_copy.path), "-o", str(tmp_path / "u.jsonl"),
                   "--public-key", pub)  # fmt: skip
    assert unsigned.returncode == 0, unsigned.stderr
    assert "not signed" in unsigned.stderr
    assert stockade("audit", "verify-export", str(tmp_path / "u.jsonl"), "--public-key", pub).returncode == 0
    missing = stockade("audit", "verify-export", str(tmp_path / "nothing.csv"), "--public-key", pub)
    assert missing.returncode == 2


def test_stockade_audit_sql_csv_quotes_what_a_spreadsheet_would_run(log_copy: Log) -> None:
    events = [
        AuditEvent.model_validate({"decision_id": f"q-{i}", "timestamp": "2026-03-13T10:00:00.000000Z",
                                   "kind": "decision", "agent": formula, "tool": "sheet", "outcome": "deny"})
        for i, formula in enumerate(FORMULAS)
    ]  # fmt: skip
    asyncio.run(append(log_copy.path, log_copy.key, events))
    done = subprocess.run([str(Path(sys.executable).parent / "stockade"), "audit", "sql", "--path", str(log_copy.path),
                           "--csv", "SELECT agent FROM events WHERE tool = 'sheet' ORDER BY seq"],
                          capture_output=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # Read as bytes: CRLF rows, and a lone CR inside a quoted cell, as a spreadsheet reads them.
    cells = [row[0] for row in csv.reader(io.StringIO(done.stdout.decode(), newline=""))]
    assert cells == ["agent", *("'" + f for f in FORMULAS)]

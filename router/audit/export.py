"""Exports of the audit log that carry their own proof, and their verification.

An export is events as JSONL (the lines as written, byte for byte), OCSF, CSV or Parquet, and beside
the file ``<file>.proof.json``: the log's latest signed checkpoint, the selection (the filter and the
seq range) and, for every exported event, its leaf hash and RFC 9162 inclusion proof against that
checkpoint. Every format carries each event's line exactly as the log wrote it (JSONL: the line;
OCSF: ``raw_data``; CSV and Parquet: the ``event`` column), so the leaf is ``SHA-256(0x00 ‖ line)``
computed from the export itself, never a hash a record merely claims; the other fields of a record
are checked against its line (`verify_export`). What verification shows, with nothing but the log's
public key:

- every record is the log's event at its seq, and says what that event says;
- records are in seq order, within the selection's range, and each one matches its filter;
- for a seq range exported whole (no other filter), no event of the range is missing: seqs follow
  each other, and each event's ``prev_hash`` is the hash of the one before it.

The selection is a claim of the exporter: signed (``signature``) when the exporter held the log's
signing key, otherwise to be compared with what was asked for (`ExportCheck.selection`). Only events
the checkpoint covers are exported: ones appended after it are left out, and counted.
"""

from __future__ import annotations

import base64
import binascii
import csv
import dataclasses
import hashlib
import io
import json
import os
import re
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from router.audit.chain import head_of, line_hash
from router.audit.duck import load_duckdb
from router.audit.index import COLUMNS, AuditQuery, EventFilter, matches, promote
from router.audit.layout import LogLayout
from router.audit.ocsf import to_ocsf
from router.errors import AuditError

if TYPE_CHECKING:
    import duckdb

    from router.audit.checkpoint import SigningKey, VerifyKey

__all__ = [
    "CSV_COLUMNS",
    "PROOF_FORMAT",
    "ExportCheck",
    "ExportFormat",
    "ExportReport",
    "csv_cell",
    "export_events",
    "proof_path",
    "verify_export",
]

ExportFormat = Literal["jsonl", "ocsf", "csv", "parquet"]
PROOF_FORMAT = "stockade-export-proof/2"
CSV_COLUMNS = tuple(COLUMNS)
"""The columns of a CSV export: the promoted ones (lists as JSON arrays, times ISO 8601 UTC), then
``event``, the line as written, which the others are checked against."""
# Where the line sat in its segment file: not in the line itself, so not checked against it; in a
# CSV export only its form is (a number, or nothing), or a formula could ride in it and still verify.
_UNCHECKED = frozenset({"line_offset"})
_MAX_CELL = 1 << 27  # bytes of a CSV cell the verifier reads: a line of the log is at most 64 MiB
_FORMULA = ("=", "+", "-", "@", "\t", "\r")  # what makes a spreadsheet read a cell as a formula (OWASP)


def proof_path(file: Path) -> Path:
    """Where the proof of an export to ``file`` is written: ``<file>.proof.json``."""
    return file.with_name(file.name + ".proof.json")


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What `export_events` wrote."""

    file: Path
    proof: Path
    format: str
    events: int
    first_seq: int | None
    last_seq: int | None
    checkpoint_size: int
    """The size of the checkpoint the proofs are against: every exported seq is at most this."""
    left_out: int
    """Events matching the filter after ``checkpoint_size``: not covered yet, so not exported."""
    sha256: str
    signed_selection: bool = False
    """Whether the proof's header (the selection) is signed with the checkpoint's key."""

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "file": str(self.file), "proof": str(self.proof)}


def export_events(
    audit_path: Path,
    target: Path,
    *,
    fmt: ExportFormat = "jsonl",
    where: EventFilter | None = None,
    index_dir: Path | None = None,
    signer: SigningKey | None = None,
    keys: Sequence[VerifyKey] | None = None,
) -> ExportReport:
    """Export the events ``where`` selects (lowest seq first) from the log at ``audit_path`` to
    ``target``, and their proofs to `proof_path` (each written whole, or not at all). ``signer``
    (the log's signing key, if the exporter holds it) signs the proof's header: the selection, the
    checkpoint and the digest of the exported leaves, so no one can narrow the selection after.

    The proofs are against the largest checkpoint one of ``keys`` (default: ``signer``'s public
    key) signed: anyone who can write the log's volume can add a checkpoint to its file, and an
    export proven against one no key signed would be refused by its recipient. With neither, the
    largest checkpoint in the file.

    Raises:
        AuditError: the log has no checkpoint (signed by ``keys``) yet, does not match it, or the
            events cannot be read.
        OSError: ``target`` cannot be written.
    """
    where = where or EventFilter()
    layout = LogLayout(audit_path)
    if keys is None and signer is not None:
        keys = [signer.verify_key]
    from router.audit.checkpoint import latest_signed  # noqa: PLC0415  (cryptography, only when exporting)

    latest = latest_signed(layout.read_checkpoints(), keys)
    if latest is None:
        signed = " signed by the log's public key" if keys is not None else ""
        raise AuditError(f"{layout.checkpoints} holds no checkpoint{signed} yet: nothing to prove an export against")
    size = latest.size
    covered = dataclasses.replace(
        where,
        after_seq=_past_retired(layout, where.after_seq or 0),
        to_seq=size if where.to_seq is None else min(where.to_seq, size),
    )
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    proof_partial = target.with_name(f".{target.name}.{os.getpid()}.proof.partial")
    with AuditQuery(audit_path, index_dir, writable=(partial,)) as query:
        left_out = _count(query, dataclasses.replace(where, after_seq=max(where.after_seq or 0, size)))
        try:
            leaves = _write(query, covered, partial, fmt)
            seqs = [seq for seq, _ in leaves]
            checkpoint, proofs = _inclusion_proofs(layout, seqs, latest)
            if signer is not None and signer.key_id != checkpoint.key_id:
                signer = None  # a header signed by another key than the checkpoint's could not be checked
            digest = _sha256(partial)
            selection = _selection(covered)
            with proof_partial.open("w", encoding="utf-8") as out:
                _write_proof(out, target, fmt, digest, checkpoint.signed_text(), selection, leaves, proofs, signer)
            os.replace(partial, target)
            os.replace(proof_partial, proof_path(target))
        finally:
            partial.unlink(missing_ok=True)
            proof_partial.unlink(missing_ok=True)
    return ExportReport(
        file=target, proof=proof_path(target), format=fmt, events=len(leaves),
        first_seq=seqs[0] if seqs else None, last_seq=seqs[-1] if seqs else None,
        checkpoint_size=checkpoint.size, left_out=left_out, sha256=digest, signed_selection=signer is not None,
    )  # fmt: skip


def _past_retired(layout: LogLayout, after: int) -> int:
    """``after``, moved past the retired ranges (signed tombstones) that follow it: the events an
    export of the rest of the log begins with."""
    for part in layout.parts():
        if part.kind == "tombstone" and part.first_seq <= after + 1 <= part.last_seq:
            after = part.last_seq
    return after


def _inclusion_proofs(layout: LogLayout, seqs: list[int], checkpoint: Any) -> tuple[Any, Mapping[int, list[str]]]:
    """The proofs of ``seqs`` against ``checkpoint``: the one the selection was bounded by, read
    and signature-checked once."""
    from router.audit.verify import inclusion_proofs  # noqa: PLC0415  (only when exporting)

    found: tuple[Any, Mapping[int, list[str]]] = inclusion_proofs(layout, seqs, checkpoint=checkpoint)
    return found


def _count(query: AuditQuery, where: EventFilter) -> int:
    return sum(1 for _ in query.events(where, columns=("seq",)))


def _write(query: AuditQuery, where: EventFilter, path: Path, fmt: ExportFormat) -> list[tuple[int, str]]:
    """Write the selected events to ``path`` in ``fmt``; each one's seq and hash, in seq order."""
    leaves: list[tuple[int, str]] = []
    if fmt == "parquet":
        query.copy_parquet(where, path)
        leaves = [(seq, digest) for seq, digest in query.events(where, columns=("seq", "hash"))]
        _check_parquet_rows(path, leaves)
        return leaves
    with path.open("wb") as handle:
        if fmt == "jsonl":
            for seq, digest, line in query.events(where, columns=("seq", "hash", "event")):
                handle.write(line.encode() + b"\n")  # the line as written: its bytes hash to its leaf
                leaves.append((seq, digest))
        elif fmt == "ocsf":
            for seq, digest, line in query.events(where, columns=("seq", "hash", "event")):
                handle.write(_json(ocsf_record(line, digest)).encode() + b"\n")
                leaves.append((seq, digest))
        else:
            text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
            # Every cell quoted: with "\n" ending rows, the csv module leaves a lone "\r" unquoted, which
            # readers take for a row's end.
            writer = csv.writer(text, lineterminator="\n", quoting=csv.QUOTE_ALL)
            writer.writerow(CSV_COLUMNS)
            for seq, digest, offset, line in query.events(where, columns=("seq", "hash", "line_offset", "event")):
                writer.writerow(csv_row(line, offset))
                leaves.append((seq, digest))
            text.flush()
            text.detach()
    return leaves


def _check_parquet_rows(path: Path, leaves: list[tuple[int, str]]) -> None:
    """The Parquet file holds exactly the events proven (it is written by one query, the proofs made
    from another: a view that changed between them must not go out unnoticed)."""
    engine = load_duckdb()  # Parquet exports are written by DuckDB already

    connection = engine.connect(":memory:", config={"threads": 1})
    try:
        rows = connection.execute(
            "SELECT seq, sha256('\\x00'::BLOB || encode(event)) FROM read_parquet(?) ORDER BY seq", [str(path)]
        ).fetchall()
    finally:
        connection.close()
    if rows != leaves:
        raise AuditError(f"the Parquet export holds {len(rows)} events where {len(leaves)} were selected: export again")


def ocsf_record(line: str, digest: str) -> dict[str, Any]:
    """The OCSF record an export writes for one event (its ``line`` as written, whose hash is
    ``digest``): `to_ocsf` of the event, with the line itself as ``raw_data``."""
    return {**to_ocsf(json.loads(line), digest), "raw_data": line}


def csv_row(line: str, offset: int | None) -> list[str]:
    """The cells of the CSV row an export writes for one event (its ``line`` as written, at byte
    ``offset`` of its segment): each promoted column from the line itself (`promote`), then the line."""
    row = promote(line.encode(), offset)
    if row is None:
        raise AuditError(f"a line of the log is not a JSON object: {line[:80]!r}")
    return [csv_cell(row[name]) for name in CSV_COLUMNS[:-1]] + [line]


def csv_cell(value: Any) -> str:
    """One promoted value as a CSV export writes it: times ISO 8601 UTC, lists as JSON arrays, a NUL
    as ``\\u0000`` (the csv module cannot write one), and text a spreadsheet would run as a formula
    (starting with = + - @, a tab or a carriage return) behind a single quote (OWASP's advice)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.isoformat() + "Z"
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        return spreadsheet_safe(value.replace("\x00", "\\u0000"))
    return str(value)


def spreadsheet_safe(text: str) -> str:
    """``text`` as a CSV cell a spreadsheet shows but never runs: one that would start a formula
    (= + - @, a tab or a carriage return) goes behind a single quote (OWASP's advice)."""
    return "'" + text if text.startswith(_FORMULA) else text


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- the proof document ---------------------------------------------------------------------------

_NOT_FILTERS = ("after_seq", "to_seq")


def _selection(where: EventFilter) -> dict[str, Any]:
    """What an export selected: the seqs after ``after_seq`` up to ``to_seq`` (inclusive) that match
    ``filter`` (`EventFilter` fields, as JSON). ``complete``: no filter, so every event of the range."""
    chosen: dict[str, Any] = {}
    for item in dataclasses.fields(EventFilter):
        value = getattr(where, item.name)
        if item.name in _NOT_FILTERS or value is None or value == ():
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif item.name == "args":
            value = [list(pair) for pair in value]
        chosen[item.name] = value
    return {"filter": chosen, "after_seq": where.after_seq or 0, "to_seq": where.to_seq, "complete": not chosen}


def _filter_of(selection: Any) -> EventFilter:
    """The `EventFilter` a proof's selection records. Raises `ValueError` for anything else."""
    if not isinstance(selection, dict) or not isinstance(selection.get("filter"), dict):
        raise ValueError("the proof's selection is not an object with a filter")
    names = {item.name for item in dataclasses.fields(EventFilter)} - set(_NOT_FILTERS)
    fields: dict[str, Any] = {}
    for name, value in selection["filter"].items():
        if name not in names:
            raise ValueError(f"the proof's filter names {name!r}, which is no filter")
        if name in ("since", "until"):
            fields[name] = datetime.fromisoformat(value)
        elif name == "args":
            if not isinstance(value, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in value
            ):
                raise ValueError("the proof's args filter is not a list of [key, value] pairs")
            fields[name] = tuple((k, v) for k, v in value)
        elif isinstance(value, str):
            fields[name] = value
        else:
            raise ValueError(f"the proof's filter {name!r} is not text")
    after, to = selection.get("after_seq"), selection.get("to_seq")
    if not isinstance(after, int) or (to is not None and not isinstance(to, int)):
        raise ValueError("the proof's selection does not say its seq range")
    return EventFilter(after_seq=after, to_seq=to, **fields)


def _leaves_digest(leaves: Sequence[tuple[int, str]]) -> str:
    """SHA-256 over the exported events' seqs and leaf hashes, in order: what a signed header binds."""
    digest = hashlib.sha256()
    for seq, leaf in leaves:
        digest.update(b"%d:%s\n" % (seq, leaf.encode()))
    return digest.hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _write_proof(
    out: IO[str],
    target: Path,
    fmt: str,
    digest: str,
    checkpoint: bytes,
    selection: dict[str, Any],
    leaves: list[tuple[int, str]],
    proofs: Mapping[int, list[str]],
    signer: SigningKey | None,
) -> None:
    """The proof document, written as it goes: its header on the first line, then one proof per line
    (an export can be large), as `_read_proof` reads it."""
    head: dict[str, Any] = {
        "format": PROOF_FORMAT, "file": target.name, "file_format": fmt, "file_sha256": digest,
        "events": len(leaves), "first_seq": leaves[0][0] if leaves else None,
        "last_seq": leaves[-1][0] if leaves else None, "selection": selection,
        "leaves_sha256": _leaves_digest(leaves), "checkpoint": json.loads(checkpoint),
    }  # fmt: skip
    if signer is not None:
        signature = base64.b64encode(signer.sign(_canonical(head))).decode()
        head["signature"] = {"key_id": signer.key_id, "signature": signature}
    out.write(json.dumps(head, separators=(",", ":"))[:-1] + ',"proofs":[')
    emit: Callable[[str], Any] = out.write
    for i, item in enumerate(_proof_items(leaves, proofs)):
        emit(("\n" if i == 0 else ",\n") + item)
    out.write("\n]}\n")


def _proof_items(leaves: list[tuple[int, str]], proofs: Mapping[int, list[str]]) -> Iterator[str]:
    for seq, leaf in leaves:
        yield json.dumps({"seq": seq, "index": seq - 1, "leaf_hash": leaf, "proof": proofs[seq]}, separators=(",", ":"))


_PROOFS_OPEN = ',"proofs":['


def _read_proof(path: Path) -> tuple[dict[str, Any], Generator[dict[str, Any], None, None]]:
    """The header of a proof document and its proofs, read one at a time once asked for (as
    `_write_proof` lays it out).

    Raises:
        ValueError: not a proof document as an export writes it (the proofs raise it as they are read).
    """
    with path.open("r", encoding="utf-8") as handle:
        first = handle.readline().rstrip("\n")
    if first.endswith(_PROOFS_OPEN):
        head, items = json.loads(first[: -len(_PROOFS_OPEN)] + "}"), _proof_lines(path)
    else:  # the same document laid out otherwise (rewritten by a JSON tool): read whole
        document = json.loads(path.read_bytes())
        proofs = document.pop("proofs", None) if isinstance(document, dict) else None
        if not isinstance(proofs, list):
            raise ValueError(f"{path} is not an export proof (it holds no list of proofs)")
        head, items = document, _listed(proofs)
    if not isinstance(head, dict) or head.get("format") != PROOF_FORMAT:
        raise ValueError(f"{path} is not a {PROOF_FORMAT} document")
    return head, items


def _listed(proofs: list[Any]) -> Generator[dict[str, Any], None, None]:
    for item in proofs:
        if not isinstance(item, dict):
            raise ValueError("the proof holds a proof that is not an object")
        yield item


def _proof_lines(path: Path) -> Generator[dict[str, Any], None, None]:
    with path.open("r", encoding="utf-8") as handle:
        handle.readline()  # the header
        ended = False
        for raw in handle:
            text = raw.strip().removesuffix(",")
            if ended and text:
                raise ValueError(f"{path} goes on after its proofs end")
            if text == "]}":
                ended = True
            elif text:
                item = json.loads(text)
                if not isinstance(item, dict):
                    raise ValueError(f"{path} holds a proof that is not an object")
                yield item
        if not ended:
            raise ValueError(f"{path} ends before its proofs do (cut short)")


# -- verifying an export --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExportCheck:
    """What `verify_export` found: ``ok``, or the first bad record (its 1-based ``record`` number in
    the file, and its ``seq`` when known) and the ``problem``."""

    ok: bool
    events: int
    """Records checked (all of them when ``ok``; up to the bad one otherwise)."""
    problem: str = ""
    record: int | None = None
    seq: int | None = None
    checkpoint_size: int | None = None
    selection: dict[str, Any] | None = None
    """The selection the proof records (the filter and the seq range): compare it with what was asked."""
    signed_selection: bool = False
    """Whether the log's key signed the selection (the exporter held it), so no one could narrow it."""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Bad(Exception):
    """The first bad record: ends the walk (internal to `verify_export`)."""

    def __init__(self, problem: str, record: int | None = None, seq: int | None = None) -> None:
        super().__init__(problem)
        self.problem, self.record, self.seq = problem, record, seq


def verify_export(path: Path, public_key: VerifyKey, proof: Path | None = None) -> ExportCheck:
    """Check an export (`export_events`) with nothing but the log's public key: the checkpoint's
    signature (and the header's, if signed); each record's line hashes to a leaf proven at its seq,
    and its other fields are the line's; records in seq order, inside the selection's range and
    matching its filter; for a range exported whole, every seq of it, each event chained to the one
    before. ``proof``: the proof document, `proof_path` of ``path`` by default.

    Raises:
        OSError: a file cannot be read.
    """
    from router.audit.checkpoint import Checkpoint  # noqa: PLC0415  (pydantic, only when verifying)

    proof = proof or proof_path(path)
    try:
        head, items = _read_proof(proof)
        checkpoint = Checkpoint.model_validate(head.get("checkpoint"))
        where = _filter_of(head.get("selection"))
    except ValueError as exc:  # pydantic's ValidationError and json's errors are ValueErrors
        return ExportCheck(False, 0, f"{proof.name}: {exc}")
    selection = head["selection"]
    found = ExportCheck(False, 0, checkpoint_size=checkpoint.size, selection=selection)
    if not checkpoint.verify(public_key):
        return dataclasses.replace(found, problem="the proof's checkpoint is not signed by the given public key")
    signed = head.get("signature")
    if signed is not None and not _header_signed(head, public_key):
        return dataclasses.replace(found, problem="the proof's header signature does not verify: it was altered")
    found = dataclasses.replace(found, signed_selection=signed is not None)
    walk: _Walk | None = None
    try:
        walk = _Walk(checkpoint, where, complete=selection.get("complete") is True)
        if head.get("file_format") not in ("jsonl", "ocsf", "csv", "parquet"):
            raise _Bad(f"the proof names no export format it knows: {head.get('file_format')!r}")
        records = _RECORDS[head["file_format"]](path)
        try:
            for record, (line, problem) in enumerate(records, start=1):
                walk.record(record, line, problem, next(items, None))
            if next(items, None) is not None:
                raise _Bad(f"the proof holds more proofs than the file's {walk.count} records: records were removed")
        finally:
            records.close()  # a walk that stopped early leaves the file (or DuckDB) open otherwise
        walk.finish(head)
        if _sha256(path) != head.get("file_sha256"):
            raise _Bad("the file's sha256 is not the one its proof records")
    except _Bad as bad:
        checked = walk.count if walk is not None else 0
        return dataclasses.replace(found, events=checked, problem=bad.problem, record=bad.record, seq=bad.seq)
    except (ValueError, csv.Error) as exc:  # the proof's lines, or a CSV the csv module cannot read
        checked = walk.count if walk is not None else 0
        return dataclasses.replace(found, events=checked, problem=f"{path.name} or {proof.name}: {exc}")
    finally:
        items.close()
    return dataclasses.replace(found, ok=True, events=walk.count)


def _header_signed(head: dict[str, Any], key: VerifyKey) -> bool:
    signed = head["signature"]
    if not isinstance(signed, dict) or signed.get("key_id") != key.key_id:
        return False
    try:
        signature = base64.b64decode(str(signed.get("signature")), validate=True)
    except (binascii.Error, ValueError):
        return False
    return key.verify(_canonical({k: v for k, v in head.items() if k != "signature"}), signature)


class _Walk:
    """The checks of `verify_export` that every format shares, one record at a time."""

    def __init__(self, checkpoint: Any, where: EventFilter, *, complete: bool) -> None:
        self.size, self.root = checkpoint.size, bytes.fromhex(checkpoint.root)
        self.where, self.complete = where, complete
        self.after = where.after_seq or 0
        self.to = where.to_seq
        self.previous = self.after
        self.previous_leaf: str | None = None
        self.count = 0
        self.leaves = hashlib.sha256()
        if self.to is not None and self.to > self.size:
            raise _Bad(f"the selection ends at seq {self.to}, past the checkpoint's {self.size} events")

    def record(self, number: int, line: bytes, problem: str, item: dict[str, Any] | None) -> None:
        from router.audit.merkle import verify_inclusion  # noqa: PLC0415

        head = head_of(line)
        if head is None:
            raise _Bad("its line is not an event of the log (no seq and prev_hash at its start)", number)
        seq = head[0]
        if problem:
            raise _Bad(problem, number, seq)
        if item is None:
            raise _Bad("the proof ends before the file does: a record was added", number, seq)
        leaf = line_hash(line).hex()
        if item.get("seq") != seq or item.get("leaf_hash") != leaf:
            raise _Bad("its line is not the event the proof proves in its place: it was edited, added, removed or "
                       "reordered", number, seq)  # fmt: skip
        proof = item.get("proof")
        try:
            nodes = [bytes.fromhex(node) for node in proof] if isinstance(proof, list) else None
        except (TypeError, ValueError):
            nodes = None
        if nodes is None or not verify_inclusion(bytes.fromhex(leaf), seq - 1, self.size, nodes, self.root):
            raise _Bad("its inclusion proof does not lead to the signed checkpoint's root", number, seq)
        if seq <= self.previous:
            kind = "reordered or repeated" if self.count else "before the selection's range"
            raise _Bad(f"seq {seq} comes after seq {self.previous}: records were {kind}", number, seq)
        if self.to is not None and seq > self.to:
            raise _Bad(f"seq {seq} is past the selection's range (to seq {self.to})", number, seq)
        if self.complete and seq != self.previous + 1:
            raise _Bad(f"events {self.previous + 1}..{seq - 1} of the range are missing", number, seq)
        if self.complete and self.previous_leaf is not None and head[1] != self.previous_leaf:
            raise _Bad(f"seq {seq} does not link to the record before it (prev_hash)", number, seq)
        if not self.complete and not _selected(line, self.where):
            raise _Bad(f"seq {seq} does not match the selection's filter", number, seq)
        self.previous, self.previous_leaf = seq, leaf
        self.leaves.update(b"%d:%s\n" % (seq, leaf.encode()))
        self.count += 1

    def finish(self, head: dict[str, Any]) -> None:
        if self.complete and self.to is not None and self.previous < self.to:
            missing = f"events {self.previous + 1}..{self.to} of the range are missing at its end"
            raise _Bad(missing, seq=self.previous + 1)
        if head.get("events") != self.count:
            raise _Bad(f"the file holds {self.count} records, its proof says {head.get('events')}")
        if head.get("leaves_sha256") != self.leaves.hexdigest():
            raise _Bad("the proof's digest of the exported events is not that of the records")


def _selected(line: bytes, where: EventFilter) -> bool:
    row = promote(line)
    return row is not None and matches(row, where)


# Each record of an export: its line as written, and what is wrong with the record ("" when nothing).
_Records = Generator[tuple[bytes, str], None, None]


def _jsonl_records(path: Path) -> _Records:
    with path.open("rb") as handle:
        for raw in handle:
            if not raw.endswith(b"\n"):
                yield raw, "the file's last line is cut short (no newline)"
                return
            yield raw[:-1], ""


def _ocsf_records(path: Path) -> _Records:
    with path.open("rb") as handle:
        for raw in handle:
            try:
                record = json.loads(raw)
                line = record["raw_data"]
                if not isinstance(line, str):
                    raise TypeError(line)
            except (ValueError, KeyError, TypeError):
                yield raw, "not an OCSF record with the event's line (raw_data)"
                return
            expected = ocsf_record(line, line_hash(line.encode()).hex())
            # Compared as JSON, the way it was written: a float or a key order must match as well.
            yield (
                line.encode(),
                ""
                if json.loads(_json(expected)) == record
                else ("its OCSF fields are not those of its line (raw_data): the record was edited"),
            )


_EDITED_ROW = "its cells are not those of its line (the event column): the row was edited"
_NOT_AN_OFFSET = "its line_offset cell is not a byte offset (digits, or nothing): the row was edited"
_OFFSET = re.compile(r"[0-9]*")  # ASCII digits only: str.isdigit takes other scripts' digits too


def _csv_records(path: Path) -> _Records:
    # The event column holds whole lines (up to the index's 64 MiB), past the csv module's default
    # field limit of 128 KiB; the limit is the process's, and only ever raised here.
    csv.field_size_limit(max(csv.field_size_limit(), _MAX_CELL))
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        if next(reader, None) != list(CSV_COLUMNS):
            yield b"", "the CSV's header is not the export's columns"
            return
        checked = [i for i, name in enumerate(CSV_COLUMNS[:-1]) if name not in _UNCHECKED]
        numbers = [i for i, name in enumerate(CSV_COLUMNS[:-1]) if name in _UNCHECKED]
        for cells in reader:
            if len(cells) != len(CSV_COLUMNS):
                yield b"", f"a row holds {len(cells)} cells, not {len(CSV_COLUMNS)}"
                return
            line = cells[-1]
            expected = csv_row(line, None) if line.startswith("{") else None
            if expected is None or any(cells[i] != expected[i] for i in checked):
                yield line.encode(), _EDITED_ROW
            elif not all(_OFFSET.fullmatch(cells[i]) for i in numbers):
                yield line.encode(), _NOT_AN_OFFSET
            else:
                yield line.encode(), ""


def _parquet_records(path: Path) -> _Records:
    """The records of a Parquet export in seq order (Parquet rows are a set: the index writes them
    day by day), each with every promoted column compared with the same projection the index makes
    of its ``event``."""
    engine = load_duckdb()  # reading Parquet needs it anyway

    connection = engine.connect(":memory:", config={"threads": 1})
    try:
        yield from _parquet_rows(connection, path)
    except engine.Error as exc:
        yield b"", f"the Parquet file cannot be read: {str(exc).splitlines()[0]}"
    finally:
        connection.close()


def _parquet_rows(connection: duckdb.DuckDBPyConnection, path: Path) -> _Records:
    from router.audit.index import _projected  # noqa: PLC0415  (the one projection, shared)

    connection.execute("SET TimeZone = 'UTC'")
    source = f"read_parquet({_quoted(path)})"
    names = [row[0] for row in connection.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()]  # noqa: S608  (a quoted path)
    if names != list(COLUMNS):
        yield b"", f"the Parquet file's columns are not the export's: {names}"
        return
    same = " AND ".join(f"f.{c} IS NOT DISTINCT FROM p.{c}" for c in COLUMNS if c not in _UNCHECKED)
    projected = _projected(f"SELECT DISTINCT event AS line FROM {source}")  # noqa: S608  (a quoted path)
    cursor = connection.execute(
        f"SELECT f.event, p.seq IS NOT NULL AND {same} FROM {source} f "  # noqa: S608  (constant SQL, a quoted path)
        f"LEFT JOIN ({projected}) p ON p.hash = sha256('\\x00'::BLOB || encode(f.event)) "
        "ORDER BY coalesce(p.seq, f.seq), f.event"
    )
    while rows := cursor.fetchmany(1000):
        for event, consistent in rows:
            yield event.encode(), "" if consistent else _EDITED_COLUMNS


_EDITED_COLUMNS = "its columns are not those of its line (the event column): the row was edited"


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


_RECORDS: dict[str, Callable[[Path], _Records]] = {
    "jsonl": _jsonl_records, "ocsf": _ocsf_records, "csv": _csv_records, "parquet": _parquet_records,
}  # fmt: skip

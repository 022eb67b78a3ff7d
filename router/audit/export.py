"""Exports of the audit log that carry their own proof: events as JSONL (the lines as written, byte
for byte), OCSF, CSV or Parquet, and beside the file ``<file>.proof.json``: the log's latest signed
checkpoint and, for every exported event, its leaf hash and RFC 9162 inclusion proof against that
checkpoint. Anyone holding the log's public key can check an export without the log
(`router.audit.merkle.verify_inclusion`, index = seq - 1); for JSONL the leaf is the hash of the
line itself, for the other formats the record carries the event's ``hash``.

Only events the checkpoint covers are exported: ones appended after it are left out, and counted.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, Literal

from router.audit.index import COLUMNS, AuditQuery, EventFilter
from router.audit.layout import LogLayout
from router.audit.ocsf import to_ocsf
from router.errors import AuditError

__all__ = ["PROOF_FORMAT", "ExportFormat", "ExportReport", "export_events", "proof_path"]

ExportFormat = Literal["jsonl", "ocsf", "csv", "parquet"]
PROOF_FORMAT = "stockade-export-proof/1"
CSV_COLUMNS = tuple(name for name in COLUMNS if name != "event")
"""The columns of a CSV export: the promoted ones (lists as JSON arrays, times ISO 8601 UTC)."""


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

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "file": str(self.file), "proof": str(self.proof)}


def export_events(
    audit_path: Path,
    target: Path,
    *,
    fmt: ExportFormat = "jsonl",
    where: EventFilter | None = None,
    index_dir: Path | None = None,
) -> ExportReport:
    """Export the events ``where`` selects (lowest seq first) from the log at ``audit_path`` to
    ``target``, and their proofs to `proof_path` (each written whole, or not at all).

    Raises:
        AuditError: the log has no checkpoint yet, does not match it, or the events cannot be read.
        OSError: ``target`` cannot be written.
    """
    where = where or EventFilter()
    layout = LogLayout(audit_path)
    checkpoints = layout.read_checkpoints()
    if not checkpoints:
        raise AuditError(f"{layout.checkpoints} holds no checkpoint yet: nothing to prove an export against")
    size = max(c.size for c in checkpoints)
    covered = dataclasses.replace(where, to_seq=size if where.to_seq is None else min(where.to_seq, size))
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    proof_partial = target.with_name(f".{target.name}.{os.getpid()}.proof.partial")
    with AuditQuery(audit_path, index_dir, writable=(partial,)) as query:
        left_out = _count(query, dataclasses.replace(where, after_seq=max(where.after_seq or 0, size)))
        try:
            leaves = _write(query, covered, partial, fmt)
            seqs = [seq for seq, _ in leaves]
            checkpoint, proofs = _inclusion_proofs(layout, seqs)
            digest = _sha256(partial)
            with proof_partial.open("w", encoding="utf-8") as out:
                _write_proof(out, target, fmt, digest, checkpoint.signed_text(), leaves, proofs)
            os.replace(partial, target)
            os.replace(proof_partial, proof_path(target))
        finally:
            partial.unlink(missing_ok=True)
            proof_partial.unlink(missing_ok=True)
    return ExportReport(
        file=target, proof=proof_path(target), format=fmt, events=len(leaves),
        first_seq=seqs[0] if seqs else None, last_seq=seqs[-1] if seqs else None,
        checkpoint_size=checkpoint.size, left_out=left_out, sha256=digest,
    )  # fmt: skip


def _inclusion_proofs(layout: LogLayout, seqs: list[int]) -> tuple[Any, Mapping[int, list[str]]]:
    from router.audit.verify import inclusion_proofs  # noqa: PLC0415  (only when exporting)

    found: tuple[Any, Mapping[int, list[str]]] = inclusion_proofs(layout, seqs)
    return found


def _count(query: AuditQuery, where: EventFilter) -> int:
    return sum(1 for _ in query.events(where, columns=("seq",)))


def _write(query: AuditQuery, where: EventFilter, path: Path, fmt: ExportFormat) -> list[tuple[int, str]]:
    """Write the selected events to ``path`` in ``fmt``; each one's seq and hash, in seq order."""
    leaves: list[tuple[int, str]] = []
    if fmt == "parquet":
        query.copy_parquet(where, path)
        return [(seq, digest) for seq, digest in query.events(where, columns=("seq", "hash"))]
    with path.open("wb") as handle:
        if fmt == "jsonl":
            for seq, digest, line in query.events(where, columns=("seq", "hash", "event")):
                handle.write(line.encode() + b"\n")  # the line as written: its bytes hash to its leaf
                leaves.append((seq, digest))
        elif fmt == "ocsf":
            for seq, digest, line in query.events(where, columns=("seq", "hash", "event")):
                record = to_ocsf(json.loads(line), digest)
                handle.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
                leaves.append((seq, digest))
        else:
            text = _text_writer(handle)
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(CSV_COLUMNS)
            for row in query.events(where, columns=CSV_COLUMNS):
                writer.writerow([_csv_value(value) for value in row])
                leaves.append((row[0], row[1]))
            text.flush()
            text.detach()
    return leaves


def _text_writer(handle: IO[bytes]) -> Any:
    import io  # noqa: PLC0415

    return io.TextIOWrapper(handle, encoding="utf-8", newline="")


def _csv_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat() + "Z"
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str) and "\x00" in value:
        return value.replace("\x00", "\\u0000")  # the csv module cannot write NUL; JSON's escape says what it was
    return value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_proof(
    out: IO[str],
    target: Path,
    fmt: str,
    digest: str,
    checkpoint: bytes,
    leaves: list[tuple[int, str]],
    proofs: Mapping[int, list[str]],
) -> None:
    """The proof document, written as it goes (one proof per line: an export can be large)."""
    head = {
        "format": PROOF_FORMAT, "file": target.name, "file_format": fmt, "file_sha256": digest,
        "events": len(leaves), "first_seq": leaves[0][0] if leaves else None,
        "last_seq": leaves[-1][0] if leaves else None, "checkpoint": json.loads(checkpoint),
    }  # fmt: skip
    out.write(json.dumps(head, separators=(",", ":"))[:-1] + ',"proofs":[')
    emit: Callable[[str], Any] = out.write
    for i, item in enumerate(_proof_items(leaves, proofs)):
        emit(("\n" if i == 0 else ",\n") + item)
    out.write("\n]}\n")


def _proof_items(leaves: list[tuple[int, str]], proofs: Mapping[int, list[str]]) -> Iterator[str]:
    for seq, leaf in leaves:
        yield json.dumps({"seq": seq, "index": seq - 1, "leaf_hash": leaf, "proof": proofs[seq]}, separators=(",", ":"))

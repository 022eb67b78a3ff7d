"""The auditor's index of a JSONL audit log, and `AuditQuery`: SQL over it and over the live tail.

Queries never run inside the router's process. After the writer seals a segment it calls
`spawn_indexer`, which starts ``python -m router.audit.index <log>`` as a detached, niced process;
that process turns each sealed segment into day-partitioned Parquet (and snapshots the active
segment's first lines). `AuditQuery` reads the Parquet files plus whatever they do not cover yet
(sealed segments not indexed, the active segment past its snapshot) as one view, ``events``.
DuckDB is imported only by the indexer and the readers, never at import time.

The index (default ``<audit path>.index/``, `index_dir_of`)::

    day=2026-11-22/000000000001-000000041234.parquet      sealed segment 1..41234's events stamped that day
    segments/000000000001-000000041234.json               its marker, written last: the manifest's sha256, files
    active/day=2026-11-23/000000041235-000000043210.parquet  a snapshot of the active segment's first lines
    active.json                                           the snapshot's marker: its file, inode, bytes, seqs
    .indexer.lock                                         held by the one indexer at work
    .pending                                              a byte per `spawn_indexer` call: segments to look at
    .tmp/                                                 staging and DuckDB's spill space while indexing

A marker whose sha256 is not the segment's manifest's (the segment was replaced) makes the files
stale: readers ignore them and the next indexer run re-indexes the segment and reports it. Every
row holds the promoted columns (`COLUMNS`) and the line as written (``event``), byte for byte; a
row's ``hash`` is computed from those bytes (`router.audit.chain`), never read from the line, and
its ``line_offset`` says where the line is in its segment file (`AuditQuery.events` reads events
there, checked against the hash).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

from router.audit.chain import canonical, head_of, line_hash
from router.audit.duck import load_duckdb
from router.audit.layout import LogLayout, Part, complete_lines, write_json_atomically
from router.errors import AuditError
from router.text import escape_invalid_text

if TYPE_CHECKING:
    import subprocess

    import duckdb


def _log() -> Any:
    """This module's logger, made when first used: a fresh process that only queries does not
    pay for importing structlog (and the rich it loads)."""
    import structlog  # noqa: PLC0415

    return structlog.get_logger(__name__)


_T = TypeVar("_T")

__all__ = [
    "COLUMNS",
    "AuditQuery",
    "EventFilter",
    "IndexReport",
    "event_with_hash",
    "follow",
    "index_dir_of",
    "index_log",
    "index_sealed",
    "matches",
    "promote",
    "snapshot_active",
    "spawn_indexer",
]

COLUMNS: dict[str, str] = {
    "seq": "BIGINT",
    "hash": "VARCHAR",
    "timestamp": "TIMESTAMP",
    "day": "DATE",
    "kind": "VARCHAR",
    "outcome": "VARCHAR",
    "decision_id": "VARCHAR",
    "call_id": "VARCHAR",
    "session_id": "VARCHAR",
    "agent": "VARCHAR",
    "principal": "VARCHAR",
    "tool": "VARCHAR",
    "reason_codes": "VARCHAR[]",
    "approver": "VARCHAR",
    "approval_id": "VARCHAR",
    "credential": "VARCHAR[]",
    "lease": "VARCHAR[]",
    "egress_host": "VARCHAR",
    "taint": "VARCHAR[]",
    "policy_revision": "VARCHAR",
    "instance": "VARCHAR",
    "line_offset": "BIGINT",
    "event": "VARCHAR",
}
"""The columns of the ``events`` view and their DuckDB types (docs/audit.md says where each
comes from). ``day`` is the UTC date of ``timestamp`` (1970-01-01 if it does not parse);
``line_offset`` is where the line starts in its segment file; ``event`` is the line as written."""

_FORMAT = 2  # of the markers and files: a marker of another format is re-indexed (2: line_offset)
_MAX_LINE = 64 << 20  # the longest line DuckDB's reader takes: a file with a longer one is read in Python
_ROW_GROUP = 8192  # rows: groups small enough that min/max and bloom filters skip most of a file
_INDEX_MEMORY = "256MB"
_QUERY_MEMORY = "128MB"
# Queries run behind the router for CPU, as the indexer does: on a small host, a query at the
# router's priority took a third of its appends (bench/audit.py). On Linux a nice value belongs to
# a thread, and threads inherit it from the one that starts them.
_NICE = 10
_QUERY_THREADS = 2  # statements of one engine at once (the HTTP API runs two queries at a time)
_EPOCH_DAY = "1970-01-01"
_STALE_S = 300.0  # seconds a replaced snapshot file is kept for readers that listed it
_MARKER = re.compile(r"(\d{12})-(\d{12})\.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")

# One JSON parse per line: every path at once. Scalars come back as text; the lists as JSON.
_SCALARS = (
    "$.seq", "$.timestamp", "$.kind", "$.outcome", "$.decision_id", "$.call_id", "$.session_id", "$.agent",
    "$.input.subject.principal", "$.result.principal", "$.tool", "$.input.tool.name", "$.result.code",
    "$.result.approver", "$.input.approval.approver", "$.result.id", "$.input.approval.id", "$.result.name",
    "$.result.lease_id", "$.result.host", "$.bundles.policies.revision", "$.labels.instance",
)  # fmt: skip
_LISTS = (
    "$.result.reasons", "$.result.obligations.credentials", "$.result.injected", "$.result.credentials",
    "$.input.session.taint",
)  # fmt: skip


def _paths(paths: Sequence[str]) -> str:
    return "[" + ", ".join(f"'{p}'" for p in paths) + "]"


_NOT_NULL = "lambda x: x IS NOT NULL"
# Over a relation with one VARCHAR column ``line``: the promoted columns. Mirrored in Python by `promote`.
_PROJECTION = f"""
SELECT
  TRY_CAST(s[1] AS BIGINT) AS seq,
  sha256('\\x00'::BLOB || encode(line)) AS hash,
  CAST(TRY_CAST(s[2] AS TIMESTAMPTZ) AS TIMESTAMP) AS timestamp,
  coalesce(CAST(CAST(TRY_CAST(s[2] AS TIMESTAMPTZ) AS TIMESTAMP) AS DATE), DATE '{_EPOCH_DAY}') AS day,
  s[3] AS kind, s[4] AS outcome, s[5] AS decision_id, s[6] AS call_id, s[7] AS session_id, s[8] AS agent,
  coalesce(s[9], s[10]) AS principal,
  coalesce(s[11], s[12]) AS tool,
  list_filter(list_concat(coalesce(json_extract_string(l[1], '$[*].code'), []), [s[13]]), {_NOT_NULL})
    AS reason_codes,
  coalesce(s[14], s[15]) AS approver,
  CASE WHEN s[3] = 'approval' THEN s[16] ELSE s[17] END AS approval_id,
  list_filter(CASE s[3] WHEN 'credential' THEN [s[18]]
                        WHEN 'decision' THEN coalesce(json_extract_string(l[2], '$[*].name'), [])
                        WHEN 'egress' THEN coalesce(json_extract_string(l[3], '$[*]'), [])
                        ELSE [] END, {_NOT_NULL}) AS credential,
  list_filter(CASE s[3] WHEN 'credential' THEN [s[19]]
                        WHEN 'execution' THEN coalesce(json_extract_string(l[4], '$[*]'), [])
                        ELSE [] END, {_NOT_NULL}) AS lease,
  CASE WHEN s[3] = 'egress' THEN s[20] END AS egress_host,
  list_filter(coalesce(json_extract_string(l[5], '$[*]'), []), {_NOT_NULL}) AS taint,
  s[21] AS policy_revision, s[22] AS instance,
  {{offset}} AS line_offset,
  line AS event
FROM (
  SELECT *, json_extract_string(line, {_paths(_SCALARS)}) AS s, json_extract(line, {_paths(_LISTS)}) AS l
  FROM ({{source}}) WHERE json_valid(line)
)
"""  # noqa: S608  (constant SQL: no value of an event or a caller in it)

# Where a line starts when the source does not say (read_csv): the lines are in seq order in their
# file, one newline each, so a line starts where the bytes of those before it end ({base}: where the
# source's first line starts). Only when every line of the file is a row: a line read_csv or
# json_valid skipped moves every offset after it, so such a file is read in Python (`_line_rows`).
_RUNNING_OFFSET = (
    "CAST({base} + sum(strlen(line) + 1) OVER (ORDER BY TRY_CAST(s[1] AS BIGINT) ROWS UNBOUNDED PRECEDING)"
    " - strlen(line) - 1 AS BIGINT)"
)


def _projected(source: str, base: int = 0, *, offsets: bool = False) -> str:
    """`_PROJECTION` of ``source`` (SQL giving the column ``line``: whole lines of one file, in
    order, the first starting at byte ``base``; with ``offsets``, also ``off``: where each starts)."""
    offset = "CAST(off AS BIGINT)" if offsets else _RUNNING_OFFSET.replace("{base}", str(int(base)))
    # {offset} first, {source} last: a path in ``source`` may hold the text "{offset}".
    return _PROJECTION.replace("{offset}", offset).replace("{source}", source)


_EMPTY = "SELECT " + ", ".join(f"CAST(NULL AS {kind}) AS {name}" for name, kind in COLUMNS.items()) + " WHERE false"


def _csv_source(files: Sequence[Path]) -> str:
    """Whole lines of JSONL files as one VARCHAR column: no delimiter or quote a line can hold
    (canonical JSON escapes every control character), bad lines skipped (a torn last line)."""
    listed = ", ".join(_literal(str(f)) for f in files)
    return (
        f"SELECT line FROM read_csv([{listed}], columns={{'line': 'VARCHAR'}}, delim=E'\\x01', quote='', "  # noqa: S608  (paths quoted by _literal)
        f"escape='', header=false, auto_detect=false, new_line='\\n', max_line_size={_MAX_LINE}, "
        "ignore_errors=true, parallel=true)"
    )


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def index_dir_of(audit_path: Path) -> Path:
    """Where the index of the log at ``audit_path`` lives: ``<audit path>.index/``."""
    return audit_path.with_name(audit_path.name + ".index")


# -- what a row holds, and which rows a filter selects ----------------------------------------


def _text(value: Any) -> str | None:
    """A JSON value as DuckDB's ``json_extract_string`` gives it."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _at(document: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def _texts(value: Any, key: str | None = None) -> list[str]:
    if not isinstance(value, list):
        return []
    items = [_at(item, key) if key is not None else item for item in value]
    return [text for text in map(_text, items) if text is not None]


def _utc(text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if at.tzinfo is not None:
        at = at.astimezone(UTC).replace(tzinfo=None)
    return at


def promote(line: bytes, offset: int | None = None) -> dict[str, Any] | None:
    """The promoted columns of one line, as the index holds them (None: not a JSON object); its
    ``line_offset`` is ``offset`` (None: the line is in no file). The Python twin of the SQL
    projection, for readers without DuckDB (the Redis stream)."""
    try:
        document = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(document, dict):
        return None
    kind = _text(document.get("kind"))
    result, policy_input = document.get("result"), document.get("input")
    seq = document.get("seq")
    at = _utc(_text(document.get("timestamp")))
    credential: list[str] = []
    lease: list[str] = []
    if kind == "credential":
        credential = [t for t in (_text(_at(result, "name")),) if t is not None]
        lease = [t for t in (_text(_at(result, "lease_id")),) if t is not None]
    elif kind == "decision":
        credential = _texts(_at(result, "obligations", "credentials"), "name")
    elif kind == "egress":
        credential = _texts(_at(result, "injected"))
    if kind == "execution":
        lease = _texts(_at(result, "credentials"))
    code = _text(_at(result, "code"))
    return {
        "seq": seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
        "hash": line_hash(line.rstrip(b"\n")).hex(),
        "timestamp": at,
        "day": at.date() if at is not None else date.fromisoformat(_EPOCH_DAY),
        "kind": kind,
        "outcome": _text(document.get("outcome")),
        "decision_id": _text(document.get("decision_id")),
        "call_id": _text(document.get("call_id")),
        "session_id": _text(document.get("session_id")),
        "agent": _text(document.get("agent")),
        "principal": _first(_at(policy_input, "subject", "principal"), _at(result, "principal")),
        "tool": _first(document.get("tool"), _at(policy_input, "tool", "name")),
        "reason_codes": _texts(_at(result, "reasons"), "code") + ([code] if code is not None else []),
        "approver": _first(_at(result, "approver"), _at(policy_input, "approval", "approver")),
        "approval_id": _text(_at(result, "id") if kind == "approval" else _at(policy_input, "approval", "id")),
        "credential": credential,
        "lease": lease,
        "egress_host": _text(_at(result, "host")) if kind == "egress" else None,
        "taint": _texts(_at(policy_input, "session", "taint")),
        "policy_revision": _text(_at(document, "bundles", "policies", "revision")),
        "instance": _text(_at(document, "labels", "instance")),
        "line_offset": offset,
        "event": line.rstrip(b"\n").decode(),
    }


def _first(*values: Any) -> str | None:
    for value in values:
        text = _text(value)
        if text is not None:
            return text
    return None


@dataclass(frozen=True, slots=True)
class EventFilter:
    """Which events a query selects: every field that is set must match (docs/audit.md).
    Times are compared in UTC; ``after_seq`` is a cursor (events after it), ``to_seq`` inclusive."""

    since: datetime | None = None
    until: datetime | None = None
    after_seq: int | None = None
    to_seq: int | None = None
    session_id: str | None = None
    agent: str | None = None
    tool: str | None = None
    outcome: str | None = None
    decision_id: str | None = None
    kind: str | None = None
    call_id: str | None = None
    principal: str | None = None
    approver: str | None = None
    approval_id: str | None = None
    egress_host: str | None = None
    credential: str | None = None
    """A credential's name the event names (minted, obligated, injected)."""
    lease: str | None = None
    reason: str | None = None
    """A reason code (``provenance.untrusted_destination``) or error code."""
    taint: str | None = None
    args: tuple[tuple[str, str], ...] = ()
    """``(key, value)``: the call's argument ``key`` (recorded in ``input.args``) is ``value``: a
    string argument when it is that text; a number when ``value`` is a JSON number equal to it
    (``1e16`` is ``10000000000000000``); any other JSON value when ``value`` is it as JSON text
    (``true``, ``null``, ``{"a":[1]}``; keys in any order). See `_ArgValue`."""


_EQUAL = ("session_id", "agent", "tool", "outcome", "decision_id", "kind", "call_id", "principal", "approver",
          "approval_id", "egress_host")  # fmt: skip
_CONTAINS = {"credential": "credential", "lease": "lease", "reason": "reason_codes", "taint": "taint"}


def _naive_utc(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(tzinfo=None) if at.tzinfo is not None else at


def _recorded(text: str) -> str:
    """A filter's text as the log records text: what UTF-8 cannot hold (a lone surrogate) escaped
    as the log escapes it, so it matches what was written and can be bound at all."""
    value: str = escape_invalid_text(text, "", [])
    return value


def _arg_pointer(key: str) -> str:
    """The JSON pointer (RFC 6901) of argument ``key``: any key, with no way to leave ``input.args``."""
    return "/input/args/" + key.replace("~", "~0").replace("/", "~1")


@dataclass(frozen=True, slots=True)
class _ArgValue:
    """What an argument filter's value (`EventFilter.args`) selects, worked out once for both
    engines. A string argument must be ``text``. A number must equal ``number`` (Python's exact
    ``==`` of an int and a float). Any other JSON value must be ``json``, the value as the log
    writes it (`canonical`: keys sorted, text UTF-8 cannot hold escaped). None: the filter's value
    is not such a JSON value, so no argument of that kind is selected."""

    text: str
    number: int | float | None = None
    json: str | None = None

    def sql(self, pointer: str) -> tuple[str, list[Any]]:
        """The condition on ``events`` with its parameters (`where_sql`). DuckDB gives an argument as
        JSON text of its own (``10000000000000000.0`` for ``1e+16``, ``1e-7`` for ``1e-07``, an integer
        beyond 64 bits as written), so it is compared with the texts DuckDB makes of the value
        (``json_extract(?, '$')``); a string's is quoted, so it matches no other type. One JSON parse
        a row, as for a value that is not JSON."""
        texts: list[str] = []  # SQL for each JSON text, as DuckDB writes it, of an argument this selects
        params: list[Any] = []
        beyond = ""
        if self.number is not None:
            if isinstance(self.number, int) or self.number.is_integer():
                texts.append("?")
                params.append(str(int(self.number)))
            as_float = _as_float(self.number)
            if as_float is not None and math.isfinite(as_float):
                spelled = [repr(as_float)] if as_float != 0 else ["0.0", "-0.0"]  # -0.0 == 0.0
                texts += ["CAST(json_extract(?, '$') AS VARCHAR)"] * len(spelled)
                params += spelled
            elif as_float is not None:  # out of a float's range: DuckDB keeps the text as written (1E400)
                beyond = (" OR (TRY_CAST(json_extract_string(event, ?) AS DOUBLE) = ? AND json_type(event, ?) = "
                          "'DOUBLE' AND NOT regexp_full_match(json_extract_string(event, ?), '-?[0-9]+'))")  # fmt: skip
        elif self.json is not None:
            texts.append("CAST(json_extract(?, '$') AS VARCHAR)")
            params.append(self.json)
        if not texts and not beyond:
            return "json_extract_string(event, ?) = ?", [pointer, self.text]
        condition = f"CAST(json_extract(event, ?) AS VARCHAR) = ANY([to_json(CAST(? AS VARCHAR)), {', '.join(texts)}])"
        if beyond:
            return f"({condition}{beyond})", [pointer, self.text, *params, pointer, self.number, pointer, pointer]
        return condition, [pointer, self.text, *params]

    def selects(self, args: Any, key: str) -> bool:
        """Whether argument ``key`` of ``args`` (parsed ``input.args``) is this value: `sql`, in Python."""
        if not isinstance(args, dict) or key not in args:
            return False
        given = args[key]
        if isinstance(given, str):
            return given == self.text
        if isinstance(given, (int, float)) and not isinstance(given, bool):
            return self.number is not None and given == self.number
        return self.json is not None and _json_text(given) == self.json


def _arg_value(value: str) -> _ArgValue:
    """What the filter value ``value`` selects (`_ArgValue`)."""
    text = _recorded(value)
    try:
        parsed = json.loads(value, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # not JSON (NaN and Infinity, a 5000-digit integer, among them)
        return _ArgValue(text)
    if isinstance(parsed, str):
        return _ArgValue(text)
    if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
        return _ArgValue(text, number=parsed)
    try:
        return _ArgValue(text, json=canonical(escape_invalid_text(parsed, "", [])))
    except (ValueError, RecursionError):  # a number out of a float's range inside: the log cannot hold it
        return _ArgValue(text)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _as_float(number: float) -> float | None:
    """The float equal to ``number`` (an int or a float), if there is one."""
    try:
        as_float = float(number)
    except OverflowError:
        return None
    return as_float if as_float == number else None


def _json_text(value: Any) -> str | None:
    """A parsed value as compact JSON text, in the order it was written; None: it has no JSON text."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # a float the log wrote out of range (1E400) inside an object or list
        return None


def where_sql(where: EventFilter) -> tuple[str, list[Any]]:
    """``where`` as a SQL condition over ``events`` with its parameters (every value bound, never spliced)."""
    terms: list[str] = []
    params: list[Any] = []
    if where.since is not None:
        since = _naive_utc(where.since)
        terms += ["day >= ?", "timestamp >= ?"]  # the day prunes whole partitions
        params += [since.date(), since]
    if where.until is not None:
        until = _naive_utc(where.until)
        terms += ["day <= ?", "timestamp <= ?"]
        params += [until.date(), until]
    if where.after_seq is not None:
        terms.append("seq > ?")
        params.append(where.after_seq)
    if where.to_seq is not None:
        terms.append("seq <= ?")
        params.append(where.to_seq)
    for name in _EQUAL:
        value = getattr(where, name)
        if value is not None:
            terms.append(f"{name} = ?")
            params.append(_recorded(value))
    for name, column in _CONTAINS.items():
        value = getattr(where, name)
        if value is not None:
            terms.append(f"list_contains({column}, ?)")
            params.append(_recorded(value))
    for key, value in where.args:
        term, values = _arg_value(value).sql(_arg_pointer(_recorded(key)))
        terms.append(term)
        params += values
    return (" AND ".join(terms) or "true"), params


def matches(row: dict[str, Any], where: EventFilter) -> bool:
    """Whether a row (`promote`) is selected by ``where``: `where_sql`, in Python."""
    seq, at = row["seq"], row["timestamp"]
    if where.since is not None and (at is None or at < _naive_utc(where.since)):
        return False
    if where.until is not None and (at is None or at > _naive_utc(where.until)):
        return False
    if where.after_seq is not None and (seq is None or seq <= where.after_seq):
        return False
    if where.to_seq is not None and (seq is None or seq > where.to_seq):
        return False
    for name in _EQUAL:
        value = getattr(where, name)
        if value is not None and row[name] != _recorded(value):
            return False
    for name, column in _CONTAINS.items():
        value = getattr(where, name)
        if value is not None and _recorded(value) not in row[column]:
            return False
    if where.args:
        args = _at(json.loads(row["event"]), "input", "args")
        for key, value in where.args:
            if not _arg_value(value).selects(args, _recorded(key)):
                return False
    return True


def event_with_hash(line: str, digest: str) -> str:
    """The event a line records, as JSON text with its ``hash`` (the line is not parsed)."""
    return f'{line[:-1]},"hash":"{digest}"}}' if line.endswith("}") else line


# -- the indexer ----------------------------------------------------------------------------


@dataclass(slots=True)
class IndexReport:
    """What one `index_sealed` run did."""

    indexed: list[str] = field(default_factory=list)  # segments indexed now ("<first>-<last>")
    replaced: list[str] = field(default_factory=list)  # ... of them, ones whose index was of other bytes
    removed: list[str] = field(default_factory=list)  # segments gone from the log (retention): index dropped
    problems: list[str] = field(default_factory=list)  # segments left unindexed, and why
    unchanged: int = 0
    events: int = 0  # rows written now
    active_events: int = 0  # rows of the active snapshot, if one was taken
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "indexed": self.indexed, "replaced": self.replaced, "removed": self.removed, "problems": self.problems,
            "unchanged": self.unchanged, "events": self.events, "active_events": self.active_events,
            "seconds": round(self.seconds, 3),
        }  # fmt: skip


def _lower_priority() -> None:
    """Make the calling thread (and those it starts) run behind the router for CPU, `_NICE`."""
    with contextlib.suppress(OSError):  # raising one's own nice value is always allowed; not fatal anyway
        os.nice(_NICE)


def _connect(*, memory_limit: str, threads: int, temp: Path | None) -> duckdb.DuckDBPyConnection:
    engine = load_duckdb()  # only the indexer and the readers load DuckDB

    config: dict[str, Any] = {
        "threads": threads, "memory_limit": memory_limit,
        "autoinstall_known_extensions": False, "autoload_known_extensions": False,
    }  # fmt: skip
    if temp is not None:
        config["temp_directory"] = str(temp)
    connection: duckdb.DuckDBPyConnection = engine.connect(":memory:", config=config)
    # GLOBAL: a plain SET is the connection's own, and queries run on cursors (connections of
    # their own), which would read and show times in the host's zone.
    connection.execute("SET GLOBAL TimeZone = 'UTC'")  # timestamps are UTC, read and shown
    return connection


def _name(first: int, last: int) -> str:
    return f"{first:012d}-{last:012d}"


@dataclass(frozen=True, slots=True)
class _Marker:
    first_seq: int
    last_seq: int
    sha256: str
    files: tuple[str, ...]  # relative to the index directory

    @classmethod
    def read(cls, path: Path) -> _Marker | None:
        try:
            raw = json.loads(path.read_bytes())
            if raw.get("format") != _FORMAT:
                return None
            return cls(int(raw["first_seq"]), int(raw["last_seq"]), str(raw["sha256"]), tuple(map(str, raw["files"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


class _Lock:
    """The indexer's flock on ``<index>/.indexer.lock``: one indexer at work per log."""

    def __init__(self, index_dir: Path) -> None:
        index_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(index_dir / ".indexer.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)

    def take(self, *, wait: bool) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        os.close(self._fd)  # releases the lock


def index_sealed(
    layout: LogLayout,
    index_dir: Path | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    snapshot: bool = True,
    wait: bool = True,
) -> IndexReport:
    """Index every sealed segment not indexed yet (or indexed from other bytes), drop the index of
    segments no longer in the log, and (``snapshot``) snapshot the active segment. Idempotent; takes
    the indexer lock (waiting for another indexer, or, without ``wait``, raising if one is at work).

    Raises:
        AuditError: another indexer holds the lock (only without ``wait``).
    """
    index_dir = index_dir or index_dir_of(layout.active)
    lock = _Lock(index_dir)
    try:
        if not lock.take(wait=wait):
            raise AuditError(f"another indexer is at work on {index_dir}; try again when it is done")
        return _index_locked(layout, index_dir, progress or (lambda _: None), snapshot=snapshot)
    finally:
        lock.close()


def _index_locked(
    layout: LogLayout, index_dir: Path, progress: Callable[[str], None], *, snapshot: bool
) -> IndexReport:
    started = time.perf_counter()
    report = IndexReport()
    markers_dir = index_dir / "segments"
    markers_dir.mkdir(parents=True, exist_ok=True)
    temp = index_dir / ".tmp"
    shutil.rmtree(temp, ignore_errors=True)  # left by an indexer that died: nothing in it is needed
    temp.mkdir()
    parts = layout.parts()
    sealed = {_name(p.first_seq, p.last_seq): p for p in parts if p.kind == "sealed"}
    markers = {m.group(0)[:-5]: markers_dir / m.group(0) for m in map(_MARKER.fullmatch, os.listdir(markers_dir)) if m}
    for name in sorted(set(markers) - set(sealed)):
        _drop(index_dir, markers[name])
        report.removed.append(name)
        progress(f"dropped the index of {name}: the segment is no longer in the log")
    _drop_orphans(index_dir, {name for name in markers if name in sealed})
    connection = _connect(memory_limit=_INDEX_MEMORY, threads=2, temp=temp / "spill")
    try:
        for name, part in sorted(sealed.items()):
            try:
                manifest = part.manifest()
            except (OSError, ValueError) as exc:
                report.problems.append(f"{name}: its manifest is unreadable ({type(exc).__name__}): not indexed")
                continue
            marker = _Marker.read(markers_dir / f"{name}.json")
            if (
                marker is not None
                and marker.sha256 == manifest.sha256
                and _present(index_dir, marker)
                and _index_holds(connection, index_dir, marker)
            ):
                report.unchanged += 1
                continue
            if marker is not None and marker.sha256 == manifest.sha256:
                _log().warning("audit_index_files_damaged", segment=name)  # files gone, cut, or rows removed
            if marker is not None and marker.sha256 != manifest.sha256:
                report.replaced.append(name)
                _log().warning("audit_index_segment_replaced", segment=name, indexed=marker.sha256, now=manifest.sha256)
            if markers_dir.joinpath(f"{name}.json").exists():
                _drop(index_dir, markers_dir / f"{name}.json")
            problem = _index_segment(connection, part, manifest.sha256, index_dir, temp)
            if problem:
                report.problems.append(f"{name}: {problem}")
                _log().error("audit_index_segment_refused", segment=name, problem=problem)
                continue
            count = part.last_seq - part.first_seq + 1
            report.indexed.append(name)
            report.events += count
            progress(f"indexed {name} ({count} events)")
        if snapshot:
            report.active_events = _snapshot(connection, layout, index_dir, temp)
            if report.active_events:
                progress(f"snapshotted the active segment ({report.active_events} events)")
    finally:
        connection.close()
        shutil.rmtree(temp, ignore_errors=True)
    report.seconds = time.perf_counter() - started
    return report


def _present(index_dir: Path, marker: _Marker | _Snapshot) -> bool:
    return all(index_dir.joinpath(f).is_file() for f in marker.files)


def _stat_key(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _drop(index_dir: Path, marker_path: Path) -> None:
    """Remove an index marker, then its files (readers trust only files a current marker names)."""
    marker = _Marker.read(marker_path)
    marker_path.unlink(missing_ok=True)
    for name in marker.files if marker is not None else ():
        index_dir.joinpath(name).unlink(missing_ok=True)


def _drop_orphans(index_dir: Path, kept: set[str]) -> None:
    """Files of segments with no marker: an indexer died before writing one, or the segment is gone."""
    for day in index_dir.glob("day=*"):
        for file in day.glob("*.parquet"):
            if file.stem not in kept:
                file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            day.rmdir()  # only if empty


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


_COPY_OPTIONS = (
    f"FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {_ROW_GROUP}, PARTITION_BY (day), "
    # Dictionaries (and so bloom filters) for every column whose distinct values fit: ids repeat
    # within a row group, and a bloom filter lets a point query skip the groups without its id.
    f"DICTIONARY_SIZE_LIMIT {_ROW_GROUP}, WRITE_PARTITION_COLUMNS true, OVERWRITE_OR_IGNORE"
)


# The order of a day's rows, which decides what a row group's min/max and bloom filter let a scan
# skip. Every call writes a decision, and most an execution and egress events: the bulk. The
# approvals, credentials and errors that many audit questions pick out are fewer (a fifth of the
# bench's realistic mix): clustered apart, they fill row groups of their own, which a filter on
# one of those kinds reads alone (the approver/credential join read all 150 row groups of 1M
# events, now 30). Within each cluster rows go by agent and session, so one agent's or one
# session's rows share a row group (a per-agent daily count read 146 of the 150, now 60). Every
# reader that needs seq order sorts.
_BULK_KINDS = ("decision", "execution", "egress")
_ROW_ORDER = f"kind IN ({', '.join(map(repr, _BULK_KINDS))}), agent, session_id, seq"


def _write_days(
    connection: duckdb.DuckDBPyConnection, query: str, stage: Path, expected: tuple[int, int, int]
) -> tuple[dict[str, Path], str]:
    """Write the rows of ``query`` (the projection) into ``stage/day=*/`` in `_ROW_ORDER`; the file
    of each day, and what is wrong ("" if nothing). ``expected``: the count, first and last seq the
    rows must hold."""
    shutil.rmtree(stage, ignore_errors=True)
    ordered = f"SELECT * FROM ({query}) ORDER BY {_ROW_ORDER}"  # noqa: S608  (our projection, constant order)
    connection.execute(f"COPY ({ordered}) TO {_literal(str(stage))} ({_COPY_OPTIONS})")
    files = sorted(stage.glob("day=*/*.parquet"))
    if not files:
        return {}, "no line is a readable event"
    listed = ", ".join(_literal(str(f)) for f in files)
    got = connection.execute(
        f"SELECT count(*), count(DISTINCT seq), min(seq), max(seq) FROM read_parquet([{listed}])"  # noqa: S608  (quoted paths)
    ).fetchone()
    assert got is not None  # noqa: S101  (an aggregate always answers)
    count, distinct, first, last = got
    if (count, distinct, first, last) != (expected[0], expected[0], *expected[1:]):
        return {}, (
            f"{count} readable events (seq {first}..{last}) where the manifest says {expected[0]} "
            f"(seq {expected[1]}..{expected[2]}): a line is not a readable event (corrupt); "
            "run `stockade audit verify`. Queries read it line by line until it is indexed"
        )
    days: dict[str, Path] = {}
    for file in files:
        day = file.parent.name.removeprefix("day=")
        if day in days:
            return {}, f"DuckDB wrote more than one file for day {day}"
        days[day] = file
    return days, ""


def _write_file_days(
    connection: duckdb.DuckDBPyConnection, path: Path, stage: Path, expected: tuple[int, int, int],
    end: int | None = None,
) -> tuple[dict[str, Path], str]:  # fmt: skip
    """`_write_days` of the events of the log file ``path`` (with ``end``: a live file, up to that
    byte and seq ``expected[2]``), read by DuckDB's reader, or in Python where that reader cannot:
    a line longer than it takes (skipped, every offset after it off), or a file of long lines
    (1 MiB arguments), whose buffers it holds whole past the memory cap. A DuckDB failure either
    way is the file's problem, never an internal error."""
    engine = load_duckdb()
    upto = "" if end is None else f" WHERE seq <= {int(expected[2])}"  # appended meanwhile: left to readers
    try:
        query = f"SELECT * FROM ({_projected(_csv_source([path]))}){upto}"  # noqa: S608  (a quoted path and an int)
        days, problem = _write_days(connection, query, stage, expected)
    except engine.Error as exc:
        problem = _message(exc)
        _log().info("audit_index_read_in_python", file=path.name, reason=problem[:200])
    if not problem:
        return days, ""
    try:
        with path.open("rb") as handle:
            query = f"SELECT * FROM ({_python_source(connection, handle, end)}){upto}"  # noqa: S608  (constant SQL and an int)
            return _write_days(connection, query, stage, expected)
    except engine.Error as exc:
        return {}, f"it could not be indexed: {_message(exc)}; queries read it line by line"


def _index_segment(connection: duckdb.DuckDBPyConnection, part: Part, sha256: str, index_dir: Path, temp: Path) -> str:
    """Index one sealed segment; what is wrong with it ("" when indexed)."""
    name = _name(part.first_seq, part.last_seq)
    actual = _file_sha256(part.path)
    if actual != sha256:
        return (
            f"its bytes (sha256 {actual[:16]}…) are not those its manifest records ({sha256[:16]}…): "
            "run `stockade audit verify`. Not indexed; queries read it line by line"
        )
    expected = (part.last_seq - part.first_seq + 1, part.first_seq, part.last_seq)
    days, problem = _write_file_days(connection, part.path, temp / "stage", expected)
    if problem:
        return problem
    placed: list[str] = []
    for day, file in days.items():
        target = index_dir / f"day={day}" / f"{name}.parquet"
        target.parent.mkdir(exist_ok=True)
        os.replace(file, target)
        placed.append(str(target.relative_to(index_dir)))
    # The marker last: readers use only files a marker names.
    write_json_atomically(index_dir / "segments" / f"{name}.json", {
        "format": _FORMAT, "first_seq": part.first_seq, "last_seq": part.last_seq, "sha256": sha256,
        "files": sorted(placed), "indexed_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }, sync=False)  # fmt: skip
    return ""


def _line_chunks(
    handle: BinaryIO, start: int = 0, end: int | None = None
) -> Iterator[tuple[list[bytes], list[int], int]]:
    """The complete lines of an open file from byte ``start`` (and, given ``end``, ending by it), read
    in Python, however long: each chunk's lines (`_FEED_CHUNK` bytes or so), where each starts, and
    where the last one ends."""
    found: list[bytes] = []
    offsets: list[int] = []
    size = after = 0
    for offset, line in complete_lines(handle, start):
        if end is not None and offset + len(line) + 1 > end:
            break
        found.append(line)
        offsets.append(offset)
        after = offset + len(line) + 1
        size += len(line)
        if size >= _FEED_CHUNK:
            yield found, offsets, after
            found, offsets, size = [], [], 0
    if found:
        yield found, offsets, after


_LINES_OF = "SELECT unnest(?::VARCHAR[]) AS line, unnest(?::BIGINT[]) AS off"  # two lists as rows


def _insert_lines(
    connection: duckdb.DuckDBPyConnection,
    table: str,
    before: list[Any],
    found: list[bytes],
    offsets: list[int],
    *,
    whole: bool = True,
) -> None:
    """Insert a row into ``table`` (the values ``before``, then `COLUMNS`) for each line of ``found``
    that is an event, starting at its offset: projected by DuckDB, but a line longer than `_MAX_LINE`
    by `promote` (DuckDB's JSON functions would need several times its size, past a reader's memory
    cap). Without ``whole``, such a row's ``event`` is null: a reader's copy of a line it cannot hold
    (its queries read events from the log, and decide on its arguments there: `AuditQuery._events`)."""
    marks = "?, " * len(before)
    short = [(line, offset) for line, offset in zip(found, offsets, strict=True) if len(line) <= _MAX_LINE]
    if short:
        texts = [line.decode(errors="replace") for line, _ in short]  # UTF-8 as written; else not json_valid
        projected = _projected(_LINES_OF, offsets=True)
        connection.execute(f"INSERT INTO {table} SELECT {marks}{_columns()} FROM ({projected})",  # noqa: S608  (constant SQL)
                           [*before, texts, [offset for _, offset in short]])  # fmt: skip
    for line, offset in zip(found, offsets, strict=True):
        row = promote(line, offset) if len(line) > _MAX_LINE else None
        if row is not None:
            row["event"] = row["event"] if whole else None
            values = marks + ", ".join("?" * len(COLUMNS))
            connection.execute(f"INSERT INTO {table} VALUES ({values})", [*before, *(row[c] for c in COLUMNS)])  # noqa: S608  (constant SQL)


def _python_source(connection: duckdb.DuckDBPyConnection, handle: BinaryIO, end: int | None = None) -> str:
    """SQL for the events of an open file (up to byte ``end``) read in Python, however long its lines,
    into a temporary table (`_insert_lines`)."""
    connection.execute(f"CREATE OR REPLACE TEMPORARY TABLE python_rows AS {_EMPTY}")
    for found, offsets, _ in _line_chunks(handle, 0, end):
        _insert_lines(connection, "python_rows", [], found, offsets)
    return f"SELECT {_columns()} FROM python_rows"  # noqa: S608  (constant SQL)


def _index_holds(connection: duckdb.DuckDBPyConnection, index_dir: Path, marker: _Marker | _Snapshot) -> bool:
    """Whether a marker's files hold as many rows as its range has seqs, by their footers (no row is
    read): a file cut short or with rows removed is not used. (A row that is not its line is found
    as it is read: `_Lines`.)"""
    return _holds(marker, _file_rows(connection, index_dir, marker.files))


def _holds(marker: _Marker | _Snapshot, rows: dict[str, int | None]) -> bool:
    """`_index_holds`, from the row counts of its files already read."""
    mine = [rows.get(f) for f in marker.files]
    return bool(mine) and None not in mine and sum(n or 0 for n in mine) == marker.last_seq - marker.first_seq + 1


def _file_rows(connection: duckdb.DuckDBPyConnection, index_dir: Path, names: Sequence[str]) -> dict[str, int | None]:
    """Each index file's row count, from its footer, in one query (~0.2 ms a file here, against ~1 ms
    for the seq column's statistics too); a file that cannot be read gives None."""
    engine = load_duckdb()

    paths = {str(index_dir / name): name for name in names}
    listed = ", ".join(_literal(path) for path in paths)
    try:
        found = connection.execute(f"SELECT file_name, num_rows FROM parquet_file_metadata([{listed}])").fetchall()  # noqa: S608  (quoted paths)
    except engine.Error:  # one unreadable file fails them all: each on its own, then
        if len(names) == 1:
            return {names[0]: None}
        return {k: v for name in names for k, v in _file_rows(connection, index_dir, [name]).items()}
    rows: dict[str, int | None] = dict.fromkeys(names)
    for path, count in found:
        if path in paths and count is not None:
            rows[paths[path]] = int(count)
    return rows


# -- the active segment's snapshot ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What ``active.json`` records: the active segment's first ``offset`` bytes, seq
    ``first_seq``..``last_seq``, are in ``files``, as long as the segment is still inode ``ino``
    starting with the line whose seq and prev_hash are ``first_seq`` and ``first_prev``."""

    ino: int
    first_seq: int
    first_prev: str
    offset: int
    last_seq: int
    files: tuple[str, ...]

    @classmethod
    def read(cls, path: Path) -> _Snapshot | None:
        try:
            raw = json.loads(path.read_bytes())
            if raw.get("format") != _FORMAT:
                return None
            return cls(int(raw["ino"]), int(raw["first_seq"]), str(raw["first_prev"]), int(raw["offset"]),
                       int(raw["last_seq"]), tuple(map(str, raw["files"])))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def covers_open(self, handle: BinaryIO) -> bool:
        """`covers`, of the active segment as it is open in ``handle`` (read from its start)."""
        try:
            stat = os.fstat(handle.fileno())
            start = os.pread(handle.fileno(), 120, 0)
        except OSError:
            return False
        if stat.st_ino != self.ino or stat.st_size < self.offset:
            return False
        return head_of(start) == (self.first_seq, self.first_prev)

    def covers(self, active: Path) -> bool:
        """Whether this snapshot is of ``active`` as it is now (its first line, its inode, no shorter)."""
        try:
            stat = active.stat()
        except OSError:
            return False
        if stat.st_ino != self.ino or stat.st_size < self.offset:
            return False
        return _first_head(active) == (self.first_seq, self.first_prev)


def _first_head(path: Path) -> tuple[int, str] | None:
    try:
        with path.open("rb") as handle:
            start = handle.read(120)
    except OSError:
        return None
    return head_of(start)


def _last_newline(handle: BinaryIO, end: int) -> int:
    """The offset of the last newline before byte ``end`` of an open file (-1: none)."""
    while end > 0:
        start = max(0, end - (1 << 16))
        handle.seek(start)
        cut = handle.read(end - start).rfind(b"\n")
        if cut != -1:
            return start + cut
        end = start
    return -1


def _complete_end(path: Path, size: int) -> tuple[int, int]:
    """Where the last complete line within the first ``size`` bytes ends, and its seq (0, 0: none)."""
    with path.open("rb") as handle:
        newline = _last_newline(handle, size)
        if newline < 0:
            return 0, 0
        handle.seek(_last_newline(handle, newline) + 1)
        head = head_of(handle.read(128))  # a line's head: seq (≤ 19 digits) and prev_hash
    return (newline + 1, head[0]) if head is not None else (0, 0)


def snapshot_active(
    layout: LogLayout, index_dir: Path | None = None, *, min_new_bytes: int = 0, growth: float = 0.0
) -> int:
    """Snapshot the active segment's complete lines into the index (under the indexer lock) if it
    grew since the last snapshot by at least ``min_new_bytes`` and by ``growth`` times the bytes that
    one covers (each snapshot re-reads the whole segment: with ``growth`` 0.25 the work stays a small
    multiple of the segment's size however often this is asked); the events snapshotted (0: none)."""
    index_dir = index_dir or index_dir_of(layout.active)
    lock = _Lock(index_dir)
    try:
        lock.take(wait=True)
        temp = index_dir / ".tmp"
        temp.mkdir(exist_ok=True)
        connection = _connect(memory_limit=_INDEX_MEMORY, threads=2, temp=temp / "spill")
        try:
            return _snapshot(connection, layout, index_dir, temp, min_new_bytes=min_new_bytes, growth=growth)
        finally:
            connection.close()
    finally:
        lock.close()


def _snapshot(
    connection: duckdb.DuckDBPyConnection,
    layout: LogLayout,
    index_dir: Path,
    temp: Path,
    *,
    min_new_bytes: int = 0,
    growth: float = 0.0,
) -> int:
    marker_path = index_dir / "active.json"
    previous = _Snapshot.read(marker_path)
    active = layout.active
    try:
        stat = active.stat()
    except FileNotFoundError:
        stat = None
    head = _first_head(active) if stat is not None else None
    if stat is None or head is None:
        _drop_snapshot(index_dir, marker_path)
        return 0
    wanted = max(min_new_bytes, int(previous.offset * growth), 1) if previous is not None else 1
    if previous is not None and previous.covers(active) and stat.st_size - previous.offset < wanted:
        return 0
    end, last_seq = _complete_end(active, stat.st_size)
    if end == 0 or last_seq < head[0]:
        _drop_snapshot(index_dir, marker_path)
        return 0
    # Lines past ``end`` (appended meanwhile) are left to the readers: only seqs up to last_seq.
    expected = (last_seq - head[0] + 1, head[0], last_seq)
    days, problem = _write_file_days(connection, active, temp / "stage", expected, end)
    if problem:
        _log().warning("audit_index_snapshot_skipped", problem=problem)
        _drop_snapshot(index_dir, marker_path)
        return 0
    name = _name(head[0], last_seq)
    placed = []
    for day, file in days.items():
        target = index_dir / "active" / f"day={day}" / f"{name}.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(file, target)
        placed.append(str(target.relative_to(index_dir)))
    write_json_atomically(marker_path, {
        "format": _FORMAT, "ino": stat.st_ino, "first_seq": head[0], "first_prev": head[1], "offset": end,
        "last_seq": last_seq, "files": sorted(placed),
    }, sync=False)  # fmt: skip
    _drop_stale_snapshots(index_dir, set(placed))
    return last_seq - head[0] + 1


def _drop_stale_snapshots(index_dir: Path, current: set[str]) -> None:
    """Remove snapshot files no marker names once they are old enough that no reader still reads
    them (a reader lists the files at each refresh; a long read keeps reading the ones it listed)."""
    now = time.time()
    for file in index_dir.glob("active/day=*/*.parquet"):
        name = str(file.relative_to(index_dir))
        with contextlib.suppress(FileNotFoundError):
            if name not in current and now - file.stat().st_mtime > _STALE_S:
                file.unlink()


def _drop_snapshot(index_dir: Path, marker_path: Path) -> None:
    marker_path.unlink(missing_ok=True)
    _drop_stale_snapshots(index_dir, set())


# -- running it in the background -------------------------------------------------------------


def index_log(
    audit_path: Path, index_dir: Path | None = None, *, progress: Callable[[str], None] | None = None
) -> IndexReport:
    """`index_sealed` for the log at ``audit_path``, going on while `spawn_indexer` was called
    during the run (segments sealed meanwhile). Returns the last run's report, with the earlier
    runs' work added."""
    layout = LogLayout(audit_path)
    index_dir = index_dir or index_dir_of(audit_path)
    index_dir.mkdir(parents=True, exist_ok=True)
    pending = index_dir / ".pending"
    total = IndexReport()
    while True:
        seen = _size(pending)
        report = index_sealed(layout, index_dir, progress=progress)
        total.indexed += report.indexed
        total.replaced += report.replaced
        total.removed += report.removed
        total.problems = report.problems
        total.unchanged = report.unchanged
        total.events += report.events
        total.active_events = report.active_events
        total.seconds += report.seconds
        if _size(pending) == seen:
            return total


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def follow(
    audit_path: Path,
    index_dir: Path | None = None,
    *,
    interval_s: float = 5.0,
    snapshot_bytes: int = 1 << 20,
    stop: threading.Event | None = None,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Keep the index current until ``stop`` is set: index sealed segments as they appear, and
    re-snapshot the active segment each time it grew by ``snapshot_bytes`` and by a quarter."""
    stop = stop or threading.Event()
    layout = LogLayout(audit_path)
    index_dir = index_dir or index_dir_of(audit_path)
    known: set[str] = set()
    while not stop.is_set():
        sealed = {p.path.name for p in layout.parts() if p.kind == "sealed"}
        if sealed != known:
            index_sealed(layout, index_dir, progress=progress, snapshot=False)
            known = sealed
        count = snapshot_active(layout, index_dir, min_new_bytes=snapshot_bytes, growth=0.25)
        if count and progress is not None:
            progress(f"snapshotted the active segment ({count} events)")
        stop.wait(interval_s)


def spawn_indexer(audit_path: Path) -> subprocess.Popen[bytes] | None:
    """Start ``python -m router.audit.index <audit_path>`` in its own session, niced, unless an
    indexer holds the lock (that one is told to look again); returns at once, with the process
    started (None when none was), for the caller to reap. For the writer, after it seals a segment:
    no DuckDB in the caller's process, nothing waited for. None, too, where DuckDB (the `audit`
    extra) is not installed: an indexer could only fail, at every seal."""
    import subprocess  # noqa: PLC0415  (a reader never starts one: a fresh query does not pay for it)

    if importlib.util.find_spec("duckdb") is None:
        _log().warning("audit_indexer_not_started", path=str(audit_path),
                       error="DuckDB (the audit extra) is not installed")  # fmt: skip
        return None
    index_dir = index_dir_of(audit_path)
    try:
        index_dir.mkdir(parents=True, exist_ok=True)
        # Told first: an indexer finishing now sees it and runs once more (see index_log).
        fd = os.open(index_dir / ".pending", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            os.write(fd, b".")
        finally:
            os.close(fd)
        lock = _Lock(index_dir)
        try:
            if not lock.take(wait=False):
                return None
        finally:
            lock.close()
        root = str(Path(__file__).resolve().parents[2])  # where `router` is importable from
        with (index_dir / "indexer.log").open("ab") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-m", "router.audit.index", "--background", str(audit_path)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=index_dir,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": root},
                start_new_session=True, close_fds=True,
            )  # fmt: skip
    except OSError as exc:
        _log().error("audit_indexer_not_started", path=str(audit_path), error=str(exc))
        return None
    return child  # the caller reaps it (`router.audit.factory.BackgroundIndexer`)


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _File:
    """One Parquet file of the index: its path, the seqs of the segment it is a day of, that day."""

    path: str
    first_seq: int
    last_seq: int
    day: date | None

    @classmethod
    def of(cls, index_dir: Path, name: str, first_seq: int, last_seq: int) -> _File:
        day = None
        for part in Path(name).parts:
            if part.startswith("day="):
                with contextlib.suppress(ValueError):
                    day = date.fromisoformat(part[4:])
        return cls(str(index_dir / name), first_seq, last_seq, day)


def _source(
    files: Sequence[_File],
    lowest: int = 1,
    highest: int | None = None,
    days: tuple[date | None, date | None] = (None, None),
) -> str:
    """SQL for the events of ``files`` whose segment holds seqs in ``lowest``..``highest`` and whose
    day is within ``days``, and of ``fed``: the rows a query can match, without opening the rest."""
    since, until = days
    chosen = [
        f.path for f in files
        if f.last_seq >= lowest and (highest is None or f.first_seq <= highest)
        and (f.day is None or ((since is None or f.day >= since) and (until is None or f.day <= until)))
    ]  # fmt: skip
    fed = f"SELECT {_columns()} FROM fed"  # noqa: S608  (constant SQL)
    if not chosen:
        return fed
    listed = ", ".join(_literal(f) for f in chosen)
    return f"SELECT {_columns()} FROM read_parquet([{listed}]) UNION ALL {fed}"  # noqa: S608  (quoted paths)


@dataclass(slots=True)
class _Fed:
    """Lines of one part of the log that `AuditQuery` holds in its ``fed`` table: a sealed segment
    not indexed (all of it), or the active segment (inode ``ino``, first seq ``first_seq``) from
    byte ``start`` to ``end``."""

    ino: int
    first_seq: int
    start: int
    end: int
    unreadable: list[tuple[int, int]] = field(default_factory=list)  # a sealed segment's seqs no line gave


class _Vanished(Exception):
    """A listed sealed segment is gone (retention deleted it): list the log again."""


_FED_SHAPE = "SELECT count(*), count(DISTINCT seq), min(seq), max(seq) FROM fed WHERE part = ?"  # one part's rows
_LIST_TRIES = 5  # listings of the log's parts a refresh makes while seals move segments under it


def _gaps(parts: Sequence[Part], head: tuple[int, str] | None) -> list[tuple[int, int]]:
    """The seqs the log's files do not hold, from one listing (``head``: the active segment's first
    line): retired ranges (tombstones), and stretches no part holds (a segment deleted under the
    writer, which records it). A query over a seq range may skip these and no others."""
    gaps: list[tuple[int, int]] = []
    expected = 1
    for part in parts:
        if part.kind == "active":
            first, last = (head[0], head[0]) if head is not None else (expected, expected - 1)
        else:
            first, last = part.first_seq, part.last_seq
        if first > expected:
            gaps.append((expected, first - 1))
        if part.kind == "tombstone":
            gaps.append((first, last))
        expected = max(expected, last + 1)
    return gaps


def _hole(first: int, last: int, unreadable: Sequence[tuple[int, int]] = ()) -> str:
    for low, high in unreadable:
        if low <= last and high >= first:
            return (
                f"events {first}..{last} are missing from what the query read: the line of event {max(low, first)} "
                "in the log's files is not a readable event (a damaged line); run `stockade audit verify`"
            )
    return (
        f"events {first}..{last} are missing from what the query read, though the log's files hold them "
        "(a segment was sealed while it was read, or the index changed under it): ask again"
    )


def _unexplained(gaps: Sequence[tuple[int, int]], first: int, last: int) -> bool:
    """Whether seqs ``first``..``last`` (missing from a result) are not all within ``gaps``."""
    for low, high in gaps:
        if low <= first <= high:
            first = high + 1
            if first > last:
                return False
    return first <= last


_READ_ONLY = "only one SELECT (or WITH … SELECT) statement, over the view `events`"
_BATCH = 500  # rows per fetch
_SPAN = 4096  # events read per query once their seqs are known: a row group or two
_LINE_READ = 4096  # bytes read at an event's offset at first (most lines are shorter)
_FEED_CHUNK = 4 << 20  # bytes of active lines per insert


class AuditQuery:
    """SQL over one log's index and what it does not cover yet, as the view ``events`` (`COLUMNS`).

    One in-memory DuckDB database per instance, few threads and a memory cap. Every query first
    brings the view up to date (`refresh`): the Parquet files of indexed segments and of the active
    segment's snapshot are read where they are; the rest (a sealed segment not indexed yet, active
    lines past the snapshot) is parsed once into the table ``fed``, and a long-lived instance (the
    API) adds only new lines each time. No query can read files outside the log and its index,
    write any, or change a setting."""

    def __init__(
        self,
        audit_path: Path,
        index_dir: Path | None = None,
        *,
        threads: int = 2,
        memory_limit: str = _QUERY_MEMORY,
        writable: Sequence[Path] = (),
    ) -> None:
        """``writable``: files `copy_parquet` may write (no query can write any other)."""
        self.layout = LogLayout(audit_path)
        self.index_dir = index_dir or index_dir_of(audit_path)
        self.unindexed: list[str] = []
        """Sealed segments read line by line at the last refresh (not indexed, or indexed from other bytes)."""
        self._spill = Path(tempfile.mkdtemp(prefix="stockade-audit-"))
        # Removed at close, or when the engine is collected or the process exits without closing it.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._spill, True)
        # Every statement runs on these threads, niced: DuckDB's own threads, started by the one
        # that connects, inherit it. So a query yields the CPU to the router wherever it runs (a
        # CLI beside the router, the HTTP API inside it), and the caller's priority is untouched.
        self._worker = ThreadPoolExecutor(
            max_workers=_QUERY_THREADS, thread_name_prefix="stockade-audit-query", initializer=_lower_priority
        )
        self._lock = threading.Lock()
        self._view_sql = ""
        self._fed: dict[str, _Fed] = {}
        self._files: list[_File] = []
        self._gaps: list[tuple[int, int]] = []  # seqs the files do not hold (`_gaps`), at the last refresh
        self._held_through = 0  # the last seq of the last sealed segment, at the last refresh
        self._seen: dict[Path, tuple[tuple[int, int, int], Any]] = {}
        # Each index file's row count, by its stat: see `_rows`.
        self._rows_seen: dict[tuple[str, int, int, int], int | None] = {}
        self._unreadable: list[tuple[int, int]] = []  # seqs of fed segments whose lines are not events
        readable = [str(self.layout.segments_dir) + "/", str(self.index_dir) + "/", str(self._spill) + "/"]
        self._db = self._run(_connect, memory_limit=memory_limit, threads=threads, temp=self._spill)
        self._run(self._configure, readable, [str(self.layout.active), *map(str, writable)])
        self.refresh()

    def _configure(self, readable: list[str], writable: list[str]) -> None:
        self._db.execute(f"CREATE TABLE fed AS SELECT '' AS part, * FROM ({_EMPTY})")  # noqa: S608  (constant SQL)
        self._db.execute("SET allowed_directories = ?", [readable])
        self._db.execute("SET allowed_paths = ?", [writable])
        self._db.execute("SET enable_external_access = false")
        # Footers read once per file, not per query (an index file is never rewritten under its name).
        # GLOBAL, for the cursors queries run on (a plain SET left them without it: ~10 ms a query).
        self._db.execute("SET GLOBAL parquet_metadata_cache = true")
        self._db.execute("SET lock_configuration = true")

    def _run(self, work: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``work(*args, **kwargs)`` on a query thread; its result or its exception."""
        return self._worker.submit(work, *args, **kwargs).result()

    def close(self) -> None:
        self._run(self._db.close)
        self._worker.shutdown()
        self._cleanup()

    def __enter__(self) -> AuditQuery:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the view --

    def refresh(self) -> None:
        """Point ``events`` at what the log and its index hold now."""
        self._run(self._refresh)

    def _refresh(self) -> None:
        with self._lock:
            view = self._view()
            if view != self._view_sql:
                self._db.execute("CREATE OR REPLACE VIEW events AS " + view)
                self._view_sql = view

    def _view(self) -> str:
        # The writer seals by renaming the active file into the segments directory: a seal between
        # listing the segments and opening the active file would leave that segment in neither. So
        # the active file opened must start where the listed segments end; if it does not, list
        # again: a listing that changed was such a seal (try again), one that did not is a gap the
        # files themselves hold (a segment deleted under the writer, recorded in its log).
        listed = self.layout.parts()
        for _ in range(_LIST_TRIES):
            try:
                # One open file for its inode, head and lines: a rotation meanwhile cannot mix two files.
                handle: BinaryIO | None = self.layout.active.open("rb")
            except FileNotFoundError:
                handle = None
            with handle if handle is not None else contextlib.nullcontext():
                head = head_of(handle.read(128)) if handle is not None else None
                ended = max((p.last_seq for p in listed if p.kind != "active"), default=0)
                if head is None or head[0] != ended + 1:
                    again = self.layout.parts()
                    if [(p.kind, p.path) for p in again] != [(p.kind, p.path) for p in listed]:
                        listed = again
                        continue
                try:
                    return self._build(listed, handle, head)
                except _Vanished:
                    # Retention deleted a listed segment before it was read: listed again, it is the
                    # recorded gap its tombstone makes, not an error.
                    listed = self.layout.parts()
        raise AuditError(
            f"the segments of {self.layout.active} changed {_LIST_TRIES} times while a query listed them "
            "(segments sealed faster than they can be listed): ask again"
        )

    def _build(self, parts: list[Part], handle: BinaryIO | None, head: tuple[int, str] | None) -> str:
        """The view over ``parts`` (one listing) and the active segment open as ``handle``."""
        files: list[_File] = []
        unindexed: list[Part] = []
        indexed: list[tuple[Part, _Marker]] = []
        for part in parts:
            if part.kind != "sealed":
                continue
            marker = self._cached(
                self.index_dir / "segments" / f"{_name(part.first_seq, part.last_seq)}.json", _Marker.read
            )
            if (
                marker is not None
                and marker.sha256 == self._cached(_manifest_of(part), _manifest_sha256)
                and _present(self.index_dir, marker)
            ):
                indexed.append((part, marker))
            else:
                unindexed.append(part)
        snapshot = _Snapshot.read(self.index_dir / "active.json")
        if snapshot is not None and (
            handle is None or not snapshot.covers_open(handle) or not _present(self.index_dir, snapshot)
        ):
            snapshot = None
        rows = self._rows([f for _, m in indexed for f in m.files] + ([] if snapshot is None else [*snapshot.files]))
        for part, marker in indexed:
            if _holds(marker, rows):
                files += [_File.of(self.index_dir, f, part.first_seq, part.last_seq) for f in marker.files]
            else:
                unindexed.append(part)
        if snapshot is not None and _holds(snapshot, rows):
            files += [_File.of(self.index_dir, f, snapshot.first_seq, snapshot.last_seq) for f in snapshot.files]
        else:
            snapshot = None
        unindexed.sort(key=lambda p: p.first_seq)
        self._feed_sealed(unindexed)
        self._feed_active(snapshot, handle, head)
        self.unindexed = [_name(p.first_seq, p.last_seq) for p in unindexed]
        self._files = files
        self._gaps = _gaps(parts, head)
        self._unreadable = [r for p in unindexed for r in self._fed[_name(p.first_seq, p.last_seq)].unreadable]
        self._held_through = max((p.last_seq for p in parts if p.kind == "sealed"), default=0)
        return _source(files)

    def _rows(self, names: list[str]) -> dict[str, int | None]:
        """Each index file's row count (`_file_rows`), read again only once the file changed, and
        all that changed in one query (a fresh process reads every file's)."""
        keys: dict[str, tuple[str, int, int, int] | None] = {}
        for name in names:
            try:
                keys[name] = (name, *_stat_key(self.index_dir / name))
            except OSError:
                keys[name] = None
        seen, self._rows_seen = self._rows_seen, {}  # only the files of this listing stay known
        wanted = [name for name, key in keys.items() if key is not None and key not in seen]
        read = _file_rows(self._db, self.index_dir, wanted) if wanted else {}
        found: dict[str, int | None] = {}
        for name, key in keys.items():
            found[name] = None if key is None else seen[key] if key in seen else read.get(name)
            if key is not None:
                self._rows_seen[key] = found[name]
        return found

    def _cached(self, path: Path, read: Callable[[Path], _T]) -> _T:
        """``read(path)``, again only once the file changed (a manifest or marker is read per refresh)."""
        try:
            stat = path.stat()
            key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            return read(path)
        found = self._seen.get(path)
        if found is None or found[0] != key:
            found = self._seen[path] = (key, read(path))
        value: _T = found[1]
        return value

    def _feed_sealed(self, unindexed: list[Part]) -> None:
        """``fed`` holds exactly the sealed segments that are not indexed: every line of each that is
        an event, by DuckDB's reader, or, for a segment it does not read whole (a line longer than
        `_MAX_LINE`, whose skipping would also move every offset after it), in Python.

        Raises:
            _Vanished: a listed segment is gone (retention deleted it).
            AuditError: a segment cannot be read.
        """
        engine = load_duckdb()

        wanted = {_name(p.first_seq, p.last_seq): p for p in unindexed}
        for name in [n for n in self._fed if n != "active" and n not in wanted]:
            self._db.execute("DELETE FROM fed WHERE part = ?", [name])
            del self._fed[name]
        for name, part in wanted.items():
            if name in self._fed:
                continue
            missing: list[tuple[int, int]] = []
            try:
                projected = _projected(_csv_source([part.path]))
                try:
                    self._db.execute(f"INSERT INTO fed SELECT ? AS part, {_columns()} FROM ({projected})", [name])  # noqa: S608  (quoted path)
                    got = self._db.execute(_FED_SHAPE, [name]).fetchone()
                except engine.Error:  # past the memory cap on long lines (see _index_segment): Python reads it
                    got = None
                count = part.last_seq - part.first_seq + 1
                if got != (count, count, part.first_seq, part.last_seq):
                    # A line skipped (too long, not JSON) or one too many: the running offsets are off.
                    self._db.execute("DELETE FROM fed WHERE part = ?", [name])
                    with part.path.open("rb") as handle:
                        for found, offsets, _ in _line_chunks(handle):
                            _insert_lines(self._db, "fed", [name], found, offsets, whole=False)
                    missing = self._missing(name, part)
            except (engine.Error, OSError) as exc:
                self._db.execute("DELETE FROM fed WHERE part = ?", [name])
                if not part.path.exists():
                    raise _Vanished(name) from exc
                raise AuditError(f"cannot read the audit segment {part.path}: {_message(exc)}") from exc
            self._fed[name] = _Fed(0, part.first_seq, 0, 0, missing)

    def _missing(self, name: str, part: Part) -> list[tuple[int, int]]:
        """The seqs of sealed segment ``part`` that no row of ``fed`` holds, as ranges."""
        found = self._db.execute("SELECT DISTINCT seq FROM fed WHERE part = ? AND seq BETWEEN ? AND ? ORDER BY seq",
                                 [name, part.first_seq, part.last_seq]).fetchall()  # fmt: skip
        if len(found) == part.last_seq - part.first_seq + 1:
            return []
        ranges: list[tuple[int, int]] = []
        expected = part.first_seq
        for (seq,) in [*found, (part.last_seq + 1,)]:
            if seq > expected:
                ranges.append((expected, seq - 1))
            expected = seq + 1
        return ranges

    def _feed_active(self, snapshot: _Snapshot | None, handle: BinaryIO | None, head: tuple[int, str] | None) -> None:
        """``fed`` holds the active segment's complete lines (open as ``handle``, its first line's
        head ``head``) past the snapshot (if any)."""
        ino = os.fstat(handle.fileno()).st_ino if handle is not None else 0
        fed = self._fed.get("active")
        start, after = (snapshot.offset, snapshot.last_seq) if snapshot is not None else (0, 0)
        if fed is not None and (head is None or (fed.ino, fed.first_seq) != (ino, head[0]) or fed.start > start):
            self._db.execute("DELETE FROM fed WHERE part = 'active'")
            fed = None
            del self._fed["active"]
        if handle is None or head is None:
            return
        if fed is None:
            fed = self._fed["active"] = _Fed(ino, head[0], start, start)
        elif after and fed.start < start:
            # Lines the snapshot has taken over since they were fed (none if it has not moved).
            self._db.execute("DELETE FROM fed WHERE part = 'active' AND seq <= ?", [after])
            fed.start = start
        for found, offsets, end in _line_chunks(handle, max(fed.end, start)):
            _insert_lines(self._db, "fed", ["active"], found, offsets, whole=False)
            fed.end = end

    # -- queries --

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection of its own to this database (after `refresh`), for one query at a time."""
        self.refresh()
        return self._db.cursor()

    def events(
        self, where: EventFilter, *, limit: int | None = None, columns: Sequence[str] = ("seq", "hash", "event")
    ) -> Iterator[tuple[Any, ...]]:
        """The selected events' ``columns``, lowest seq first (`_events`). A query for a seq range
        (no filter but ``after_seq`` and ``to_seq``) that would come back with a hole the log's
        files do not have (retired ranges, and stretches no segment holds, are no hole) raises
        `AuditError` where the hole is, instead of returning less than was asked: a pager's cursor
        would skip those events for good, and an export would leave them out unnoticed.

        Raises:
            AuditError: the events cannot be read, or a seq range came back with a hole.
        """
        rows = self._events(where, limit=limit, columns=columns)
        if "seq" not in columns or dataclasses.replace(where, after_seq=None, to_seq=None) != EventFilter():
            yield from rows
            return
        at = list(columns).index("seq")
        previous, count = where.after_seq or 0, 0
        # What the listing of this query's view held: the gaps, the last sealed seq, unreadable lines.
        known: tuple[list[tuple[int, int]], int, list[tuple[int, int]]] | None = None
        for row in rows:
            seq = row[at]
            known = known or (self._gaps, self._held_through, self._unreadable)
            if seq > previous + 1 and _unexplained(known[0], previous + 1, seq - 1):
                raise AuditError(_hole(previous + 1, seq - 1, known[2]))
            previous, count = max(previous, seq), count + 1
            yield row
        gaps, held, unreadable = known or (self._gaps, self._held_through, self._unreadable)
        end = held if where.to_seq is None else min(where.to_seq, held)
        if (limit is None or count < limit) and end > previous and _unexplained(gaps, previous + 1, end):
            raise AuditError(_hole(previous + 1, end, unreadable))

    def _events(
        self, where: EventFilter, *, limit: int | None = None, columns: Sequence[str] = ("seq", "hash", "event")
    ) -> Iterator[tuple[Any, ...]]:
        """The selected events' ``columns``, lowest seq first, fetched as they are read: the index gives
        each one's seq, hash and place (a narrow sort: no query ever sorts whole events), and every
        column comes from its line, read from the log's own file there and checked against the hash
        (`_Lines`): a few hundred bytes per event instead of a row group's worth of whole events to
        decompress, and never the index's copy of an event. The index says where to look, the log
        what is there: a row whose line does not match the filter is dropped, and one whose line is
        not there as indexed stops the query (`AuditError`)."""
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown:
            raise ValueError(f"no column {unknown[0]!r} in events")
        condition, params = where_sql(dataclasses.replace(where, args=()))
        if where.args:
            # A line too long for a reader to hold has no ``event`` in ``fed``: its arguments are
            # decided on the line itself (`_Lines.rows`), as every other filter is checked again there.
            on_args, args_params = where_sql(EventFilter(args=where.args))
            condition, params = f"{condition} AND (event IS NULL OR ({on_args}))", [*params, *args_params]
        seqs = self.cursor()  # refreshes the view, and the file list narrowed below
        lines = _Lines(self.layout)
        days = (
            None if where.since is None else _naive_utc(where.since).date(),
            None if where.until is None else _naive_utc(where.until).date(),
        )
        source = _source(self._files, (where.after_seq or 0) + 1, where.to_seq, days)
        # A total order of distinct events: rows of one seq (a damaged log's duplicates) keep their
        # place between queries, so a pager asking again from a row on gets the same rows.
        select = (
            f"SELECT seq, hash, line_offset FROM ({source}) WHERE seq IS NOT NULL AND {condition} ORDER BY seq, hash"  # noqa: S608  (known columns, bound values)
            + ("" if limit is None else f" LIMIT {int(limit)}")
        )
        # The seq of each line is checked anyway; any other filter is checked again on the line.
        again = None if dataclasses.replace(where, after_seq=None, to_seq=None) == EventFilter() else where
        try:
            for batch in _batches(self._run, seqs, select, params, _SPAN):
                yield from lines.rows(columns, batch, again)
        finally:
            seqs.close()
            lines.close()

    def copy_parquet(self, where: EventFilter, target: Path) -> None:
        """Write the selected events, every column, to the Parquet file ``target`` (one of the
        ``writable`` files), in the order the index holds them (`_ROW_ORDER`, day by day), not
        sorted by seq: a sort of whole events would not fit the memory cap. Read them ``ORDER BY seq``."""
        condition, params = where_sql(where)
        select = f"SELECT {_columns()} FROM events WHERE seq IS NOT NULL AND {condition}"  # noqa: S608  (bound values)
        options = f"FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {_ROW_GROUP}"
        cursor = self.cursor()
        try:
            self._run(cursor.execute, f"COPY ({select}) TO {_literal(str(target))} ({options})", params)
        except Exception as exc:  # DuckDB's errors, whatever their class
            raise AuditError(f"cannot write {target}: {_message(exc)}") from exc
        finally:
            cursor.close()

    def sql(self, statement: str, params: Sequence[Any] = ()) -> tuple[list[str], Iterator[tuple[Any, ...]]]:
        """Run one read-only query; its column names and its rows, fetched as they are read.

        Raises:
            AuditError: not a single SELECT, or DuckDB refused it (the message says why).
        """
        engine = load_duckdb()

        cursor = self.cursor()
        try:
            statements = cursor.extract_statements(statement)
            if len(statements) != 1 or statements[0].type != engine.StatementType.SELECT:
                found = ", ".join(s.type.name for s in statements) or "nothing"
                raise AuditError(f"audit sql runs {_READ_ONLY}; this is {found}")
            self._run(cursor.execute, statement, list(params))
        except engine.Error as exc:
            cursor.close()
            raise AuditError(_message(exc)) from exc
        except AuditError:
            cursor.close()
            raise
        names = [d[0] for d in cursor.description or []]
        return names, _drain(self._run, cursor)


class _Lines:
    """Events read from the log's files by seq and byte offset, each checked against its indexed
    hash and seq: the answer is always the log's line, never the index's copy. A line that is not
    there as indexed (its segment rewritten, or the index's row forged or damaged) is an
    `AuditError`; a segment sealed or retired since the log was listed is found by listing it again.
    Rows come in seq order, so one file is open at a time."""

    def __init__(self, layout: LogLayout) -> None:
        self._layout = layout
        self._list()
        self._path: Path | None = None
        self._fd = -1

    def _list(self) -> None:
        parts = self._layout.parts()
        self._sealed = [p for p in parts if p.kind == "sealed"]
        self._firsts = [p.first_seq for p in self._sealed]
        self._retired = [(p.first_seq, p.last_seq) for p in parts if p.kind == "tombstone"]

    def _file(self, seq: int) -> int:
        """An open descriptor of the file that holds ``seq``: its sealed segment, or the active one."""
        at = bisect.bisect_right(self._firsts, seq) - 1
        path = self._sealed[at].path if at >= 0 and seq <= self._sealed[at].last_seq else self._layout.active
        if path != self._path:
            self.close()
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._path = path
        return self._fd

    def _line(self, seq: int, offset: int, digest: str) -> bytes | None:
        """The line at ``offset`` of the file holding ``seq``, if its hash is ``digest``."""
        try:
            fd = self._file(seq)
            size = _LINE_READ
            while True:
                data = os.pread(fd, size, offset)
                end = data.find(b"\n")
                if end >= 0 or len(data) < size:
                    break
                size *= 4  # a long line (DuckDB's reader takes up to _MAX_LINE; Python any)
        except OSError:
            return None
        line = data[:end] if end >= 0 else b""
        return line if end >= 0 and line_hash(line).hex() == digest else None

    def _checked(self, seq: int, offset: int | None, digest: str) -> bytes:
        """The line of ``seq``, as the index says it is.

        Raises:
            AuditError: it is not there: the segment was retired meanwhile (ask again), or the index
                does not match the log.
        """
        line = None if offset is None else self._line(seq, offset, digest)
        if line is None and offset is not None:
            # A seal or retention since the log was listed moves a seq to another file, or none.
            self.close()
            self._list()
            if any(low <= seq <= high for low, high in self._retired):
                raise AuditError(f"event {seq} was retired (retention) while the query read it: ask again")
            line = self._line(seq, offset, digest)
        if line is None:
            raise AuditError(
                f"event {seq} is not in the log's files as the index holds it (hash {digest[:16]}…, at byte "
                f"{offset}): the index does not match the log. Run `stockade audit verify`, then index the log "
                "again (`stockade audit index`)"
            )
        return line

    def rows(
        self, columns: Sequence[str], batch: Sequence[tuple[Any, ...]], where: EventFilter | None
    ) -> Iterator[tuple[Any, ...]]:
        """``columns`` of the rows of ``batch`` (seq, hash and line_offset from the index), each from
        its line; the rows whose line ``where`` (if given) does not select are dropped.

        Raises:
            AuditError: a line is not there as indexed, is not of the row's seq, or is indexed twice.
        """
        promoted = where is not None or not set(columns) <= {"seq", "hash", "line_offset", "event"}
        previous: tuple[int, int | None] | None = None
        for seq, digest, offset in batch:
            line = self._checked(seq, offset, digest)
            if (seq, offset) == previous:
                raise AuditError(f"the index holds event {seq} twice: {_MISMATCH}")
            previous = seq, offset
            row = promote(line, offset) if promoted else None
            head = head_of(line)
            if (head[0] if head is not None else (row or promote(line) or {}).get("seq")) != seq:
                raise AuditError(f"the line the index holds as event {seq} is another event's: {_MISMATCH}")
            if row is None:
                text = line.decode(errors="replace")  # the index's copy is this text (its hash is of these bytes)
                yield tuple(seq if c == "seq" else digest if c == "hash" else offset if c == "line_offset" else text
                            for c in columns)  # fmt: skip
                continue
            if where is not None and not matches(row, where):
                # The index's columns say more than its line: a forged or damaged index. The line decides.
                _log().warning("audit_index_row_not_its_line", seq=seq)
                continue
            yield tuple(row[c] for c in columns)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._path = -1, None


_MISMATCH = (
    "the index does not match the log. Run `stockade audit verify`, then index the log again (`stockade audit index`)"
)


def _message(exc: Exception) -> str:
    """DuckDB's message without its advice on raising limits (a reader cannot)."""
    return str(exc).split("\n\nPossible solutions", 1)[0].split("\n\nLINE", 1)[0]


_Run = Callable[..., Any]  # `AuditQuery._run`: a DuckDB call made on a query thread


def _batches(
    run: _Run, cursor: duckdb.DuckDBPyConnection, sql: str, params: list[Any], size: int
) -> Iterator[list[tuple[Any, ...]]]:
    engine = load_duckdb()

    try:
        run(cursor.execute, sql, params)
        while batch := run(cursor.fetchmany, size):
            yield batch
    except engine.Error as exc:
        raise AuditError(_message(exc)) from exc


def _drain(run: _Run, cursor: duckdb.DuckDBPyConnection) -> Iterator[tuple[Any, ...]]:
    engine = load_duckdb()

    try:
        while rows := run(cursor.fetchmany, _BATCH):
            yield from rows
    except engine.Error as exc:
        raise AuditError(_message(exc)) from exc
    finally:
        cursor.close()


def _columns() -> str:
    return ", ".join(COLUMNS)


def _manifest_sha256(path: Path) -> str | None:
    """The sha256 a sealed segment's manifest (at ``path``) records, None if it is unreadable.
    Only that field is read, as plain JSON: a query matches it to an index marker and trusts
    neither (`router.audit.verify` checks manifests), and a fresh query process does not load the
    manifest model's libraries for it."""
    try:
        recorded = json.loads(path.read_bytes()).get("sha256")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or not an object
        return None
    return recorded if isinstance(recorded, str) and _SHA256.fullmatch(recorded) else None


def _manifest_of(part: Part) -> Path:
    return part.path.with_name(part.path.name[:26] + "manifest.json")


# -- python -m router.audit.index -------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m router.audit.index [--background] <audit path>``: what `spawn_indexer` starts."""
    args = list(sys.argv[1:] if argv is None else argv)
    background = "--background" in args
    args = [a for a in args if a != "--background"]
    if len(args) != 1:
        sys.stderr.write("usage: python -m router.audit.index [--background] <audit log path>\n")
        return 2
    audit_path = Path(args[0])
    if background:
        os.nice(_NICE)  # behind the router for CPU; the lock keeps it to one
        lock = _Lock(index_dir_of(audit_path))
        try:
            if not lock.take(wait=False):
                return 0  # another indexer is at work, and will look again (.pending)
        finally:
            lock.close()
    from router.logging import configure_logging  # noqa: PLC0415

    configure_logging("json", "info")
    try:
        report = index_log(audit_path)
    except (AuditError, OSError) as exc:
        _log().error("audit_index_failed", path=str(audit_path), error=str(exc))
        return 1
    _log().info("audit_indexed", path=str(audit_path), **report.as_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())

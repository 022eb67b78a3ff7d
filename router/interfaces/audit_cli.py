"""`stockade audit` commands that read the log for auditors: query, sql, report, export, index.
Registered on the CLI's ``audit`` group by `register`.

They read the JSONL log and its index (`router.audit.index`) through one DuckDB engine, loaded
only when a command runs. Output streams: rows are written as they are read (JSON lines with
``--json``). Exit codes: 0 done (a report that finds nothing and one that finds something alike),
2 bad input (the message names the option and the fix), 1 the log could not be read.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations, which name
# the CLI's option types imported inside `register`.
import csv
import json
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from router.errors import AuditError

if TYPE_CHECKING:
    from router.audit.checkpoint import SigningKey
    from router.audit.index import AuditQuery

_CHUNK = 1000  # rows per printed table: a long result prints as it is read

# A decision is on record before it takes effect (`ApprovalBook.decide`): when another decision
# came first, the loser's `approved` or `denied` event is followed by a `not_applied` one, the same
# decision (approval, approver, status, decided_at). A report credits only decisions with none.
_TOOK_EFFECT = """NOT EXISTS (
    SELECT 1 FROM events n
    WHERE n.kind = 'approval' AND n.outcome = 'not_applied' AND n.approval_id = {e}.approval_id
      AND n.approver IS NOT DISTINCT FROM {e}.approver
      AND json_extract_string(n.event, '$.result.status') = {e}.outcome
      AND json_extract_string(n.event, '$.result.decided_at')
          IS NOT DISTINCT FROM json_extract_string({e}.event, '$.result.decided_at'))"""


class ExportFormat(StrEnum):
    jsonl = "jsonl"
    ocsf = "ocsf"
    csv = "csv"
    parquet = "parquet"


def _plain(value: Any) -> Any:
    """A value of a DuckDB row as JSON can hold it."""
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z") + ("Z" if value.tzinfo is None else "")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _cell(value: Any) -> Text:
    """A table cell: the value as text, never read as markup."""
    value = _plain(value)
    if value is None:
        return Text("")
    if isinstance(value, (list, dict)):
        return Text(json.dumps(value, ensure_ascii=False))
    return Text(str(value))


def _write(text: str) -> None:
    sys.stdout.write(text)


def _arg_pairs(values: Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values or ():
        key, sep, wanted = value.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"{value!r} is not KEY=VALUE, e.g. --arg to=bob@example.com", param_hint="--arg")
        pairs.append((key, wanted))
    return tuple(pairs)


def register(audit_app: typer.Typer) -> None:  # noqa: PLR0915  (one closure per command, read top to bottom)
    """Add the auditor's read commands to ``audit_app`` (the CLI's ``audit`` group)."""
    # The CLI's shared helpers; imported here, once cli.py has defined them.
    from router.interfaces.cli_common import (  # noqa: PLC0415
        AuditPath,
        JsonFlag,
        audit_engine_missing,
        err,
        finite,
        out,
        require_audit_engine,
        verify_keys,
        visible,
    )
    from router.interfaces.cli_common import emit_json as _emit_json  # noqa: PLC0415
    from router.interfaces.cli_common import fail as _fail  # noqa: PLC0415
    from router.interfaces.cli_common import settings_of as _settings  # noqa: PLC0415
    from router.interfaces.cli_common import when as _when  # noqa: PLC0415

    Since = Annotated[
        str | None,
        typer.Option(help="Only events at or after this ISO 8601 time, with its zone (2026-11-22T10:00:00Z)."),
    ]
    Until = Annotated[str | None, typer.Option(help="Only events at or before this ISO 8601 time.")]
    # The filters `audit query` and `audit export` share (docs/audit.md, Filters): one definition each.
    Session = Annotated[str | None, typer.Option(help="Only this session id.")]
    Agent = Annotated[str | None, typer.Option(help="Only this agent.")]
    Tool = Annotated[str | None, typer.Option(help="Only this tool.")]
    Outcome = Annotated[str | None, typer.Option(help="Only this outcome (allow, deny, ok, timeout, ...).")]
    DecisionId = Annotated[str | None, typer.Option("--decision-id", help="Only this decision.")]
    Kind = Annotated[str | None, typer.Option(help="Only this kind (decision, execution, error, ...).")]
    Principal = Annotated[str | None, typer.Option(help="Only events of this principal (the human).")]
    Approver = Annotated[str | None, typer.Option(help="Only events naming this approver.")]
    Credential = Annotated[str | None, typer.Option(help="Only events naming this credential.")]
    Lease = Annotated[str | None, typer.Option(help="Only events naming this credential lease id.")]
    EgressHost = Annotated[str | None, typer.Option("--egress-host", help="Only egress to this host.")]
    Reason = Annotated[str | None, typer.Option(help="Only events with this reason or error code.")]
    Taint = Annotated[str | None, typer.Option(help="Only calls decided in a session with this taint.")]
    Arg = Annotated[
        list[str] | None,
        typer.Option(
            "--arg",
            help="Only calls whose argument KEY is VALUE (KEY=VALUE, repeatable): a string by its text, "
            "a number by its value (1e16 = 10000000000000000), other JSON as JSON (null, true).",
        ),
    ]

    def log_path(ctx: typer.Context, path: Path | None) -> Path:
        target = path
        if target is None:  # the settings only when they are asked for: a --path is enough
            settings = _settings(ctx).audit
            if settings.backend == "redis":
                raise _fail(
                    "the audit log is the Redis stream (STOCKADE_AUDIT__BACKEND=redis): query it with "
                    "GET /v1/audit/events, or pass --path to a JSONL log"
                )
            target = settings.path
        if not target.exists() and not target.with_name(target.name + ".segments").is_dir():
            raise _fail(f"no audit log at {target}; pass --path or set STOCKADE_AUDIT__PATH")
        return target

    def engine(ctx: typer.Context, path: Path | None) -> "AuditQuery":
        from router.audit.index import AuditQuery  # noqa: PLC0415  (DuckDB loads only when a command reads)

        require_audit_engine(ctx.command_path)
        target = log_path(ctx, path)
        try:
            query = AuditQuery(target)
        except (AuditError, OSError) as exc:
            raise _fail(f"cannot read the audit log at {target}: {exc}", 1) from exc
        if query.unindexed:
            err.print(
                f"note: {len(query.unindexed)} sealed segment(s) are not indexed and were read line by line; "
                "`stockade audit index` makes queries fast",
                markup=False,
            )
        return query

    def since_until(since: str | None, until: str | None) -> tuple[datetime | None, datetime | None]:
        return _when(since, "--since"), _when(until, "--until")

    def stream_table(names: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
        """Print rows as tables of `_CHUNK` rows (the header once); how many rows."""
        count = 0
        chunk: list[Sequence[Any]] = []

        def flush() -> None:
            table = Table(show_lines=False, pad_edge=False, show_header=count <= len(chunk))
            for name in names:
                table.add_column(name, overflow="fold")
            for row in chunk:
                table.add_row(*(_cell(v) for v in row))
            out.print(table)
            chunk.clear()

        for row in rows:
            chunk.append(row)
            count += 1
            if len(chunk) >= _CHUNK:
                flush()
        if chunk or count == 0:
            flush()
        return count

    def run(rows: Iterator[Any]) -> Iterator[Any]:
        """Rows of a query, with a read failure turned into exit 1 (a bad query's into exit 2)."""
        try:
            yield from rows
        except AuditError as exc:
            raise _fail(str(exc), 2 if "Binder Error" in str(exc) or "Parser Error" in str(exc) else 1) from exc

    # -- query ------------------------------------------------------------------------------

    @audit_app.command("query")
    def audit_query(
        ctx: typer.Context,
        path: AuditPath = None,
        since: Since = None,
        until: Until = None,
        session: Session = None,
        agent: Agent = None,
        tool: Tool = None,
        outcome: Outcome = None,
        decision_id: DecisionId = None,
        kind: Kind = None,
        principal: Principal = None,
        approver: Approver = None,
        credential: Credential = None,
        lease: Lease = None,
        egress_host: EgressHost = None,
        reason: Reason = None,
        taint: Taint = None,
        after_seq: Annotated[int | None, typer.Option("--after-seq", min=0, help="Only events after this seq.")] = None,
        to_seq: Annotated[int | None, typer.Option("--to-seq", min=1, help="Only events up to this seq.")] = None,
        arg: Arg = None,
        limit: Annotated[int | None, typer.Option(min=1, help="At most this many events.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="One event per line, as JSON (with its hash).")] = False,
    ) -> None:
        """List audit events matching every given filter, oldest first."""
        from router.audit.index import EventFilter, event_with_hash  # noqa: PLC0415

        if after_seq is not None and to_seq is not None and after_seq >= to_seq:
            raise _fail(f"--after-seq {after_seq} is not before --to-seq {to_seq}: no event lies between them")
        start, end = since_until(since, until)
        where = EventFilter(
            since=start, until=end, after_seq=after_seq, to_seq=to_seq, session_id=session, agent=agent, tool=tool,
            outcome=outcome, decision_id=decision_id, kind=kind, principal=principal, approver=approver,
            credential=credential, lease=lease, egress_host=egress_host, reason=reason, taint=taint,
            args=_arg_pairs(arg),
        )  # fmt: skip
        with engine(ctx, path) as query:
            if as_json:
                for _, digest, line in run(query.events(where, limit=limit)):
                    _write(event_with_hash(line, digest) + "\n")
                return
            columns = ("seq", "timestamp", "kind", "tool", "outcome", "decision_id", "reason_codes")
            rows = run(query.events(where, limit=limit, columns=columns))
            header = ["seq", "time", "kind", "tool", "outcome", "decision", "reasons"]
            stream_table(header, _table_rows(rows))

    # -- sql --------------------------------------------------------------------------------

    @audit_app.command("sql")
    def audit_sql(
        ctx: typer.Context,
        statement: Annotated[str, typer.Argument(help="One SELECT (or WITH … SELECT) over the view `events`.")],
        path: AuditPath = None,
        as_json: Annotated[bool, typer.Option("--json", help="One row per line, as a JSON object.")] = False,
        as_csv: Annotated[bool, typer.Option("--csv", help="CSV with a header row.")] = False,
    ) -> None:
        """Run a read-only SQL query over the audit log (view `events`; columns in docs/audit.md).
        With --json, NaN and infinities are null; --csv on a terminal shows control characters
        as symbols (piped, the values are written as they are)."""
        if as_json and as_csv:
            raise _fail("pass --json or --csv, not both")
        with engine(ctx, path) as query:
            try:
                names, rows = query.sql(statement)
            except AuditError as exc:
                raise _fail(f"{exc}\n(one SELECT over `events` only; see docs/audit.md)") from exc
            if as_json:
                for row in run(rows):
                    document = finite(dict(zip(names, map(_plain, row), strict=True)))
                    _write(json.dumps(document, ensure_ascii=False, allow_nan=False) + "\n")
            elif as_csv:
                # On a terminal, what the log holds (an agent's, an attacker's text) must not drive it:
                # control characters are shown as SafeConsole shows them. Piped, the data goes as it is.
                # A cell a spreadsheet would run as a formula (an agent's "=HYPERLINK(...)") is quoted
                # as the CSV export quotes it; CRLF rows, so a lone CR in a value is quoted too.
                from router.audit.export import spreadsheet_safe  # noqa: PLC0415

                shown = visible if sys.stdout.isatty() else str
                writer = csv.writer(sys.stdout, lineterminator="\r\n")
                writer.writerow([shown(name) for name in names])
                for row in run(rows):
                    values = [_csv_value(v) for v in row]
                    writer.writerow([shown(spreadsheet_safe(v)) if isinstance(v, str) else v for v in values])
            else:
                stream_table(names, run(rows))

    # -- reports ----------------------------------------------------------------------------

    report_app = typer.Typer(help="Canned reports over the audit log.", no_args_is_help=True)
    audit_app.add_typer(report_app, name="report")

    def report(
        ctx: typer.Context, path: Path | None, sql: str, params: list[Any], as_json: bool, headers: Sequence[str]
    ) -> None:
        with engine(ctx, path) as query:
            try:
                names, rows = query.sql(sql, params)
            except AuditError as exc:
                raise _fail(str(exc), 1) from exc
            if as_json:
                _emit_json([dict(zip(names, map(_plain, row), strict=True)) for row in run(rows)])
                return
            stream_table(headers or names, run(rows))

    def time_terms(since: str | None, until: str | None, column: str = "timestamp") -> tuple[str, list[Any]]:
        start, end = since_until(since, until)
        terms, params = ["true"], []
        for op, at in ((">=", start), ("<=", end)):
            if at is not None:
                terms.append(f"{column} {op} ?")
                params.append(_naive(at))
        return " AND ".join(terms), params

    @report_app.command("sessions-after-untrusted")
    def report_untrusted(
        ctx: typer.Context, path: AuditPath = None, since: Since = None, until: Until = None, as_json: JsonFlag = False
    ) -> None:
        """Calls made in a session after untrusted content tainted it, by session, oldest first."""
        terms, params = time_terms(since, until)
        sql = f"""
            SELECT session_id, agent, principal, seq, timestamp, tool, outcome, reason_codes, decision_id
            FROM (SELECT session_id, agent, principal, seq, timestamp, tool, outcome, reason_codes, decision_id,
                         min(seq) OVER (PARTITION BY session_id) AS tainted_from
                  FROM events
                  WHERE kind = 'decision' AND list_contains(taint, 'untrusted_content') AND {terms})
            ORDER BY tainted_from, seq
        """  # noqa: S608  (constant SQL, bound values)
        report(ctx, path, sql, params, as_json, ())

    @report_app.command("credentials")
    def report_credentials(
        ctx: typer.Context,
        path: AuditPath = None,
        agent: Annotated[str | None, typer.Option(help="Only credentials minted for this agent.")] = None,
        since: Since = None,
        until: Until = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Credentials minted: when, for which agent, call and tool, which lease and scopes, who
        approved the call, what the run came to, and when the lease was revoked."""
        terms, params = time_terms(since, until)
        if agent is not None:
            terms += " AND agent = ?"
            params.append(agent)
        sql = f"""
            WITH minted AS (
              SELECT seq, timestamp, agent, session_id, tool, decision_id, call_id, credential[1] AS credential,
                     lease[1] AS lease, json_extract_string(event, '$.result.scopes[*]') AS scopes,
                     TRY_CAST(json_extract_string(event, '$.result.ttl_s') AS DOUBLE) AS ttl_s
              FROM events WHERE kind = 'credential' AND outcome = 'minted' AND {terms}),
            approved AS (
              SELECT decision_id, string_agg(DISTINCT approver, ', ' ORDER BY approver) AS approver FROM events d
              WHERE kind = 'approval' AND outcome = 'approved' AND decision_id IN (SELECT decision_id FROM minted)
                AND {_TOOK_EFFECT.format(e="d")}
              GROUP BY decision_id),
            runs AS (
              SELECT call_id, string_agg(outcome, ', ' ORDER BY seq) AS run FROM events
              WHERE kind = 'execution' AND call_id IN (SELECT call_id FROM minted) GROUP BY call_id),
            revoked AS (
              SELECT lease[1] AS lease, min(timestamp) AS revoked_at FROM events
              WHERE kind = 'credential' AND outcome = 'revoked' AND decision_id IN (SELECT decision_id FROM minted)
              GROUP BY lease[1])
            SELECT m.timestamp, m.agent, m.tool, m.credential, m.scopes, m.ttl_s, m.lease, a.approver, r.run,
                   v.revoked_at, m.session_id, m.decision_id, m.seq
            FROM minted m LEFT JOIN approved a USING (decision_id) LEFT JOIN runs r USING (call_id)
                 LEFT JOIN revoked v USING (lease)
            ORDER BY m.seq
        """  # noqa: S608  (constant SQL, bound values)
        report(ctx, path, sql, params, as_json, ())

    @report_app.command("approvals")
    def report_approvals(
        ctx: typer.Context, path: AuditPath = None, since: Since = None, until: Until = None, as_json: JsonFlag = False
    ) -> None:
        """Who approved or denied which held call, and how long it waited for them: only decisions
        that took effect (one another decision beat is on record as ``not_applied``, and left out)."""
        terms, params = time_terms(since, until)
        sql = f"""
            SELECT timestamp AS decided_at, outcome, approver, tool, agent, principal, reason_codes,
                   round(TRY_CAST(json_extract_string(event, '$.result.decided_at') AS DOUBLE)
                         - TRY_CAST(json_extract_string(event, '$.result.created_at') AS DOUBLE), 3) AS waited_s,
                   json_extract_string(event, '$.result.note') AS note, approval_id, session_id, decision_id, seq
            FROM events d
            WHERE kind = 'approval' AND outcome IN ('approved', 'denied') AND {terms} AND {_TOOK_EFFECT.format(e="d")}
            ORDER BY seq
        """  # noqa: S608  (constant SQL, bound values)
        report(ctx, path, sql, params, as_json, ())

    @report_app.command("denials")
    def report_denials(
        ctx: typer.Context, path: AuditPath = None, since: Since = None, until: Until = None, as_json: JsonFlag = False
    ) -> None:
        """Calls policy denied, counted by hour, tool and reason code."""
        terms, params = time_terms(since, until)
        sql = f"""
            SELECT date_trunc('hour', timestamp) AS hour, tool, reason, count(*) AS denials
            FROM (SELECT timestamp, tool, unnest(CASE WHEN len(reason_codes) = 0 THEN [NULL] ELSE reason_codes END)
                         AS reason
                  FROM events WHERE kind = 'decision' AND outcome = 'deny' AND {terms})
            GROUP BY ALL ORDER BY hour, denials DESC, tool, reason
        """  # noqa: S608  (constant SQL, bound values)
        report(ctx, path, sql, params, as_json, ())

    # -- index ------------------------------------------------------------------------------

    @audit_app.command("index")
    def audit_index(
        ctx: typer.Context,
        path: AuditPath = None,
        follow: Annotated[bool, typer.Option("--follow", help="Keep indexing as the log grows, until Ctrl-C.")] = False,
        interval: Annotated[float, typer.Option(min=0.1, help="With --follow: seconds between looks.")] = 5.0,
        as_json: JsonFlag = False,
    ) -> None:
        """Index sealed segments into Parquet (and snapshot the active one) for fast queries;
        progress on stderr. Idempotent: only what changed is indexed."""
        from router.audit.index import follow as follow_log  # noqa: PLC0415
        from router.audit.index import index_log  # noqa: PLC0415

        require_audit_engine(ctx.command_path)
        target = log_path(ctx, path)

        def progress(message: str) -> None:
            err.print(message, markup=False)

        try:
            report_ = index_log(target, progress=progress)
        except (AuditError, OSError) as exc:
            raise _fail(f"cannot index {target}: {exc}", 1) from exc
        if as_json:
            _emit_json(report_.as_json())
        else:
            out.print(
                f"{len(report_.indexed)} segment(s) indexed ({report_.events} events), {report_.unchanged} unchanged, "
                f"{len(report_.removed)} dropped, {report_.active_events} active events snapshotted "
                f"in {report_.seconds:.1f}s",
                markup=False,
            )
        for problem in report_.problems:
            err.print(f"problem: {problem}", markup=False)
        if report_.replaced:
            err.print(f"re-indexed (their bytes changed since indexed): {', '.join(report_.replaced)}", markup=False)
        if follow:
            stop = threading.Event()
            try:
                follow_log(target, interval_s=interval, stop=stop, progress=progress)
            except KeyboardInterrupt:
                stop.set()

    # -- export -----------------------------------------------------------------------------

    @audit_app.command("export")
    def audit_export(
        ctx: typer.Context,
        output: Annotated[Path, typer.Option("--output", "-o", help="The file to write (and <FILE>.proof.json).")],
        fmt: Annotated[
            ExportFormat, typer.Option("--format", help="jsonl: the lines as written; ocsf; csv; parquet.")
        ] = (ExportFormat.jsonl),
        path: AuditPath = None,
        since: Since = None,
        until: Until = None,
        from_seq: Annotated[int | None, typer.Option("--from-seq", min=1, help="Only events from this seq on.")] = None,
        to_seq: Annotated[int | None, typer.Option("--to-seq", min=1, help="Only events up to this seq.")] = None,
        session: Session = None,
        agent: Agent = None,
        tool: Tool = None,
        outcome: Outcome = None,
        decision_id: DecisionId = None,
        kind: Kind = None,
        principal: Principal = None,
        approver: Approver = None,
        credential: Credential = None,
        lease: Lease = None,
        egress_host: EgressHost = None,
        reason: Reason = None,
        taint: Taint = None,
        arg: Arg = None,
        public_key: Annotated[
            Path | None,
            typer.Option(
                "--public-key",
                help="The log's public key (PEM), to choose the checkpoint the proofs are "
                "against: the latest it verifies. Default: the signing key's .pub.",
            ),
        ] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Export events with an inclusion proof for each against the log's latest signed
        checkpoint (<FILE>.proof.json): the latest the log's public key verifies (exit 1 if none
        does). The filters are those of `audit query` and go into the
        proof's selection, which verification holds each record to. Events the checkpoint does
        not cover yet are left out (and said so): export again after the next checkpoint to
        include them."""
        from router.audit.export import export_events  # noqa: PLC0415
        from router.audit.index import EventFilter  # noqa: PLC0415

        if from_seq is not None and to_seq is not None and from_seq > to_seq:
            raise _fail(f"--from-seq {from_seq} is after --to-seq {to_seq}: swap them")
        start, end = since_until(since, until)
        where = EventFilter(
            since=start, until=end, after_seq=None if from_seq is None else from_seq - 1, to_seq=to_seq,
            session_id=session, agent=agent, tool=tool, outcome=outcome, decision_id=decision_id, kind=kind,
            principal=principal, approver=approver, credential=credential, lease=lease, egress_host=egress_host,
            reason=reason, taint=taint, args=_arg_pairs(arg),
        )  # fmt: skip
        require_audit_engine(ctx.command_path)
        target = log_path(ctx, path)
        signer = exporters_key(ctx, target)
        keys = verify_keys(_settings(ctx), public_key) or ([signer.verify_key] if signer is not None else [])
        if not keys:  # a checkpoint in the log's file may be anyone's: only a signed one is proven against
            raise _fail("no public key was found to check the checkpoint the export is proven against: pass "
                        "--public-key FILE (the signing key's .pub, as given to auditors)")  # fmt: skip
        try:
            done = export_events(target, output, fmt=fmt.value, where=where, signer=signer, keys=keys)
        except AuditError as exc:
            raise _fail(str(exc), 1) from exc
        except OSError as exc:
            raise _fail(f"cannot write {output}: {exc.strerror or exc}") from exc
        if done.left_out:
            err.print(
                f"note: {done.left_out} matching event(s) after seq {done.checkpoint_size} are not covered by a "
                "checkpoint yet and were left out; export again after the next checkpoint",
                markup=False,
            )
        if not done.signed_selection:
            err.print(
                "note: the key the checkpoint is signed with is not readable here, so the export's selection is not "
                "signed: its recipient can check every event against the log but not that none was left out at either "
                "end",
                markup=False,
            )
        if as_json:
            _emit_json(done.as_json())
        else:
            out.print(
                f"{done.events} events (seq {done.first_seq}..{done.last_seq}) to {done.file}, proofs against the "
                f"checkpoint at size {done.checkpoint_size} in {done.proof}",
                markup=False,
            )

    def exporters_key(ctx: typer.Context, target: Path) -> "SigningKey | None":
        """The key that signed the log's checkpoints, if this process can read it (an operator
        exporting on the router's host): it signs the export's selection. Never created here (an
        auditor has none), and never another log's key (a --path log signed by some other key)."""
        from router.audit.checkpoint import SigningKey  # noqa: PLC0415
        from router.audit.layout import LogLayout  # noqa: PLC0415

        key = _settings(ctx).audit.signing_key
        if not key.is_file():
            return None
        try:
            signer = SigningKey.load_or_create(key)
            checkpoints = LogLayout(target).read_checkpoints()
        except (OSError, ValueError) as exc:
            err.print(f"note: the signing key {key} cannot be used ({exc}); the selection is not signed", markup=False)
            return None
        return signer if any(c.verify(signer.verify_key) for c in checkpoints) else None

    @audit_app.command("verify-export")
    def audit_verify_export(
        ctx: typer.Context,
        export: Annotated[Path, typer.Argument(help="The exported file (jsonl, ocsf, csv or parquet).")],
        public_key: Annotated[
            Path | None,
            typer.Option("--public-key", help="The log's public key (PEM); default: the signing key's .pub."),
        ] = None,
        proof: Annotated[
            Path | None, typer.Option("--proof", help="The proof document; default: <EXPORT>.proof.json.")
        ] = None,
        as_json: JsonFlag = False,
    ) -> None:
        """Check an export with nothing but the log's public key: the checkpoint's signature, each
        record's line proven at its seq and its other fields equal to the line's, records in order
        within the selection (every seq of a whole range, chained). Exit 0 if it holds, 1 naming
        the first bad record, 2 if a file cannot be read."""
        from router.audit.export import verify_export  # noqa: PLC0415

        keys = verify_keys(_settings(ctx), public_key)
        if not keys:
            raise _fail("no public key of the log here: pass --public-key with the one its exporter gave you")
        key = keys[0]
        if not export.is_file():
            raise _fail(f"{export}: no such export file")
        try:
            found = verify_export(export, key, proof)
        except ModuleNotFoundError as exc:  # a Parquet export is read with DuckDB, the `audit` extra
            if exc.name != "duckdb":
                raise
            raise _fail(audit_engine_missing(ctx.command_path)) from exc
        except OSError as exc:
            raise _fail(f"cannot read {exc.filename or export}: {exc.strerror or exc}") from exc
        if as_json:
            _emit_json(found.as_json())
        elif found.ok:
            signed = "signed" if found.signed_selection else "NOT signed (compare it with what you asked for)"
            out.print(
                f"OK: {found.events} records proven against the checkpoint at size {found.checkpoint_size}; "
                f"selection {json.dumps(found.selection, sort_keys=True)} {signed}",
                markup=False,
            )
        else:
            where = f"record {found.record}" if found.record is not None else "the proof"
            seq = f" (seq {found.seq})" if found.seq is not None else ""
            err.print(f"FAILED at {where}{seq}: {found.problem}", markup=False)
        if not found.ok:
            raise typer.Exit(1)


def _naive(at: datetime) -> datetime:
    """``at`` as the index stores times: UTC, without a zone."""
    return at.astimezone(UTC).replace(tzinfo=None) if at.tzinfo is not None else at


def _table_rows(rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    for seq, at, kind, tool, outcome, decision_id, reasons in rows:
        when = at.strftime("%Y-%m-%d %H:%M:%S") if isinstance(at, datetime) else ""
        yield seq, when, kind, (tool or "")[:24], outcome, (decision_id or "")[:8], ", ".join(reasons or ())


def _csv_value(value: Any) -> Any:
    value = _plain(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return value

"""`stockade policy replay`: the impact of a policy change on the decisions recorded in the
audit log, and a gate for CI.

Exit codes: 0 no change the gate stops on (or no gate); 1 the gate failed: a change in a
``--fail-on`` direction that the ``--accept`` file does not accept, no decision replayed, more
events skipped than ``--allow-skipped`` (masked inputs among them), or a decision the baseline's
own revision no longer reproduces (``unfaithful``); 2 bad input (a policy that does not load, a
log or accept file that cannot be read, a bad option), with a message naming the option and the
fix; 3 the log's hash chain is broken (an edited, removed or inserted line, or a file that is not
a stockade audit log): nothing is replayed from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from router.interfaces.cli_common import AuditPath, JsonFlag, audit_log, emit_json, err, fail, out, settings_of, when

# Replay's machinery (the engines, the audit models) only when `stockade policy replay` runs.
if TYPE_CHECKING:
    from policy import EmbeddedEngine
    from router.replay import AcceptRule, Change, ReplayReport

_ACCEPT_FORMAT = ('a JSON array of entries such as {"decision_id": "..."} or '
                  '{"tool": "send_email", "direction": "narrowed", "field": "limits"}')  # fmt: skip
_TOP = 10  # rows shown per table in the human output; --json has them all
BROKEN_CHAIN = 3
"""The exit code when the log's hash chain does not hold: distinct from a failed gate (1), which
a CI job may accept, and from bad usage (2)."""


@contextlib.contextmanager
def _engine(ctx: typer.Context, directory: Path, option: str) -> Iterator[EmbeddedEngine]:
    """The policy in ``directory`` on the production engine, closed on this thread afterwards
    (regorus objects must be dropped on the thread that made them)."""
    from policy import EmbeddedEngine, PolicyBundleError  # noqa: PLC0415

    try:
        engine = EmbeddedEngine(settings_of(ctx).policy.model_copy(update={"dir": directory}))
    except PolicyBundleError as exc:
        # A failed compile's regorus objects stay alive in the traceback's frames; drop them on
        # this thread now, not wherever the garbage collector happens to run.
        cause: BaseException | None = exc
        while cause is not None:
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__
        raise fail(f"{option} {directory}: {exc}; fix the policy or point {option} at a policy directory") from exc
    try:
        yield engine
    finally:
        asyncio.run(engine.aclose())


def _gates(values: list[str] | None) -> set[str]:
    from router.replay import GATES  # noqa: PLC0415

    gates = {part.strip() for value in values or [] for part in value.split(",") if part.strip()}
    wrong = sorted(gates - set(GATES))
    if wrong:
        raise fail(f"--fail-on {wrong[0]!r} is not a direction to gate on; use {', '.join(GATES)} (or a comma list)")
    return gates


def policy_replay(
    ctx: typer.Context,
    candidate: Annotated[Path, typer.Option("--policy", help="The candidate policy directory.")],
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline", help="The policy to compare with (default: STOCKADE_POLICY__DIR, the one in force)."
        ),
    ] = None,
    against_recorded: Annotated[
        bool,
        typer.Option("--against-recorded", help="Compare with the decisions as recorded, not with --baseline's."),
    ] = False,
    since: Annotated[str | None, typer.Option(help="Only decisions at or after this ISO 8601 time.")] = None,
    until: Annotated[str | None, typer.Option(help="Only decisions at or before this ISO 8601 time.")] = None,
    fail_on: Annotated[
        list[str] | None,
        typer.Option(
            "--fail-on",
            help="Exit 1 on a change in this direction not accepted: widened, narrowed or any "
            "(repeat, or a comma list).",
        ),
    ] = None,
    accept: Annotated[
        Path | None, typer.Option("--accept", help="Accepted changes (JSON or JSON lines), as --write-accept writes.")
    ] = None,
    write_accept: Annotated[
        Path | None, typer.Option("--write-accept", help="Write this run's changes as an accept file to review.")
    ] = None,
    allow_skipped: Annotated[
        int,
        typer.Option(
            "--allow-skipped",
            min=0,
            help="With --fail-on, let the gate pass with up to this many events that could not be replayed "
            "(masked or invalid inputs, unreadable lines); by default any fails it.",
        ),
    ] = 0,
    samples: Annotated[int, typer.Option("--samples", min=0, help="Sample decisions shown per group.")] = 3,
    path: AuditPath = None,
    as_json: JsonFlag = False,
) -> None:
    """Decide every input recorded in the audit log on the baseline and the candidate policy,
    and show what would change: outcome, reason codes and obligations, counted by direction
    (widened, narrowed, mixed, changed), tool, agent, principal and reason, with samples.
    Events whose input the log masked are skipped, never decided on the mask. With --fail-on,
    exit 1 when a change in that direction is not in the --accept file, when no decision was
    replayed, when events were skipped (beyond --allow-skipped), or when the baseline's own
    revision no longer decides a decision as recorded. Exit 3 if the log's hash chain is broken."""
    from router.audit import AuditFilter  # noqa: PLC0415
    from router.replay import (  # noqa: PLC0415
        AcceptFileError,
        BrokenChain,
        accept_entries,
        chained_documents,
        gate_failures,
        gated,
        load_accept,
        replay,
    )

    gates = _gates(fail_on)
    rules: list[AcceptRule] = []
    if accept is not None:
        try:
            rules = load_accept(accept)
        except AcceptFileError as exc:
            raise fail(f"--accept {accept}: {exc}; it must hold {_ACCEPT_FORMAT}") from exc
    where = AuditFilter(since=when(since, "--since"), until=when(until, "--until"))
    baseline_dir = baseline or settings_of(ctx).policy.dir
    log = audit_log(ctx, path)
    with _engine(ctx, candidate, "--policy") as candidate_engine, _engine(ctx, baseline_dir, "--baseline") as base:
        try:
            with _progress() as progress:
                report = replay(chained_documents(log.layout), candidate_engine, base,
                                against_recorded=against_recorded, where=where, progress=progress)  # fmt: skip
        except BrokenChain as exc:
            raise fail(f"--path {log.path}: the hash chain is broken at seq {exc.seq} (in {exc.path.name}): "
                       f"{exc.problem}; nothing was replayed from a log that was altered. `stockade audit verify "
                       f"--path {log.path}` checks it in full", BROKEN_CHAIN) from exc  # fmt: skip
        except OSError as exc:
            raise fail(f"--path {log.path}: the audit log cannot be read ({exc.strerror or exc}); "
                       "pass --path with a readable log") from exc  # fmt: skip
    stopped = gated(report, gates, rules)
    failures = gate_failures(report, allow_skipped) if gates else []
    if write_accept is not None:
        try:
            write_accept.write_text(json.dumps(accept_entries(report), indent=2, ensure_ascii=False) + "\n")
        except OSError as exc:
            raise fail(
                f"--write-accept {write_accept}: cannot be written ({exc.strerror}); pick a writable path"
            ) from exc
    gate = _Gate(gates, rules, stopped, failures, allow_skipped)
    if as_json:
        emit_json(_document(report, candidate, baseline_dir, gate, samples))
    else:
        _show(report, candidate, baseline_dir, gate, samples)
        if write_accept is not None:
            out.print(Text(f"accept file written to {write_accept}: review it, commit it, pass it with --accept"))
    raise typer.Exit(1 if stopped or failures else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class _Gate:
    """What the ``--fail-on`` gate was asked and found: the changes it stops on and the reasons it
    fails whatever the changes (`router.replay.gate_failures`)."""

    gates: set[str]
    rules: list[AcceptRule]
    stopped: list[Change]
    failures: list[tuple[str, str]]
    allow_skipped: int


@contextlib.contextmanager
def _progress() -> Iterator[Callable[[int], None] | None]:
    """A count of decisions replayed on stderr, when it is a terminal (big logs take a while)."""
    if not err.is_terminal:
        yield None
        return
    with err.status(Text("replaying…")) as status:
        yield lambda done: status.update(Text(f"replaying… {done:,} decisions"))


def _document(report: ReplayReport, candidate: Path, baseline: Path, gate: _Gate, samples: int) -> dict[str, Any]:
    from router.replay import unaccepted  # noqa: PLC0415

    stopped_ids = {change.decision_id for change in gate.stopped}
    changed = []
    for change in report.changes:
        entry = change.summary()
        entry["accepted"] = bool(gate.rules) and not unaccepted(change, gate.rules)
        entry["gated"] = change.decision_id in stopped_ids
        changed.append(entry)
    return {
        "mode": report.mode,
        "baseline": {"dir": str(baseline), "revision": report.baseline_revision},
        "candidate": {"dir": str(candidate), "revision": report.candidate_revision},
        "replayed": report.replayed,
        "skipped": sum(report.skipped.values()),
        "skipped_by": dict(report.skipped),
        "skipped_samples": [
            {"why": s.why, "decision_id": s.decision_id, "detail": s.detail} for s in report.skipped_samples
        ],
        "unfaithful": report.unfaithful,
        "unfaithful_samples": [{"decision_id": s.decision_id, "detail": s.detail} for s in report.unfaithful_samples],
        "revisions": dict(report.revisions),
        "other_revisions": report.other_revisions,
        "by_direction": report.by_direction(),
        "by_reason": report.by_reason(),
        "groups": report.groups(samples),
        "changed": changed,
        "gate": {
            "fail_on": sorted(gate.gates),
            "passed": not (gate.stopped or gate.failures),
            "accept_rules": len(gate.rules),
            "allow_skipped": gate.allow_skipped,
            "gated": len(gate.stopped),
            "gated_ids": [change.decision_id for change in gate.stopped],
            "failures": [{"code": code, "message": message} for code, message in gate.failures],
        },
    }


def _show(report: ReplayReport, candidate: Path, baseline: Path, gate: _Gate, samples: int) -> None:
    """The human report. Every value from the log or the policy goes through `Text`, so rich
    never reads ``[...]`` in it as markup."""
    from router.replay import DIRECTIONS  # noqa: PLC0415

    against = "the recorded decisions" if report.mode == "recorded" else (
        f"baseline {baseline} ({report.baseline_revision[:12]})")  # fmt: skip
    out.print(Text(f"candidate {candidate} ({report.candidate_revision[:12]}) against {against}"))
    skipped = sum(report.skipped.values())
    out.print(Text(f"{report.replayed} decisions replayed, {len(report.changes)} would change, {skipped} skipped"))
    directions = report.by_direction()
    out.print(Text("  " + " · ".join(f"{name} {directions[name]}" for name in DIRECTIONS)))
    _drift(report)
    if skipped:
        out.print(Text("skipped: " + ", ".join(f"{n} {why}" for why, n in report.skipped.most_common())))
        for sample in report.skipped_samples:
            out.print(Text(f"  {sample.why} {sample.decision_id or '-'}: {sample.detail}"))
    if report.unfaithful:
        out.print(Text(f"unfaithful: {report.unfaithful} decisions recorded under the baseline's revision are "
                       "decided otherwise by it now (their recorded inputs are not what it saw)"))  # fmt: skip
        for sample in report.unfaithful_samples:
            out.print(Text(f"  {sample.decision_id}: {sample.detail}"))
    if report.changes:
        groups = report.groups(samples)
        for dimension in ("tool", "agent", "principal"):
            out.print(_table(f"by {dimension}", groups[dimension]))
        reasons = Table(title="by the candidate's reason", title_justify="left", show_edge=False)
        reasons.add_column("reason")
        reasons.add_column("changes", justify="right")
        for code, count in list(report.by_reason().items())[:_TOP]:
            reasons.add_row(Text(code), Text(str(count)))
        out.print(reasons)
        if samples:
            out.print(Text("samples"))
            for direction, group in groups["direction"].items():
                out.print(Text(f"  {direction}"))
                for sample in group["samples"]:
                    out.print(Text(f"    {sample['timestamp'][:19]} {sample['tool']} {sample['was']}→{sample['now']}: "
                                   f"{'; '.join(sample['differs'])}  {sample['decision_id']}"))  # fmt: skip
    if gate.gates:
        _gate(report, gate)


def _drift(report: ReplayReport) -> None:
    other = report.other_revisions
    if not other:
        return
    if report.mode == "recorded":
        out.print(Text(f"{other} of {report.replayed} decisions were recorded under other revisions than the "
                       "baseline's: their changes mix that drift with the candidate's (drop --against-recorded "
                       "to compare with the baseline)"))  # fmt: skip
    else:
        out.print(Text(f"{other} of {report.replayed} decisions were recorded under other revisions than the "
                       "baseline's: both policies decided them again, so that drift is not counted"))  # fmt: skip


def _table(title: str, group: dict[str, dict[str, Any]]) -> Table:
    from router.replay import DIRECTIONS  # noqa: PLC0415

    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column(title.removeprefix("by "))
    for name in ("changes", *DIRECTIONS):
        table.add_column(name, justify="right")
    for key, row in list(group.items())[:_TOP]:
        table.add_row(Text(key), *(Text(str(row[name])) for name in ("count", *DIRECTIONS)))
    if len(group) > _TOP:
        table.add_row(Text(f"… {len(group) - _TOP} more (--json lists all)"))
    return table


def _gate(report: ReplayReport, gate: _Gate) -> None:
    from router.replay import unaccepted  # noqa: PLC0415

    named = ",".join(sorted(gate.gates))
    if not gate.stopped and not gate.failures:
        accepted = sum(1 for change in report.changes if gate.rules and not unaccepted(change, gate.rules))
        out.print(Text(f"gate --fail-on {named}: passed ({accepted} changes accepted)"))
        return
    for code, message in gate.failures:
        err.print(Text(f"gate --fail-on {named}: failed ({code}): {message}"))
    if "skipped" in dict(gate.failures):
        err.print(Text("look at the skipped samples above; to gate anyway, pass --allow-skipped N"))
    if not gate.stopped:
        return
    err.print(Text(f"gate --fail-on {named}: {len(gate.stopped)} changes not accepted, e.g.:"))
    for change in gate.stopped[:5]:
        differs = "; ".join(d.text for d in unaccepted(change, gate.rules, gate.gates))
        err.print(Text(f"  {change.decision_id} {change.tool} ({change.direction}): {differs}"))
    err.print(Text("write them with --write-accept FILE, review and commit it, and pass it with --accept FILE"))

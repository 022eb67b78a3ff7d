"""The auditor's log: appends, checkpoints, verification and queries over a realistic log.

Generates ``--events`` realistic events (default 1,000,000: 30 days, 100 agents, ~25k sessions,
50 tools; the decision / approval / credential / execution / egress / error mix of real calls)
through the real append path (`JsonlAuditLog.append`, signed checkpoints on, daily segments), then
measures, each figure beside the path it replaces, in the same run:

  - append throughput with checkpoints on against checkpoints off (both in fsync and relaxed),
    in alternating rounds (`paired`) of `ROUND_S` seconds, each of which signs two or more
    checkpoints when they are on (the output says how many);
  - full verification (hashing each line's bytes, the Merkle tree, every checkpoint) against
    today's re-serialising chain check, and an incremental verification of one day;
  - queries on the indexed Parquet (DuckDB) warm and from a fresh process (the library alone, and
    the `stockade audit query` command) against a full scan of the JSONL: one session, one
    decision's trail, a per-agent daily count, who approved the calls that used a credential; the
    query process's peak RSS;
  - the router's append rate while queries run in another process, against without (the
    querying process paused), in alternating rounds.

Full scans of the old path take tens of seconds per question on 1M events; they are measured on
``--baseline-events`` (default 100,000) and scaled linearly, which the output says.

Usage: .venv/bin/python bench/audit.py [--events N] [--baseline-events N] [--keep DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from router.audit import AuditEvent, AuditFilter
from router.audit.chain import line_hash
from router.audit.checkpoint import SigningKey, VerifyKey
from router.audit.jsonl import JsonlAuditLog, LogOptions
from router.audit.layout import LogLayout, lines
from router.audit.verify import verify_log
from router.logging import configure_logging

_K = TypeVar("_K")

DAYS = 30
AGENTS = [f"agent-{i:03d}" for i in range(100)]
PRINCIPALS = [f"user{i:02d}@example.com" for i in range(40)]
TOOLS = [f"tool_{i:02d}" for i in range(50)]
APPROVERS = ["alice@example.com", "bob@example.com", "carol@example.com"]
CREDENTIALS = ["github", "stripe", "gmail", "s3-reports", "jira"]
HOSTS = ["api.github.com", "api.stripe.com", "gmail.googleapis.com", "s3.amazonaws.com", "example.atlassian.net"]


class Generator:
    """Realistic calls: each a decision, sometimes an approval asked and decided, a credential
    minted, egress requests, an execution, now and then an error; ~13 events per 10 calls."""

    def __init__(self, events: int, seed: int = 7, days: float = DAYS) -> None:
        self.rng = random.Random(seed)  # noqa: S311  (reproducible test data, not secrets)
        self.events = events
        self.days = days
        self.start = datetime(2026, 10, 1, tzinfo=UTC) if days == DAYS else datetime.now(UTC)
        self.sessions = [(f"s-{uuid.UUID(int=self.rng.getrandbits(128))}", self.rng.choice(AGENTS),
                          self.rng.choice(PRINCIPALS)) for _ in range(max(events // 40, 10))]  # fmt: skip
        self.revision = hashlib.sha256(b"policy").hexdigest()

    def stream(self) -> Any:
        made = 0
        step = self.days * 86400 / self.events
        while made < self.events:
            at = self.start + timedelta(seconds=made * step)
            for event in self.call(at):
                if made >= self.events:
                    return
                made += 1
                yield event

    def call(self, at: datetime) -> list[AuditEvent]:
        rng = self.rng
        session, agent, principal = rng.choice(self.sessions)
        tool = rng.choice(TOOLS)
        decision_id, call_id = str(uuid.UUID(int=rng.getrandbits(128))), f"c-{rng.getrandbits(48):012x}"
        stamp = at.isoformat(timespec="microseconds").replace("+00:00", "Z")
        roll = rng.random()
        outcome = "allow" if roll < 0.78 else "deny" if roll < 0.93 else "require_approval"
        taint = ["untrusted_content"] if rng.random() < 0.3 else []
        codes = ["capability.combination_denied", "destination.unverified", "rate.exceeded", "approval.high_risk"]
        reasons = [] if outcome == "allow" else [{"code": rng.choice(codes), "message": "policy said so"}]
        common = {"decision_id": decision_id, "timestamp": stamp, "session_id": session, "call_id": call_id,
                  "tool": tool, "agent": agent, "labels": {"instance": "bench-1", "version": "0.1.0"},
                  "bundles": {"policies": {"revision": self.revision}}}  # fmt: skip
        credential = rng.choice(CREDENTIALS) if rng.random() < 0.4 else None
        events = [AuditEvent.model_validate({**common, "kind": "decision", "outcome": outcome,
            "input": {"subject": {"agent": agent, "principal": principal}, "tool": {"name": tool, "risk": "medium",
                      "capabilities": ["sends_external"]}, "session": {"id": session, "taint": taint,
                      "call_count": rng.randint(0, 40)},
                      "args": {"to": f"bob{rng.randint(0, 999)}@example.com", "subject": "weekly report",
                               "body": "x" * rng.randint(200, 700)}},
            "result": {"outcome": outcome, "reasons": reasons, "obligations": {"egress": HOSTS[:2],
                       "credentials": [{"name": credential, "scopes": ["read"]}] if credential else []}},
            "metrics": {"timer_decide_ns": rng.randint(200_000, 900_000)}})]  # fmt: skip
        if outcome == "require_approval":
            approval = f"a-{rng.getrandbits(64):016x}"
            granted = rng.random() < 0.8
            events.append(AuditEvent.model_validate({**common, "kind": "approval", "outcome": "requested",
                                                     "result": {"approval_id": approval}}))  # fmt: skip
            events.append(AuditEvent.model_validate({**common, "kind": "approval",
                "outcome": "granted" if granted else "denied",
                "result": {"approval_id": approval, "approver": rng.choice(APPROVERS), "note": "ok"}}))  # fmt: skip
            if not granted:
                return events
        elif outcome == "deny":
            return events
        if credential:
            events.append(AuditEvent.model_validate({**common, "kind": "credential", "outcome": "minted",
                "result": {"name": credential, "lease": f"l-{rng.getrandbits(64):016x}", "scopes": ["read"],
                           "ttl_s": 300}}))  # fmt: skip
            host = HOSTS[CREDENTIALS.index(credential)]
            events.append(AuditEvent.model_validate({**common, "kind": "egress", "outcome": "allowed",
                "result": {"host": host, "method": "GET", "status": 200, "bytes": rng.randint(99, 9000)}}))  # fmt: skip
        failed = rng.random() < 0.03
        events.append(AuditEvent.model_validate({**common, "kind": "error" if failed else "execution",
            "outcome": "sandbox_error" if failed else "ok",
            "result": {"exit_code": 1 if failed else 0, "duration_ms": rng.randint(30, 900),
                       "output_sha256": hashlib.sha256(call_id.encode()).hexdigest(), "tier": "bwrap"}}))  # fmt: skip
        return events


def options(key: SigningKey | None, **extra: Any) -> LogOptions:
    return LogOptions(signer=key, checkpoint_interval_s=1.0, checkpoint_every=10_000, segment_max_bytes=256 << 20,
                      rotate_daily=True, **extra)  # fmt: skip


async def generate(path: Path, key: SigningKey, events: int) -> dict[str, float]:
    """Append ``events`` through the real path (relaxed: the figure of interest is the log)."""
    log = JsonlAuditLog(path, durability="relaxed", options=options(key))
    started = time.perf_counter()
    shown = 0
    for n, event in enumerate(Generator(events).stream(), start=1):
        await log.append(event)
        if n - shown >= 100_000:
            shown = n
            rate = n / (time.perf_counter() - started)
            sys.stderr.write(f"  generated {n:,} events ({rate:,.0f}/s)\n")
    await log.aclose()
    elapsed = time.perf_counter() - started
    return {"events": events, "seconds": elapsed, "bytes": sum(p.path.stat().st_size for p in LogLayout(path).parts())}


# Seconds each append round lasts. A round of a fixed count (2,000 events: 0.2-0.6 s here) ended
# before the first timed checkpoint (every 1 s), so "checkpoints on" signed none inside the timed
# span and the comparison measured nothing but noise; a round this long signs two or more.
ROUND_S = 2.5
_RATE_EVENTS: list[AuditEvent] = []  # appended in every round, each to a new log (append copies)
SIGNED: dict[str, list[int]] = {}  # checkpoints signed inside each timed round with a signer, by durability


async def append_rate(directory: Path, key: SigningKey | None, durability: Literal["fsync", "relaxed"]) -> float:
    """Events per second appended one after another for `ROUND_S`, as a router's calls do."""
    if not _RATE_EVENTS:
        _RATE_EVENTS.extend(Generator(20_000, seed=11, days=0.01).stream())  # one day: no rotation in the way
    path = directory / f"rate-{uuid.uuid4().hex[:6]}" / "audit.jsonl"
    log = JsonlAuditLog(path, durability=durability, options=options(key))
    n = 0
    started = time.perf_counter()
    deadline = started + ROUND_S
    for event in itertools.cycle(_RATE_EVENTS):
        await log.append(event)
        n += 1
        if n % 64 == 0 and time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - started
    if key is not None:  # counted before closing, which signs one more
        SIGNED.setdefault(durability, []).append(len(log.layout.read_checkpoints()))
    await log.aclose()
    shutil.rmtree(path.parent)
    return n / elapsed


ROUNDS = 10


def paired(rate: Callable[[_K], float], a: _K, b: _K) -> tuple[float, float, float]:
    """``rate(a)`` and ``rate(b)`` in `ROUNDS` rounds of one each, in alternating order: their
    medians and the median of the per-round change from a to b, in percent. A round pairs the two
    under the same machine state; one run of each would measure the disk's and the scheduler's
    swings (tens of percent here from one run to the next) more than the difference."""
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(ROUNDS):
        for which in (a, b) if i % 2 == 0 else (b, a):
            (ours if which is a else theirs).append(rate(which))
    change = statistics.median(t / o - 1 for o, t in zip(ours, theirs, strict=True)) * 100
    return statistics.median(ours), statistics.median(theirs), change


def old_verify(path: Path, limit: int) -> float:
    """Today's check: parse every line, re-serialise it canonically without its hash, sha256 it."""
    started = time.perf_counter()
    count = 0
    for part in LogLayout(path).parts():
        for _, line in lines(part.path):
            document = json.loads(line)
            body = {k: v for k, v in document.items() if k != "hash"}
            hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())
            count += 1
            if count >= limit:
                return time.perf_counter() - started
    return time.perf_counter() - started


def old_scan(path: Path, where: AuditFilter, limit: int) -> float:
    """Today's query path: parse every line and filter, over the first ``limit`` events."""
    from router.audit.base import matches  # noqa: PLC0415

    started = time.perf_counter()
    count = 0
    for part in LogLayout(path).parts():
        for _, line in lines(part.path):
            document = json.loads(line)
            matches(document, where)
            count += 1
            if count >= limit:
                return time.perf_counter() - started
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--baseline-events", type=int, default=100_000)
    parser.add_argument("--keep", type=Path, default=None, help="reuse (or keep) the generated log in this directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging("console", "warning")
    work = args.keep or Path(tempfile.mkdtemp(prefix="stockade-bench-audit-"))
    path = work / "audit.jsonl"
    key = SigningKey.load_or_create(work / "keys" / "signing.key")
    rows: dict[str, dict[str, float]] = {}
    notes: dict[str, Any] = {"events": args.events, "cores": os.cpu_count()}
    try:
        if not path.exists():
            sys.stderr.write(f"generating {args.events:,} events in {work}\n")
            made = asyncio.run(generate(path, key, args.events))
            notes["generated"] = f"{made['bytes'] / 1e9:.2f} GB in {made['seconds']:.0f} s"
        scale = args.events / args.baseline_events

        sys.stderr.write("append throughput\n")
        for durability in ("fsync", "relaxed"):

            def rate(signer: SigningKey | None, durability: Literal["fsync", "relaxed"] = durability) -> float:
                return asyncio.run(append_rate(work, signer, durability))

            off, on, change = paired(rate, None, key)
            signed = SIGNED[durability]
            notes[f"append/s {durability}: checkpoints off -> on (median of {ROUNDS} paired rounds of {ROUND_S} s)"] = (
                f"{off:,.0f} -> {on:,.0f} ({change:+.1f}%); checkpoints signed in each round on: "
                f"{min(signed)}-{max(signed)}"
            )

        sys.stderr.write("verification\n")
        verify_key = VerifyKey.from_pem(key.public_pem())
        started = time.perf_counter()
        full = verify_log(LogLayout(path), keys=[verify_key], workers=2)
        full_s = time.perf_counter() - started
        assert full.ok, full.problem
        sealed = [p for p in LogLayout(path).parts() if p.kind == "sealed"]
        started = time.perf_counter()
        # One day: the active segment (the last day), the tree resumed from the day before's manifest.
        day = verify_log(LogLayout(path), keys=[verify_key], from_seq=sealed[-1].last_seq + 1)
        day_s = time.perf_counter() - started
        assert day.ok, day.problem
        old_s = old_verify(path, args.baseline_events) * scale
        rows["verify: full (bytes, Merkle, checkpoints)"] = summarize([full_s])
        rows["verify: today's re-serialising chain (scaled)"] = summarize([old_s])
        rows["verify: incremental, one day"] = summarize([day_s])
        notes["verified"] = f"{full.events:,} events, {full.checkpoints} checkpoints"

        queries(work, path, args, rows, notes, scale)
        exports(work, path, rows, notes)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    report("Audit log (bench/audit.py)", rows, notes, args.json)


def exports(work: Path, path: Path, rows: dict[str, dict[str, float]], notes: dict[str, Any]) -> None:
    """An auditor's export of one segment's events (about a day), each with its inclusion proof,
    against the path that made each proof from the log's leaves (one proof timed, times the events)."""
    from router.audit.export import export_events  # noqa: PLC0415  (the audit extra)
    from router.audit.index import EventFilter  # noqa: PLC0415
    from router.audit.merkle import inclusion_proof  # noqa: PLC0415

    sys.stderr.write("export\n")
    sealed = [p for p in LogLayout(path).parts() if p.kind == "sealed"][-1]
    where = EventFilter(after_seq=sealed.first_seq - 1, to_seq=sealed.last_seq)
    target = work / "export.jsonl"
    started = time.perf_counter()
    done = export_events(path, target, fmt="jsonl", where=where)
    rows["export: one segment's events with proofs (JSONL)"] = summarize([time.perf_counter() - started])
    size_mb = target.stat().st_size / 1e6
    notes["export"] = f"{done.events:,} events, {size_mb:.0f} MB, proved in a tree of {done.checkpoint_size:,}"
    target.unlink()
    done.proof.unlink()
    leaves = [line_hash(line) for part in LogLayout(path).parts() if part.kind != "tombstone"
              for _, line in lines(part.path)][: done.checkpoint_size]  # fmt: skip
    started = time.perf_counter()
    inclusion_proof(leaves, sealed.first_seq - 1, len(leaves))
    one_proof = time.perf_counter() - started
    rows["export: a proof per event from the leaves (scaled)"] = summarize([one_proof * done.events])


QUESTIONS = {
    "point: one session": ("SELECT seq, kind, outcome, tool FROM events WHERE session_id = ? ORDER BY seq", "session"),
    "point: one decision's trail": ("SELECT seq, kind, outcome FROM events WHERE decision_id = ? ORDER BY seq",
                                    "decision"),
    "aggregate: an agent's calls per day": ("SELECT day, count(*) FROM events WHERE agent = ? AND kind = 'decision' "
                                             "GROUP BY day ORDER BY day", "agent"),
    "join: approvers of calls using a credential": (
        "SELECT a.approver, count(*) FROM events c JOIN events a ON a.decision_id = c.decision_id "
        "WHERE c.kind = 'credential' AND list_contains(c.credential, ?) AND a.kind = 'approval' "
        "AND a.approver IS NOT NULL GROUP BY a.approver ORDER BY 2 DESC", "credential"),
}  # fmt: skip

# A question asked by a fresh process: its wall time from exec, and its peak RSS. The peak is the
# process's own (VmHWM): getrusage's ru_maxrss in a child also counts the RSS its parent had when it
# started it (Linux records the replaced memory's peak at exec), here the whole benchmark's.
_FRESH = """
import sys, time
started = time.perf_counter()
from pathlib import Path
from router.audit.index import AuditQuery
with AuditQuery(Path(sys.argv[1])) as query:
    names, rows = query.sql(sys.argv[2], [sys.argv[3]])
    list(rows)
with open("/proc/self/status") as status:
    peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(time.perf_counter() - started, peak_kb / 1024)
"""
# What an auditor types, `stockade audit query ...`, with its peak RSS written to stderr at exit.
_CLI = """
import atexit, sys
def peak():
    with open("/proc/self/status") as status:
        sys.stderr.write("peak " + next(line.split()[1] for line in status if line.startswith("VmHWM:")) + "\\n")
atexit.register(peak)
from router.interfaces.cli import app
sys.argv = ["stockade", *sys.argv[1:]]
app()
"""


def targets(path: Path) -> dict[str, str]:
    """A session, a decision, an agent and a credential that the log holds."""
    for _, line in lines(LogLayout(path).parts()[0].path):
        document = json.loads(line)
        if document.get("kind") == "credential":
            return {"session": document["session_id"], "decision": document["decision_id"],
                    "agent": document["agent"], "credential": document["result"]["name"]}  # fmt: skip
    raise SystemExit("no credential event in the log's first segment")


def cli_query(path: Path, session: str, rows: dict[str, dict[str, float]], notes: dict[str, Any]) -> None:
    """What an auditor types: the CLI, whose own start (typer, the settings, logging) comes on top,
    asked for one session's whole events."""
    cli, cli_rss, events = [], 0.0, 0
    for _ in range(3):
        t = time.perf_counter()
        said = subprocess.run([sys.executable, "-c", _CLI, "audit", "query", "--path", str(path), "--session", session,
                               "--json"], capture_output=True, text=True, check=True)  # fmt: skip
        cli.append(time.perf_counter() - t)
        cli_rss = max(cli_rss, int(said.stderr.rsplit("peak ", 1)[1].split()[0]) / 1024)
        events = said.stdout.count("\n")
    rows["point: one session, `stockade audit query`, fresh process"] = summarize(cli)
    notes["point: one session, `stockade audit query --json` (whole events): peak RSS"] = (
        f"{cli_rss:.0f} MB, {events} events"
    )


def queries(work: Path, path: Path, args: argparse.Namespace, rows: dict[str, dict[str, float]],
            notes: dict[str, Any], scale: float) -> None:  # fmt: skip
    """The indexed engine against today's full scan, and appends while queries run."""
    from router.audit.index import AuditQuery, index_log, snapshot_active  # noqa: PLC0415  (the audit extra)

    sys.stderr.write("indexing\n")
    started = time.perf_counter()
    indexed = index_log(path)
    notes["indexed"] = f"{len(indexed.indexed)} segments in {time.perf_counter() - started:.1f} s"
    # What `stockade audit index --follow` beside the router keeps doing: the active segment's
    # lines in the index too, so a fresh reader parses none of them.
    started = time.perf_counter()
    snapshotted = snapshot_active(LogLayout(path))
    notes["active segment snapshot (audit index --follow)"] = (
        f"{snapshotted:,} events in {time.perf_counter() - started:.1f} s"
    )
    notes["parquet"] = f"{sum(f.stat().st_size for f in (work / 'audit.jsonl.index').rglob('*.parquet')) / 1e6:.0f} MB"
    wanted = targets(path)
    sys.stderr.write("queries\n")
    with AuditQuery(path) as query:
        for name, (sql, key) in QUESTIONS.items():
            samples = []
            for _ in range(20):
                t = time.perf_counter()
                list(query.sql(sql, [wanted[key]])[1])
                samples.append(time.perf_counter() - t)
            rows[f"{name}, warm"] = summarize(samples[1:])
    for name, (sql, key) in list(QUESTIONS.items())[:2]:
        fresh, rss = [], 0.0
        for _ in range(3):
            t = time.perf_counter()
            said = subprocess.run([sys.executable, "-c", _FRESH, str(path), sql, wanted[key]], capture_output=True,
                                  text=True, check=True)  # fmt: skip
            fresh.append(time.perf_counter() - t)
            rss = max(rss, float(said.stdout.split()[1]))
        rows[f"{name}, fresh process"] = summarize(fresh)
        notes[f"{name}: fresh process (interpreter start included) peak RSS"] = f"{rss:.0f} MB"
    cli_query(path, wanted["session"], rows, notes)
    where = AuditFilter(session_id=wanted["session"])
    rows["today's path: a full scan per question (scaled)"] = summarize([old_scan(path, where, args.baseline_events)
                                                                          * scale])  # fmt: skip

    sys.stderr.write("appends while queries run\n")
    stop = work / "stop-queries"
    asker = subprocess.Popen([sys.executable, "-c", _ASKER, str(path), str(stop), wanted["agent"]])

    def appends(asking: bool) -> float:
        # The asker is paused (SIGSTOP) for the quiet rounds and resumed for the busy ones.
        asker.send_signal(signal.SIGCONT if asking else signal.SIGSTOP)
        time.sleep(0.2)
        return asyncio.run(append_rate(work, None, "fsync"))

    try:
        time.sleep(1.0)
        quiet, busy, change = paired(appends, False, True)
    finally:
        asker.send_signal(signal.SIGCONT)
        stop.touch()
        asker.wait(timeout=60)
    label = f"appends/s (fsync) without -> with queries running in another process (median of {ROUNDS} paired rounds)"
    notes[label] = f"{quiet:,.0f} -> {busy:,.0f} ({change:+.1f}%)"


# Another process asking the aggregate over and over until told to stop (an auditor's dashboard).
_ASKER = """
import sys
from pathlib import Path
from router.audit.index import AuditQuery
stop = Path(sys.argv[2])
with AuditQuery(Path(sys.argv[1])) as query:
    while not stop.exists():
        list(query.sql("SELECT day, count(*) FROM events WHERE agent = ? GROUP BY day", [sys.argv[3]])[1])
"""


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

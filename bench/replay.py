"""Replay throughput: how fast `stockade policy replay` gets through a recorded audit log.

Records ``--decisions`` decisions (default 2,000) through the real path (`ControlPlane.decide`:
argument validation, policy, the decision's audit append) for a realistic mix of agents,
principals, sessions and tools (low and high risk, code execution, egress and credentials), on
a copy of the shipped policy; then measures, in the same run:

  - one engine deciding the same inputs once each (`EmbeddedEngine.evaluate`, the production
    path, inputs already parsed): the floor any replay pays per decision;
  - the replay the CLI runs (`router.replay.replay`): reading and validating every event, deciding
    it on the baseline and on a candidate (a lower timeout, high risk auto-allowed), comparing
    outcome, reasons and obligations;
  - the ``--against-recorded`` replay, which decides on the candidate only.

Usage: .venv/bin/python bench/replay.py [--decisions N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from policy import EmbeddedEngine, PolicyInput, PolicySettings
from router import ControlPlane, Settings
from router.audit import JsonlAuditLog
from router.logging import configure_logging
from router.replay import replay
from router.settings import AuditSettings

REPO = Path(__file__).resolve().parent.parent
AGENTS = [f"agent-{i:02d}" for i in range(20)]
PRINCIPALS = [f"user{i:02d}@example.com" for i in range(10)]
SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}, "amount": {"type": "number"}}}
TOOLS: list[dict[str, Any]] = [
    {"name": "search_docs", "risk": "low", "capabilities": ["reads_private"]},
    {"name": "get_webpage", "risk": "low", "capabilities": ["reads_untrusted"]},
    {"name": "update_ticket", "risk": "medium", "capabilities": ["mutates_state"]},
    {"name": "refund", "risk": "high", "capabilities": ["financial", "mutates_state"]},
    {"name": "deploy", "risk": "high", "capabilities": ["mutates_state"]},
    {"name": "run_python", "risk": "medium", "capabilities": ["executes_code"]},
    {"name": "fetch_repo", "risk": "low", "capabilities": ["reads_private"],
     "sandbox": {"egress": [{"host": "api.github.com", "port": 443, "methods": ["GET"]}]},
     "credentials": [{"name": "github", "scopes": ["contents:read"]}]},
]  # fmt: skip


def edit(root: Path, **changes: Any) -> None:
    """Set entries of the catalog in ``root``'s data.json."""
    data_file = root / "stockade" / "data.json"
    data = json.loads(data_file.read_text())
    data["catalog"].update(changes)
    data_file.write_text(json.dumps(data))


async def record(audit: Path, policies: Path, decisions: int) -> None:
    """``decisions`` calls decided through a control plane, ~20 per session."""
    rng = random.Random(7)  # noqa: S311  (reproducible test data, not secrets)
    settings = Settings(audit=AuditSettings(path=audit, durability="relaxed"),
                        policy=PolicySettings(dir=policies, watch_interval_s=0))  # fmt: skip
    async with ControlPlane.from_settings(settings) as plane:
        for tool in TOOLS:
            await plane.register({"description": tool["name"], "input_schema": SCHEMA,
                                  "executor": {"kind": "external"}, **tool})  # fmt: skip
        session = ""
        for i in range(decisions):
            if i % 20 == 0:
                session = await plane.open_session(rng.choice(AGENTS), rng.choice(PRINCIPALS))
            args = {"query": f"q{i}"} if rng.random() < 0.7 else {"amount": rng.randint(1, 5000)}
            await plane.decide(session, rng.choice(TOOLS)["name"], args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    configure_logging("console", "error")
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:  # on the project's disk, not a tmpfs
        root = Path(tmp)
        baseline_dir, candidate_dir = root / "baseline", root / "candidate"
        shutil.copytree(REPO / "policies", baseline_dir)
        catalog = {"egress_allowlist": ["api.github.com"],
                   "credentials": {"github": {"scopes": ["contents:read"], "ttl_s": 60}}}  # fmt: skip
        edit(baseline_dir, **catalog)
        shutil.copytree(baseline_dir, candidate_dir)
        limits = json.loads((baseline_dir / "stockade" / "data.json").read_text())["catalog"]["limits"]
        edit(candidate_dir, limits={**limits, "max": {**limits["max"], "timeout_s": 5}},
             auto_allow_risks=["low", "medium", "high"], approval_risks=["critical"])  # fmt: skip
        audit = root / "audit.jsonl"
        started = time.perf_counter()
        asyncio.run(record(audit, baseline_dir, options.decisions))
        recording_s = time.perf_counter() - started

        log = JsonlAuditLog(audit)
        baseline = EmbeddedEngine(PolicySettings(dir=baseline_dir))
        candidate = EmbeddedEngine(PolicySettings(dir=candidate_dir))
        inputs = [PolicyInput.model_validate(d["input"]) for d in log.documents()
                  if d is not None and d.get("kind") == "decision"]  # fmt: skip
        for policy_input in inputs[:100]:  # warm both engines' VMs and interpreters
            baseline.evaluate(policy_input)
            candidate.evaluate(policy_input)

        rows: dict[str, dict[str, float]] = {}

        def timed(name: str, run: Any) -> Any:
            began = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - began
            rows[name] = {"decisions": len(inputs), "seconds": elapsed, "per_s": len(inputs) / elapsed,
                          "us_per_decision": elapsed / len(inputs) * 1e6}  # fmt: skip
            return result

        timed("one engine, inputs decided once (floor)", lambda: [baseline.evaluate(i) for i in inputs])
        report = timed("replay: baseline + candidate + compare", lambda: replay(log.documents(), candidate, baseline))
        timed("replay --against-recorded: candidate only",
              lambda: replay(log.documents(), candidate, baseline, against_recorded=True))  # fmt: skip
        asyncio.run(baseline.aclose())
        asyncio.run(candidate.aclose())

    notes = {
        "decisions recorded": len(inputs),
        "recording through ControlPlane.decide (relaxed fsync), s": round(recording_s, 2),
        "changes found": len(report.changes),
        "by direction": report.by_direction(),
    }
    if options.json:
        sys.stdout.write(json.dumps({"benchmark": "policy replay", "results": rows, **notes}, indent=2) + "\n")
        return
    sys.stdout.write("\npolicy replay\n")
    for key, value in notes.items():
        sys.stdout.write(f"  {key}: {value}\n")
    sys.stdout.write(f"  {'':45} {'decisions':>10} {'seconds':>9} {'per s':>9} {'µs each':>9}\n")
    for name, row in rows.items():
        sys.stdout.write(f"  {name:45} {row['decisions']:>10.0f} {row['seconds']:>9.3f} {row['per_s']:>9.0f} "
                         f"{row['us_per_decision']:>9.1f}\n")  # fmt: skip


if __name__ == "__main__":
    main()

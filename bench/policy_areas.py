"""Decision latency of the shipped policy per rule area, next to the whole policy.

Measures, in one run (`stockade policy bench` prints the same):
  - the whole decision on the production path (`EmbeddedEngine.evaluate`: the compiled RVM,
    confirmed on the interpreter unless it denies), over representative calls (an allowed read,
    a payment held for a human, an untrusted destination, a forbidden capability set, a busy
    agent);
  - the baseline: a one-rule policy decided on the same path, what the engine costs before any
    rule does;
  - each rule area (one .rego file): an RVM program with that file's rules as entry points, the
    other files' contributions to the same partial sets cut out.

Usage: .venv/bin/python bench/policy_areas.py [--iterations N] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from policy.tooling import bench
from router.logging import configure_logging

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300, help="rounds over the representative inputs")
    parser.add_argument("--dir", type=Path, default=REPO / "policies", help="the policy directory")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    args = parser.parse_args()
    configure_logging("console", "warning")  # the figures alone on stdout (--json)
    report = bench(args.dir, iterations=args.iterations)
    if args.json:
        sys.stdout.write(json.dumps({"benchmark": "policy decision latency", **report.as_json()}, indent=2) + "\n")
        return
    write = sys.stdout.write
    write("\npolicy decision latency (µs)\n")
    write(f"  inputs: {', '.join(f'{name} ({report.outcomes[name]})' for name in report.inputs)}\n")
    write(f"  {'':44} {'n':>7} {'p50 µs':>10} {'p99 µs':>10} {'mean µs':>10}\n")
    rows = [("", report.decision), ("", report.baseline)] + [("  ", area) for area in report.areas]
    for indent, row in rows:
        name = f"{indent}{row.name}"
        if row.error is not None:
            write(f"  {name:44} not measured: {row.error}\n")
        else:
            write(f"  {name:44} {row.n:>7} {row.p50_us:>10.1f} {row.p99_us:>10.1f} {row.mean_us:>10.1f}\n")
    overhead = report.decision.p50_us - report.baseline.p50_us
    write(f"  the policy's rules add {overhead:.1f} µs at p50 over the one-rule baseline\n")


if __name__ == "__main__":
    main()

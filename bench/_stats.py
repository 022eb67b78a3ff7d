"""Shared helpers for the benchmarks: percentiles, a uniform report line, a free loopback port."""

from __future__ import annotations

import json
import socket
import statistics
import sys
from typing import Any


def summarize(samples_s: list[float]) -> dict[str, float]:
    """p50/p99/mean in milliseconds and throughput per second for a list of durations in seconds."""
    ordered = sorted(samples_s)
    n = len(ordered)
    return {
        "n": n,
        "p50_ms": ordered[n // 2] * 1000,
        "p99_ms": ordered[min(n - 1, int(n * 0.99))] * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
        "per_s": n / sum(ordered) if sum(ordered) else 0.0,
    }


def report(title: str, rows: dict[str, dict[str, float]], notes: dict[str, Any], as_json: bool) -> None:
    """Print the figures as a table, or as one JSON document with --json."""
    if as_json:
        sys.stdout.write(json.dumps({"benchmark": title, "results": rows, **notes}, indent=2) + "\n")
        return
    sys.stdout.write(f"\n{title}\n")
    for key, value in notes.items():
        sys.stdout.write(f"  {key}: {value}\n")
    sys.stdout.write(f"  {'':52} {'n':>6} {'p50 ms':>10} {'p99 ms':>10} {'mean ms':>10} {'per s':>10}\n")
    for name, r in rows.items():
        sys.stdout.write(
            f"  {name:52} {r['n']:>6.0f} {r['p50_ms']:>10.4f} {r['p99_ms']:>10.4f} {r['mean_ms']:>10.4f} "
            f"{r['per_s']:>10.0f}\n"
        )


def free_port() -> int:
    """A loopback port nothing listens on (now), for a server process the benchmark starts."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port

"""Full call() latency of a trivial python tool in bubblewrap, against plain subprocess.run.

Both sides run the same program: the same interpreter (/usr/bin/python3 -I -S), the same
harness and the same JSON on stdin. The stockade side adds everything a real call does:
argument validation, the policy decision, two fsynced audit appends, the bwrap sandbox
(namespaces, rlimits, per-sandbox uid) and result parsing. Target: within 1.6x.

Usage: .venv/bin/python bench/call.py [--iterations N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from router import ControlPlane, Settings
from router.logging import configure_logging
from router.settings import AuditSettings
from runner import ResourceLimits, python_job

REPO = Path(__file__).resolve().parent.parent
SOURCE = "def main(a, b):\n    return a + b\n"
ARGS = {"a": 2, "b": 3}
TOOL = {
    "name": "add", "description": "add two integers", "risk": "low",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"]},
    "executor": {"kind": "python", "source": SOURCE},
}  # fmt: skip


def measure_plain(n: int, interpreter: str) -> list[float]:
    job = python_job(SOURCE, "main", ARGS, interpreter=interpreter, limits=ResourceLimits())
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        done = subprocess.run(list(job.argv), input=job.stdin, capture_output=True, check=True, env={})
        samples.append(time.perf_counter() - t)
        assert done.stdout == b'{"result": 5}'
    return samples


async def measure_call(n: int, durability: Literal["fsync", "relaxed"]) -> tuple[list[float], str]:
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:  # on the project's disk, not a tmpfs
        settings = Settings(audit=AuditSettings(path=Path(tmp) / "audit.jsonl", durability=durability))
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(TOOL)
            session = await plane.open_session("bench", "alice@example.com")
            samples = []
            tier = ""
            for _ in range(n):
                t = time.perf_counter()
                result = await plane.call(session, "add", ARGS)
                samples.append(time.perf_counter() - t)
                assert result.ok, result
                assert result.output == 5, result
                tier = result.tier or ""
            return samples, tier


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    configure_logging("console", "warning")
    n = opts.iterations
    interpreter = Settings().runner.python

    measure_plain(5, interpreter)
    await measure_call(5, "fsync")
    # Interleave the two sides in rounds so machine noise falls on both alike.
    plain: list[float] = []
    full: list[float] = []
    rounds = 5
    tier = ""
    for _ in range(rounds):
        plain += measure_plain(n // rounds, interpreter)
        samples, tier = await measure_call(n // rounds, "fsync")
        full += samples
    relaxed, _ = await measure_call(max(10, n // 2), "relaxed")
    rows = {
        "baseline: subprocess.run, same program": summarize(plain),
        f"ControlPlane.call() in {tier}, durability=fsync": summarize(full),
        f"ControlPlane.call() in {tier}, durability=relaxed": summarize(relaxed),
    }
    ratio = (
        rows[f"ControlPlane.call() in {tier}, durability=fsync"]["p50_ms"]
        / rows["baseline: subprocess.run, same program"]["p50_ms"]
    )
    report("full call() of a trivial python tool", rows, {
        "program": f"{interpreter} -I -S -c <harness>, JSON on stdin",
        "target": f"call p50 within 1.6x of plain subprocess: {'met' if ratio <= 1.6 else 'NOT met'}"
                  f" ({ratio:.2f}x)",
        "audit durability": "fsync per append (default); relaxed shown beside it",
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

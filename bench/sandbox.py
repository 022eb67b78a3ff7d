"""Sandbox tiers against plain subprocess.run, in one run on this machine.

For each tier: cold start to first output (a fresh sandbox running a trivial python tool),
call latency p50/p99 (bwrap: every call is a fresh sandbox; docker and gvisor: a call served
from the warm pool), and throughput with 2 concurrent workers. The baseline runs the same
program with plain ``subprocess.run``. Targets: bwrap within 1.6x of the baseline; warm docker
and gvisor calls under 5 ms p50.

Also the quarantine sweep (`runner.files.sweep_quarantine`, run by the router in a thread at
start and every quarter of the keep time): a quarantine of 2,000 calls' outputs, half past the
keep time, against removing the same directories by a list (`shutil.rmtree`, no scan, no stat),
and a sweep that finds nothing to remove.

Warm samples come from a pool filled beforehand (then a one-second settle) with refills off, so
container creation does not compete with the calls measured: in service, the housekeeper
refills pools and removes used containers only when no call is running.

Usage: .venv/bin/python bench/sandbox.py [--iterations N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runner import ContainerSandbox, ResourceLimits, RunnerSettings, Sandbox, SandboxSpec, make_sandbox, python_job
from runner.files import sweep_quarantine

SOURCE = "def main(a, b):\n    return a + b\n"
LIMITS = ResourceLimits(timeout_s=30)
# In service, pool containers are started during idle time, ahead of the calls they serve; a
# container's runtime keeps working for a moment after its worker reports ready.
SETTLE_S = 1.0


def job() -> SandboxSpec:
    return python_job(SOURCE, "main", {"a": 2, "b": 3}, interpreter="/usr/bin/python3", limits=LIMITS)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


def plain_once() -> float:
    spec = job()
    started = time.perf_counter()
    done = subprocess.run(list(spec.argv), input=spec.stdin, capture_output=True, check=True, env={})
    elapsed = time.perf_counter() - started
    assert done.stdout == b'{"result": 5}'
    return elapsed


async def timed(sandbox: Sandbox) -> float:
    started = time.perf_counter()
    result = await sandbox.run(job())
    elapsed = time.perf_counter() - started
    assert result.stdout == b'{"result": 5}', (result.verdict, result.stderr[-300:])
    return elapsed


async def two_workers(sandbox: Sandbox, calls: int) -> float:
    """Calls per second when two concurrent workers make ``calls`` calls in all."""
    started = time.perf_counter()

    async def worker() -> None:
        for _ in range(calls // 2):
            await timed(sandbox)

    await asyncio.gather(worker(), worker())
    return (calls // 2 * 2) / (time.perf_counter() - started)


async def baseline(n: int) -> dict[str, Any]:
    samples = [await asyncio.to_thread(plain_once) for _ in range(n)]
    started = time.perf_counter()
    await asyncio.gather(*(asyncio.to_thread(lambda: [plain_once() for _ in range(n // 2)]) for _ in range(2)))
    rate = (n // 2 * 2) / (time.perf_counter() - started)
    return {"cold_ms": statistics.median(samples) * 1000, "p50_ms": pct(samples, 0.5), "p99_ms": pct(samples, 0.99),
            "per_s": rate, "sustained_per_s": rate, "start": "process"}  # fmt: skip


async def bwrap_tier(settings: RunnerSettings, n: int) -> dict[str, Any]:
    sandbox = make_sandbox(settings, "bwrap")
    await timed(sandbox)
    samples = [await timed(sandbox) for _ in range(n)]
    rate = await two_workers(sandbox, n)
    await sandbox.aclose()
    return {"cold_ms": statistics.median(samples) * 1000, "p50_ms": pct(samples, 0.5), "p99_ms": pct(samples, 0.99),
            "per_s": rate, "sustained_per_s": rate, "start": "fresh"}  # fmt: skip


async def container_tier(settings: RunnerSettings, tier: str, n: int, progress: bool) -> dict[str, Any]:
    sandbox = make_sandbox(settings.model_copy(update={"pool_size": 0}), tier)
    assert isinstance(sandbox, ContainerSandbox)
    problem = sandbox.check()
    if problem is not None:
        return {"unavailable": problem}
    colds = [await timed(sandbox) for _ in range(5)]  # pool empty: every call starts a container
    warm: list[float] = []
    batch = 10
    while len(warm) < n:
        if progress:
            print(f"  {tier}: warming {batch} containers ({len(warm)}/{n} calls measured)", file=sys.stderr)
        await sandbox.prewarm(LIMITS, size=batch)
        await asyncio.sleep(SETTLE_S)
        warm += [await timed(sandbox) for _ in range(batch)]
    await sandbox.prewarm(LIMITS, size=n)
    await asyncio.sleep(SETTLE_S)
    rate = await two_workers(sandbox, n)
    await sandbox.aclose()
    sustained = await sustained_rate(settings, tier, n)
    return {"cold_ms": statistics.median(colds) * 1000, "p50_ms": pct(warm[:n], 0.5),
            "p99_ms": pct(warm[:n], 0.99), "per_s": rate, "sustained_per_s": sustained,
            "start": "warm pool"}  # fmt: skip


async def sustained_rate(settings: RunnerSettings, tier: str, n: int) -> float:
    """Calls per second from 2 workers when the pool (default size) must keep refilling: every
    call still gets a never-used container, so container churn sets the pace."""
    sandbox = make_sandbox(settings, tier)
    assert isinstance(sandbox, ContainerSandbox)
    await sandbox.prewarm(LIMITS)
    await asyncio.sleep(SETTLE_S)
    rate = await two_workers(sandbox, n // 2)
    await sandbox.aclose()
    return rate


def quarantine(root: Path, calls: int, keep_s: float) -> list[Path]:
    """``calls`` call directories of three small outputs each under ``root``, every second one
    last changed before the keep time; those, the ones a sweep removes."""
    old = time.time() - keep_s - 60
    aged = []
    for i in range(calls):
        call = root / f"c-{i:06d}"
        (call / "reports").mkdir(parents=True)
        for name in ("out.json", "reports/a.csv", "reports/b.txt"):
            (call / name).write_bytes(b"x" * 1024)
        if i % 2:
            os.utime(call, (old, old))
            aged.append(call)
    return aged


def sweep_rows(calls: int = 2000, runs: int = 3) -> dict[str, dict[str, float]]:
    """The sweep against removing the same directories by a list, and a sweep with nothing to do."""
    keep_s = RunnerSettings().quarantine_keep_s
    samples: dict[str, list[float]] = {"baseline: rmtree of the aged, by a list": [], "sweep": [],
                                       "sweep, nothing aged": []}  # fmt: skip
    counts: dict[str, int] = {}
    for _ in range(runs):
        for name, taken in samples.items():
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                aged = quarantine(root, calls, keep_s)
                started = time.perf_counter()
                if name.startswith("baseline"):
                    for call in aged:
                        shutil.rmtree(call)
                    removed = len(aged)
                else:
                    removed = sweep_quarantine(root, keep_s if name == "sweep" else keep_s * 2)
                taken.append(time.perf_counter() - started)
                if removed != (0 if "nothing" in name else len(aged)) or any(call.exists() for call in aged) != (
                    "nothing" in name
                ):
                    raise RuntimeError(f"{name}: removed {removed} of {len(aged)}")
                counts[name] = removed
    return {name: {"p50_ms": statistics.median(s) * 1e3, "removed": counts[name]} for name, s in samples.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    settings = RunnerSettings()
    n = max(10, opts.iterations)
    rows: dict[str, dict[str, Any]] = {"baseline: subprocess.run": await baseline(n)}
    rows["bwrap"] = await bwrap_tier(settings, n)
    for tier in ("docker", "gvisor"):
        rows[tier] = await container_tier(settings, tier, n, not opts.json)
    sweeps = sweep_rows()
    base = rows["baseline: subprocess.run"]["p50_ms"]
    verdicts = {
        "bwrap within 1.6x of plain subprocess": rows["bwrap"]["p50_ms"] / base <= 1.6,
        "docker warm p50 under 5 ms": rows["docker"].get("p50_ms", 1e9) < 5,
        "gvisor warm p50 under 5 ms": rows["gvisor"].get("p50_ms", 1e9) < 5,
    }
    if opts.json:
        print(json.dumps({"benchmark": "sandbox tiers", "results": rows, "quarantine_sweep": sweeps,
                          "targets": verdicts}, indent=2))  # fmt: skip
        return
    print("\nsandbox tiers: trivial python tool ({'result': 5}); cold = fresh sandbox to its output")
    print(
        f"  {'tier':26} {'cold ms':>9} {'call p50 ms':>12} {'call p99 ms':>12} {'2 workers /s':>13} "
        f"{'sustained /s':>13}  calls from"
    )
    for name, r in rows.items():
        if "unavailable" in r:
            print(f"  {name:26} unavailable: {r['unavailable']}")
            continue
        print(f"  {name:26} {r['cold_ms']:>9.1f} {r['p50_ms']:>12.2f} {r['p99_ms']:>12.2f} {r['per_s']:>13.1f} "
              f"{r['sustained_per_s']:>13.1f}  {r['start']}")  # fmt: skip
    print("  2 workers /s: from a pool filled beforehand; sustained /s: pool of 2 refilling as it goes,")
    print("  so container creation and removal (not the call) set the pace on the container tiers.")
    print(f"  bwrap / baseline at p50: {rows['bwrap']['p50_ms'] / base:.2f}x")
    for target, met in verdicts.items():
        print(f"  target: {target}: {'met' if met else 'NOT met'}")
    print("\nquarantine sweep: 2,000 calls' outputs (3 files each), half past the keep time")
    for name, r in sweeps.items():
        print(f"  {name:42} {r['p50_ms']:>9.1f} ms  {r['removed']:>5} removed")


if __name__ == "__main__":
    asyncio.run(main())

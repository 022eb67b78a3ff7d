"""Provenance indexing of hostile text: how long `content_keys` takes on a MiB of each input that
made the old matcher quadratic (or that could trip a careless linear one), next to the old e-mail
pattern on 16 and 64 KiB of the same kind of text, measured in the same run; and how long the
event loop stalls while a MiB is indexed, inline and through `content_keys_async`.

The old pattern retried every start of a long run of address characters: a line of letters
without '@' cost O(n^2). Target: 1 MiB of each adversarial input in at most 50 ms (p50), on this
2-core machine class. The machine's load average is printed: other processes slow every row.

Usage: .venv/bin/python bench/provenance.py [--iterations N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from router.logging import configure_logging
from router.provenance import MAX_INDEXED_CHARS, MAX_INDEXED_TOKENS, content_keys, content_keys_async

KIB, MIB = 1 << 10, 1 << 20
# The e-mail pattern router/provenance.py used before: the baseline.
OLD_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,63}")
TARGET_MS = 50.0


def nested_strings(size: int) -> list[Any]:
    """JSON of strings nested as deep as ``size`` characters allow (built without recursion)."""
    value: list[Any] = ["tail@deep.example"]
    for i in range(size // 12):
        value = [f"s{i}@x.io", value]
    return value


def valid_ibans(count: int) -> list[str]:
    """``count`` German IBANs with valid check digits, written in groups of four."""
    found = []
    for i in range(count):
        bban = f"37040044{i:010d}"
        check = 98 - int("".join(str(int(c, 36)) for c in bban + "DE00")) % 97
        plain = f"DE{check:02d}{bban}"
        found.append(" ".join(plain[k : k + 4] for k in range(0, len(plain), 4)))
    return found


def adversarial(size: int) -> dict[str, Any]:
    """Inputs of about ``size`` characters."""
    rng = random.Random(7)  # noqa: S311  (reproducible test data, not secrets)
    ibans = valid_ibans(100)
    return {
        "letters, no '@'": "a" * size,
        "'@' only": "@" * size,
        "'a@' repeated": "a@" * (size // 2),
        "'.' around '@'": "." * (size // 2) + "@" + "." * (size // 2),
        "'a.' around '@'": "a." * (size // 4) + "@" + "a." * (size // 4),
        "a run of digits": "1" * size + "x",
        "'1 ' repeated": "1 " * (size // 2),
        "'12345678 ' repeated": "12345678 " * (size // 9),
        "'http://' repeated": "http://" * (size // 7),
        "'http://a ' repeated": "http://a " * (size // 9),
        "IBAN-ish 'DE89' repeated": "DE89" * (size // 4),
        "IBAN-ish 'DE89 ' repeated": "DE89 " * (size // 5),
        "a valid IBAN repeated": "DE89 3704 0044 0532 0130 00 " * (size // 28),
        "an IBAN repeated, every 50th changed": "".join(
            f"DE89 3704 0044 0532 0130 {i % 97 if i % 50 == 0 else 0:02d} " for i in range(size // 28)
        ),
        "'ab.' labels, no TLD end": "ab1." * (size // 4),
        "nested JSON of strings": nested_strings(size),
        "distinct numbers (token budget)": "".join(f"{i} " for i in range(100_000, 100_000 + size // 7))[:size],
        "distinct e-mails (token budget)": "".join(f"u{i}@d{i}.example " for i in range(size // 20))[:size],
        "distinct URLs (token budget)": "".join(f"http://h{i}.example/{i} " for i in range(size // 24))[:size],
        # Few distinct IBANs, each line-scan match a repeat, in no order a repeat check can use:
        # every occurrence is matched (IBAN and account scans) and its words split.
        "100 valid IBANs in random order": "".join(rng.choice(ibans) + " " for _ in range(size // 28)),
        "distinct IBANs (token budget)": "".join(
            f"DE{i % 97:02d} 3704 0044 0532 {i % 10000:04d} {i % 100:02d} " for i in range(size // 28)
        ),
    }


def realistic(size: int) -> str:
    """Free text with the identifiers a tool output holds, none repeated."""
    lines = []
    for i in range(size // 150 + 1):
        lines.append(f"Order {i}: contact sales{i}@vendor{i % 997}.example or https://vendor{i % 997}.example/p/{i}, "
                     f"{100 + i}.99 EUR to DE89 3704 0044 0532 0130 00, account {10_000_000 + i}.")  # fmt: skip
    return "\n".join(lines)[:size]


CPU_P50_MS: dict[str, float] = {}  # per row: the median CPU time, less sensitive to a loaded box


def timed(row: str, index: Callable[[], object], n: int) -> list[float]:
    """Wall-clock durations of ``n`` runs of ``index``, after one warm-up run (the median CPU time
    goes to `CPU_P50_MS`)."""
    index()
    samples, cpu = [], []
    for _ in range(n):
        started, started_cpu = time.perf_counter(), time.process_time()
        index()
        samples.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    CPU_P50_MS[row] = sorted(cpu)[len(cpu) // 2] * 1000
    return samples


async def loop_stall(index: Callable[[], Any]) -> float:
    """The longest the event loop went without running a 1 ms ticker while ``index()`` (sync, or
    a coroutine function) ran, in seconds."""
    longest = 0.0
    last = time.perf_counter()

    async def tick() -> None:
        nonlocal longest, last
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest, last = max(longest, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    longest, last = 0.0, time.perf_counter()
    result = index()
    if asyncio.iscoroutine(result):
        await result
    await asyncio.sleep(0.005)
    ticker.cancel()
    return max(longest, time.perf_counter() - last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20, help="runs per row (the baseline: at most 3)")
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    n = max(1, opts.iterations)
    configure_logging("console", "error")  # the token-budget rows log that they were cut

    rows: dict[str, dict[str, float]] = {}

    def measure(row: str, index: Callable[[], object], runs: int) -> dict[str, float]:
        rows[row] = summarize(timed(row, index, runs))
        return rows[row]

    letters = {size: "a" * size for size in (16 * KIB, 64 * KIB)}
    for size, text in letters.items():
        measure(f"baseline: old e-mail pattern, {size // KIB} KiB of letters",
                lambda text=text: list(OLD_EMAIL.finditer(text)), min(n, 3))  # fmt: skip
    for size, text in letters.items():
        measure(f"content_keys, {size // KIB} KiB of letters", lambda text=text: content_keys([text]), n)
    verdicts = {}
    for name, value in adversarial(MIB).items():
        row = f"content_keys, 1 MiB: {name}"
        verdicts[name] = (measure(row, lambda v=value: content_keys([v]), n)["p50_ms"], CPU_P50_MS[row])
    prose_mib = realistic(MIB)
    measure("content_keys, 1 MiB: realistic output, no repeats", lambda: content_keys([prose_mib]), n)

    stall_inline = asyncio.run(loop_stall(lambda: content_keys([prose_mib])))
    stall_async = asyncio.run(loop_stall(lambda: content_keys_async([prose_mib])))

    met_wall = [name for name, (wall, _) in verdicts.items() if wall <= TARGET_MS]
    met_cpu = [name for name, (_, cpu) in verdicts.items() if cpu <= TARGET_MS]
    worst = max(verdicts, key=lambda name: verdicts[name][0])
    old_16 = rows["baseline: old e-mail pattern, 16 KiB of letters"]["p50_ms"]
    old_64 = rows["baseline: old e-mail pattern, 64 KiB of letters"]["p50_ms"]
    report("provenance indexing of hostile text", rows, {
        "load average (1, 5, 15 min)": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "bounds per piece of content": f"{MAX_INDEXED_CHARS // MIB} MiB of characters, {MAX_INDEXED_TOKENS} tokens",
        "baseline growth, 16 -> 64 KiB": f"{old_64 / old_16:.1f}x for 4x the text (quadratic: 16x)",
        "target": f"1 MiB of each adversarial input in <= {TARGET_MS:g} ms: met for {len(met_wall)} of "
                  f"{len(verdicts)} by wall-clock p50, {len(met_cpu)} by CPU-time p50; slowest: {worst} "
                  f"({verdicts[worst][0]:.1f} ms wall, {verdicts[worst][1]:.1f} ms CPU)",
        "CPU-time p50 per 1 MiB input (ms)": {name: round(cpu, 1) for name, (_, cpu) in verdicts.items()},
        "event loop stall while 1 MiB of realistic output is indexed":
            f"inline {stall_inline * 1000:.1f} ms, content_keys_async {stall_async * 1000:.1f} ms",
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    main()

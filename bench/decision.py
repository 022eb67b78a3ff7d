"""Decision latency for the shipped policy.

Measures, in one run:
  - the embedded engine's decide(): the compiled RVM path, and for any outcome but deny the
    strict interpreter's confirmation (builtin errors must deny; the RVM drops them silently);
  - the RVM alone, what decide() cost before that confirmation, and the interpreter alone with a
    fresh clone per decision (the baseline);
  - ControlPlane.decide(): argument validation + policy + the decision's audit append, with
    the audit log's default durability (fsync per append) and, beside it, the relaxed mode.

Usage: .venv/bin/python bench/decision.py [--iterations N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import report, summarize

from policy import EmbeddedEngine, PolicyInput, PolicySettings
from router import ControlPlane, Settings
from router.logging import configure_logging
from router.settings import AuditSettings, StoreSettings

REPO = Path(__file__).resolve().parent.parent
INPUT = PolicyInput.model_validate({
    "subject": {"agent": "bench", "principal": "alice@example.com"},
    "session": {"id": "s-1", "taint": ["untrusted_content"], "call_count": 7},
    "tool": {"name": "send_email", "capabilities": ["sends_external"], "risk": "medium",
             "limits": {"timeout_s": 5, "memory_mb": 128}},
    "args": {"to": "bob@example.com", "body": "hello"},
    "now": "2026-11-22T10:00:00Z",
})  # fmt: skip
TOOL = {
    "name": "send_email", "description": "send", "risk": "medium", "capabilities": ["sends_external"],
    "input_schema": {"type": "object", "required": ["to", "body"],
                     "properties": {"to": {"type": "string", "format": "email"}, "body": {"type": "string"}}},
    "executor": {"kind": "external"},
}  # fmt: skip


async def measure_engine(engine: EmbeddedEngine, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await engine.decide(INPUT)
        samples.append(time.perf_counter() - t)
    return samples


def measure_rvm_alone(engine: EmbeddedEngine, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        engine.evaluate_raw(INPUT)
        samples.append(time.perf_counter() - t)
    return samples


def measure_interpreter(engine: EmbeddedEngine, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        engine.evaluate_interpreted(INPUT)
        samples.append(time.perf_counter() - t)
    return samples


async def timed_decides(plane: ControlPlane, session_id: str, args: dict[str, str], n: int) -> list[float]:
    """Durations of ``n`` ControlPlane.decide() calls for send_email, after a warm-up."""
    for _ in range(50):
        await plane.decide(session_id, "send_email", args)
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await plane.decide(session_id, "send_email", args)
        samples.append(time.perf_counter() - started)
    return samples


async def measure_plane(durability: Literal["fsync", "relaxed"], n: int) -> list[float]:
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:  # on the project's disk, not a tmpfs
        settings = Settings(audit=AuditSettings(path=Path(tmp) / "audit.jsonl", durability=durability))
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register(TOOL)
            session = await plane.open_session("bench", "alice@example.com")
            args = {"to": "bob@example.com", "body": "hello"}
            return await timed_decides(plane, session, args, n)


FETCH = {
    "name": "get_webpage", "description": "fetch", "risk": "low", "capabilities": ["reads_untrusted"],
    "input_schema": {"type": "object"}, "executor": {"kind": "external"},
}  # fmt: skip


def page(i: int) -> dict[str, str]:
    """A realistic tool output: free text with addresses, URLs, an IBAN and amounts."""
    return {"url": f"https://site{i}.example/item/{i}",
            "text": f"Contact sales{i}@vendor{i % 97}.example or visit https://vendor{i % 97}.example/p/{i}. "
                    f"Price {100 + i}.99 EUR, account {10_000_000 + i}, ref DE89 3704 0044 0532 0130 00."}  # fmt: skip


async def measure_provenance(
    prior_outputs: int, durability: Literal["fsync", "relaxed"], n: int, store_url: str | None = None
) -> list[float]:
    """ControlPlane.decide() for a consequential call in a session holding ``prior_outputs`` outputs,
    on the embedded store or (``store_url``) on Redis."""
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        settings = Settings(
            audit=AuditSettings(path=Path(tmp) / "audit.jsonl", durability=durability),
            store=StoreSettings(url=store_url),
        )
        async with ControlPlane.from_settings(settings) as plane:
            await plane.register({**TOOL, "destination_args": ["to"]})
            await plane.register(FETCH)
            session_id = await plane.open_session("bench", "alice@example.com", ["email bob@example.com"])
            session = await plane.store.load_session(session_id)
            assert session is not None
            fetch = plane.registry.get("get_webpage").spec
            for i in range(prior_outputs):  # the path a real call's output takes into the index
                await plane._remember(session, fetch, f"c-{i}", page(i))
            args = {"to": "sales7@vendor7.example", "body": "hello"}
            try:
                return await timed_decides(plane, session_id, args, n)
            finally:
                await plane.close_session(session_id)  # leaves nothing behind in a shared Redis


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/0",
        help="Redis for the shared-store rows (scripts/services starts one); '' to skip them",
    )
    opts = parser.parse_args()
    n = opts.iterations
    configure_logging("console", "warning")

    started = time.perf_counter()
    engine = EmbeddedEngine(PolicySettings(dir=REPO / "policies"))
    load_ms = (time.perf_counter() - started) * 1000
    await measure_engine(engine, 200)  # warm-up
    measure_interpreter(engine, 200)
    rows = {
        "engine.decide() RVM + strict confirmation": summarize(await measure_engine(engine, n)),
        "RVM alone (no confirmation: fails open)": summarize(measure_rvm_alone(engine, n)),
        "baseline: regorus interpreter (Engine)": summarize(measure_interpreter(engine, n)),
        "ControlPlane.decide() durability=fsync": summarize(await measure_plane("fsync", max(200, n // 5))),
        "ControlPlane.decide() durability=relaxed": summarize(await measure_plane("relaxed", max(200, n // 5))),
    }
    stores: list[tuple[str, str | None]] = [("embedded", None)]
    if opts.redis_url:
        stores.append(("redis", opts.redis_url))
    for store, url in stores:
        for prior in (0, 100, 10_000):
            for durability in ("relaxed", "fsync"):
                rows[f"decide(), {store} store, {prior} prior outputs, {durability}"] = summarize(
                    await measure_provenance(prior, durability, max(200, n // 5), url)  # type: ignore[arg-type]
                )
    p50 = rows["engine.decide() RVM + strict confirmation"]["p50_ms"]

    targets = {}
    for store, limit in (("embedded", 0.3), ("redis", 1.0)):
        if not any(k.startswith(f"decide(), {store} store") for k in rows):
            continue  # that store was not measured (--redis-url '')
        verdicts = []
        for durability in ("relaxed", "fsync"):
            worst = max(v["p50_ms"] for k, v in rows.items() if k.startswith(f"decide(), {store} store")
                        and k.endswith(durability))  # fmt: skip
            verdicts.append(f"{durability} {'met' if worst < limit else 'NOT met'} ({worst:.3f} ms)")
        targets[f"target, {store} store"] = f"decide() p50 < {limit:g} ms at any session size: " + ", ".join(verdicts)

    report("decision latency, shipped policy", rows, {
        "policy revision": engine.revision[:16],
        "policy load + compile": f"{load_ms:.2f} ms",
        "target": f"engine p50 < 0.3 ms: {'met' if p50 < 0.3 else 'NOT met'} ({p50:.4f} ms)",
        "the decided input": "send_email after untrusted content: require_approval, so it is confirmed",
        "speed-up of decide() over the interpreter alone":
            f"{rows['baseline: regorus interpreter (Engine)']['p50_ms'] / p50:.1f}x at p50",
        "audit durability (ControlPlane rows)": "fsync per append is the default; relaxed shown beside it",
        "prior outputs": "a tainted session whose index holds N realistic outputs; the call's recipient "
        "is in one of them",
        **targets,
    }, opts.json)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())

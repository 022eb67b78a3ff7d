"""Prometheus metrics of this process (``GET /metrics``): calls by tool and status, decision and
run latency, audit append latency (the audit lag: how long a record takes to be durable), and
the warm containers ready per tier."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry()
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
_SLOW = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

CALLS = Counter("stockade_calls", "Tool calls by tool and result status.", ["tool", "status"], registry=REGISTRY)
DECISIONS = Histogram("stockade_decision_seconds", "Policy evaluation time per decision, by outcome.",
                      ["outcome"], buckets=_FAST, registry=REGISTRY)  # fmt: skip
RUNS = Histogram("stockade_run_seconds", "Sandbox run time per call, by tier.", ["tier"], buckets=_SLOW,
                 registry=REGISTRY)  # fmt: skip
AUDIT_APPEND = Histogram("stockade_audit_append_seconds", "Time for an audit event to be appended (durably).",
                         buckets=_FAST, registry=REGISTRY)  # fmt: skip
POOL_READY = Gauge("stockade_pool_ready", "Warm containers waiting for a call, by tier.", ["tier"], registry=REGISTRY)


def exposition() -> bytes:
    """The metrics in the Prometheus text format."""
    data: bytes = generate_latest(REGISTRY)
    return data

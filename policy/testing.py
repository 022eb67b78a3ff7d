"""Run the Rego unit tests (``test_*`` rules in ``*_test.rego``) on the regorus interpreter.

The compiled path rejects ``with``, which tests need, so tests run on ``regorus.Engine``;
`tests/policy` checks the two paths agree on the same inputs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import regorus

from policy.bundle import load_bundle
from policy.errors import PolicyBundleError

_PACKAGE = re.compile(r"^package\s+([A-Za-z0-9_.\[\]\"-]+)", re.MULTILINE)
_TEST_RULE = re.compile(r"^(test_[A-Za-z0-9_]+)\b", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class RegoTestResult:
    """One Rego test: ``passed`` is true only when the rule evaluated to ``true``."""

    file: str
    name: str
    passed: bool
    duration_ms: float
    error: str | None = None


def run_rego_tests(root: Path, *, max_bytes: int = 1 << 20) -> list[RegoTestResult]:
    """Run every ``test_*`` rule of every ``*_test.rego`` under ``root``.

    Raises:
        PolicyBundleError: the directory cannot be loaded or parsed.
    """
    bundle = load_bundle(root, max_bytes=max_bytes)
    engine = regorus.Engine()
    try:
        for path, text in bundle.modules:
            engine.add_policy(path, text)
        engine.add_data_json(bundle.data_json)
    except RuntimeError as exc:
        raise PolicyBundleError(f"policy in {root} does not parse: {str(exc).strip()}") from exc
    results: list[RegoTestResult] = []
    for path, text in bundle.modules:
        if not path.endswith("_test.rego"):
            continue
        package = _PACKAGE.search(text)
        if package is None:
            raise PolicyBundleError(f"{path}: no package declaration")
        for name in dict.fromkeys(_TEST_RULE.findall(text)):
            started = time.perf_counter()
            error: str | None = None
            try:
                value = engine.eval_rule(f"data.{package.group(1)}.{name}")
            except RuntimeError as exc:
                value, error = None, str(exc).strip()
            elapsed = (time.perf_counter() - started) * 1000
            results.append(RegoTestResult(path, name, value is True, elapsed, error))
    return results

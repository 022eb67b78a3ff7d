"""`stockade policy` as a security engineer runs it: a real process on real policy files.

Failing tests say which statement failed and with what values, errors keep their source snippet
and lose the Rust backtrace, policy text is printed as written; OPA's habits (``-r``, ``-v``,
``--threshold``, ``--watch``, ``eval --fail``, any rule, ``bench``, ``new``) work.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import REPO

STOCKADE = str(Path(sys.executable).parent / "stockade")

# A team's own policy: an allow rule, a deny reason with markup-like text, a helper that raises
# on the interpreter (and is silently undefined on the RVM) for an amount that is not a number.
POLICY = """package stockade

default decision := {"outcome": "deny", "reasons": [{"code": "policy.default_deny", "message": "no rule allows it"}]}

decision := {"outcome": "deny", "reasons": [r | some r in deny_reasons]} if count(deny_reasons) > 0

decision := {"outcome": "allow", "reasons": []} if {
	count(deny_reasons) == 0
	input.tool.risk == "low"
	not too_big
}

too_big if to_number(input.args.amount) > 100

deny_reasons contains {"code": "team.blocked", "message": "tool [blocked] is refused"} if {
	input.tool.name == "blocked"
}
"""

TESTS = """package stockade_test

import data.stockade

call := {
	"subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"}, "args": {"amount": 5},
	"tool": {"name": "t[arg]", "capabilities": [], "risk": "low", "limits": {}}, "now": "2026-11-22T10:00:00Z",
}

test_low_risk_is_allowed if {
	d := stockade.decision with input as call
	d.outcome == "allow"
}

test_blocked_is_denied if {
	d := stockade.decision with input as object.union(call, {"tool": {"name": "blocked"}})
	"team.blocked" in {r.code | some r in d.reasons}
}
"""

FAILING = """package stockade_test

import data.stockade

test_high_risk_is_allowed if {
	print("deciding for", data.stockade_test.call.tool.name)
	d := stockade.decision with input as object.union(data.stockade_test.call, {"tool": {"risk": "high"}})
	d.outcome == "allow"
}

test_amount_must_be_a_number if {
	to_number("5000x[arg]") > 1
}
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STOCKADE, "policy", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, check=False)  # fmt: skip


def policy(root: Path, *, failing: bool = False) -> Path:
    (root / "stockade").mkdir(parents=True, exist_ok=True)
    (root / "stockade" / "decision.rego").write_text(POLICY)
    (root / "stockade" / "decision_test.rego").write_text(TESTS)
    if failing:
        (root / "stockade" / "failing_test.rego").write_text(FAILING)
    return root


def an_input(root: Path, name: str = "t", risk: str = "low", amount: object = 5) -> Path:
    path = root / f"in-{name}-{risk}.json"
    path.write_text(json.dumps({
        "subject": {"agent": "a", "principal": "p"}, "session": {"id": "s"}, "args": {"amount": amount},
        "tool": {"name": name, "capabilities": [], "risk": risk}, "now": "2026-11-22T10:00:00Z",
    }))  # fmt: skip
    return path


# -- policy test --------------------------------------------------------------------------------


def test_a_failing_test_shows_the_statement_that_failed_with_its_values_and_its_prints(tmp_path: Path) -> None:
    done = run("test", "--dir", str(policy(tmp_path, failing=True)), "-r", "high_risk")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL stockade/failing_test.rego::test_high_risk_is_allowed" in done.stdout
    assert 'stockade/failing_test.rego:8: d.outcome == "allow"' in done.stdout
    assert 'd.outcome = "deny"' in done.stdout
    assert "print() output of test_high_risk_is_allowed:" in done.stdout
    assert "stockade/failing_test.rego:6: deciding for t[arg]" in done.stdout  # not eaten as markup
    assert "test_low_risk_is_allowed" not in done.stdout  # -r ran only the matching test
    [entry] = json.loads(run("test", "--dir", str(tmp_path), "-r", "high_risk", "--json").stdout)
    assert entry["failure"]["where"] == "stockade/failing_test.rego:8"
    assert entry["failure"]["values"] == [{"operand": "d.outcome", "value": "deny", "defined": True, "each_of": False}]
    assert entry["prints"] == ["stockade/failing_test.rego:6: deciding for t[arg]"]


def test_an_error_shows_its_snippet_and_no_backtrace_even_with_rust_backtrace_set(tmp_path: Path) -> None:
    done = run("test", "--dir", str(policy(tmp_path, failing=True)), "-r", "amount_must", env={"RUST_BACKTRACE": "1"})
    assert done.returncode == 1
    assert "--> stockade/failing_test.rego:12:" in done.stdout
    assert 'to_number("5000x[arg]") > 1' in done.stdout
    assert "error: could not parse string as number" in done.stdout
    assert "backtrace" not in done.stdout.lower()
    assert "_start" not in done.stdout


def test_run_filters_by_name_and_a_bad_pattern_is_bad_usage(tmp_path: Path) -> None:
    root = policy(tmp_path)
    done = run("test", "--dir", str(root), "-r", "data.stockade_test.test_blocked")
    assert done.returncode == 0, done.stdout
    assert "PASS stockade/decision_test.rego::test_blocked_is_denied" in done.stdout
    assert "test_low_risk_is_allowed" not in done.stdout
    assert run("test", "--dir", str(root), "-r", "nothing_matches").returncode == 1
    assert run("test", "--dir", str(root), "-r", "(").returncode == 2


def test_verbose_shows_passing_tests_timing_replay_and_prints(tmp_path: Path) -> None:
    root = policy(tmp_path)
    (root / "stockade" / "printing_test.rego").write_text(
        'package stockade_test\n\ntest_prints if {\n\tprint("hello [b]x[/b]")\n}\n'
    )
    quiet = run("test", "--dir", str(root))
    assert quiet.returncode == 0
    assert "hello" not in quiet.stdout  # a passing test's prints only with -v
    verbose = run("test", "--dir", str(root), "-v")
    passing = r"PASS stockade/decision_test.rego::test_low_risk_is_allowed \(\d+\.\d+ ms; RVM agrees on 1 input\)"
    assert re.search(passing, verbose.stdout)
    assert "stockade/printing_test.rego:4: hello [b]x[/b]" in verbose.stdout


def test_coverage_under_the_threshold_exits_1(tmp_path: Path) -> None:
    root = policy(tmp_path)
    low = run("test", "--dir", str(root), "-r", "blocked", "--threshold", "95")
    assert low.returncode == 1, low.stdout
    assert re.search(r"coverage total: \d+\.\d%, under the threshold of 95%", low.stdout)
    document = json.loads(run("test", "--dir", str(root), "--coverage", "--threshold", "10", "--json").stdout)
    assert document["threshold"] == 10
    assert 10 <= document["coverage_percent"] <= 100
    assert run("test", "--dir", str(root), "--threshold", "10").returncode == 0


# Start the watcher with SIGINT at its default, as at a terminal: a test runner started in the
# background (nohup, `&` without job control) passes SIGINT on ignored, and Python then never
# raises KeyboardInterrupt (dispositions other than "ignore" are reset at exec, so this survives it).
_CTRL_C_WORKS = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)


def test_watch_runs_the_tests_again_when_a_file_changes(tmp_path: Path) -> None:
    root = policy(tmp_path)
    watcher = subprocess.Popen([sys.executable, "-c", _CTRL_C_WORKS, STOCKADE, "policy", "test", "--dir", str(root),
                                "--watch"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    output = Lines(watcher)
    try:
        seen = output.until("watching")
        assert "2 passed, 0 failed" in seen
        # Saved as an editor saves (truncate, then write): tests run on the empty file would fail
        # to parse; the watcher waits for the files to settle.
        with (root / "stockade" / "decision_test.rego").open("w") as saving:
            saving.flush()
            time.sleep(0.1)
            saving.write(TESTS.replace('"team.blocked" in', '"team.other" in'))
        seen = output.until("watching")
        assert "changed: stockade/decision_test.rego; running the tests again" in seen
        assert "FAIL stockade/decision_test.rego::test_blocked_is_denied" in seen
        assert "1 passed, 1 failed" in seen
        watcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:  # a step above failed: never leave it (or this test) waiting
            watcher.kill()
        watcher.wait()
        output.close()


class Lines:
    """A process's output lines, read by a thread of their own, so waiting for one can time out
    even while the process prints nothing."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        stream = process.stdout

        def pump() -> None:
            with stream:
                for line in stream:
                    self._lines.put(line)
            self._lines.put(None)  # the end of the output

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()

    def close(self) -> None:
        """Wait for the reader to reach the end of the output (the process has exited)."""
        self._pump.join(timeout=30)

    def until(self, marker: str, timeout_s: float = 60) -> str:
        """The output up to and including the first line holding ``marker``."""
        seen: list[str] = []
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if marker in line:
                return "".join(seen)
        raise AssertionError(f"no {marker!r} within {timeout_s} s in:\n{''.join(seen)}")


# -- policy eval ----------------------------------------------------------------------------------


def test_eval_decides_on_the_production_path_and_any_rule_on_both_engines(tmp_path: Path) -> None:
    root = policy(tmp_path)
    decided = run("eval", "--dir", str(root), "-i", str(an_input(tmp_path, amount="5000x")))
    assert decided.returncode == 0
    # The RVM allows (the builtin error only undefines too_big there); production confirms on the
    # interpreter, which raises: deny.
    assert [r["code"] for r in json.loads(decided.stdout)["reasons"]] == ["policy.error"]
    blocked = an_input(tmp_path, "blocked")
    reasons = run("eval", "deny_reasons", "--dir", str(root), "-i", str(blocked))
    assert reasons.returncode == 0
    assert json.loads(reasons.stdout) == [{"code": "team.blocked", "message": "tool [blocked] is refused"}]
    scripted = json.loads(run("eval", "--query", "data.stockade.too_big", "--dir", str(root), "-i", str(blocked),
                              "--json").stdout)  # fmt: skip
    assert scripted == {"query": "data.stockade.too_big", "defined": False, "result": None}


def test_eval_fail_and_fail_defined_exit_1_as_opa_does(tmp_path: Path) -> None:
    root, small = policy(tmp_path), an_input(tmp_path)
    big = an_input(tmp_path, "big", amount=500)
    assert run("eval", "too_big", "--dir", str(root), "-i", str(small), "--fail").returncode == 1
    assert run("eval", "too_big", "--dir", str(root), "-i", str(big), "--fail").returncode == 0
    assert run("eval", "too_big", "--dir", str(root), "-i", str(big), "--fail-defined").returncode == 1
    assert run("eval", "too_big", "--dir", str(root), "-i", str(small), "--fail-defined").returncode == 0
    assert run("eval", "--dir", str(root), "-i", str(small), "--fail-defined").returncode == 1  # a decision always is
    assert run("eval", "deny_reasons", "--dir", str(root), "-i", str(small), "--fail").returncode == 0  # [] is defined


def test_eval_usage_errors_exit_2(tmp_path: Path) -> None:
    root, small = policy(tmp_path), an_input(tmp_path)
    assert run("eval", "no_such_rule", "--dir", str(root), "-i", str(small)).returncode == 2
    assert run("eval", "not a rule!", "--dir", str(root), "-i", str(small)).returncode == 2
    assert run("eval", "--dir", str(root)).returncode == 2  # the decision needs an input
    assert run("eval", "too_big", "--dir", str(root), "-i", str(small), "--fail", "--fail-defined").returncode == 2
    # An error on the interpreter: the rule cannot be relied on; both engines' answers shown.
    broken = run("eval", "too_big", "--dir", str(root), "-i", str(an_input(tmp_path, amount="5000x")))
    assert broken.returncode == 2
    assert "--> stockade/decision.rego:13:" in broken.stderr


# -- policy explain -------------------------------------------------------------------------------


def test_explain_shows_where_the_interpreter_errors_when_production_denies_for_it(tmp_path: Path) -> None:
    root = policy(tmp_path)
    done = run("explain", "--dir", str(root), "-i", str(an_input(tmp_path, amount="5000x")))
    assert done.returncode == 0, done.stderr
    assert "outcome: deny" in done.stdout
    assert "policy.error" in done.stdout
    assert "the interpreter raised evaluating the decision:" in done.stdout
    assert "--> stockade/decision.rego:13:" in done.stdout
    assert "backtrace" not in done.stdout.lower()


def test_explain_answers_why_not_allow_with_the_teams_own_rules(tmp_path: Path) -> None:
    root = policy(tmp_path)
    why = json.loads(run("explain", "--dir", str(root), "-i", str(an_input(tmp_path, risk="high")), "--json").stdout)
    assert why["decision"]["outcome"] == "deny"
    [allow] = why["why_not_allow"]
    assert allow["where"] == "stockade/decision.rego:7"
    assert allow["failed"]["statement"] == 'input.tool.risk == "low"'
    assert allow["failed"]["values"][0]["operand"] == "input.tool.risk"
    assert allow["failed"]["values"][0]["value"] == "high"
    assert why["rules"]["too_big"] is None  # the team's own helper, undefined here
    assert why["rules"]["deny_reasons"] == []
    blocked = run("explain", "--dir", str(root), "-i", str(an_input(tmp_path, "blocked")))
    assert "team.blocked: tool [blocked] is refused  (stockade/decision.rego:15)" in blocked.stdout
    assert "count(deny_reasons) = 1" in blocked.stdout


# -- policy bench and new ---------------------------------------------------------------------------


def test_bench_reports_the_decision_the_baseline_and_each_rule_area(tmp_path: Path) -> None:
    root = policy(tmp_path)
    (root / "stockade" / "extra.rego").write_text(
        'package stockade\n\ndeny_reasons contains {"code": "extra.x", "message": "x"} if input.tool.name == "x"\n'
    )
    report = json.loads(run("bench", "--dir", str(root), "-n", "20", "-i", str(an_input(tmp_path)), "--json").stdout)
    assert report["inputs"] == [an_input(tmp_path).name]
    assert report["decision"]["n"] == 20
    assert report["decision"]["p50_us"] > 0
    assert report["baseline"]["p50_us"] > 0
    areas = {area["name"]: area for area in report["areas"]}
    assert set(areas) == {"stockade/decision.rego", "stockade/extra.rego"}
    assert areas["stockade/extra.rego"]["rules"] == ["data.stockade.deny_reasons"]
    assert all(area["error"] is None and area["p99_us"] >= area["p50_us"] > 0 for area in areas.values())
    table = run("bench", "--dir", str(root), "-n", "5").stdout
    assert "decision (production path)" in table
    assert "baseline: one-rule policy" in table
    assert "stockade/extra.rego" in table


def test_new_scaffolds_a_rule_area_whose_tests_pass_and_never_overwrites(tmp_path: Path) -> None:
    root = tmp_path / "policies"
    shutil.copytree(REPO / "policies", root)
    catalog = root / "stockade" / "reasons" / "data.json"
    had_catalog = catalog.exists()
    made = run("new", "deploy_guard", "--dir", str(root))
    assert made.returncode == 0, made.stderr
    rule = (root / "stockade" / "deploy_guard.rego").read_text()
    assert "# METADATA\n# title: deploy_guard.example\n" in rule  # the rule's own block, scope rule
    assert 'deny_reasons contains {"code": "deploy_guard.example"' in rule
    checked = run("check", "--dir", str(root), "--strict")  # Regal's conventions included
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = run("test", "--dir", str(root), "-r", "deploy_guard")
    assert tested.returncode == 0, tested.stdout
    assert "2 passed, 0 failed; 2 replayed on the RVM" in tested.stdout
    if had_catalog:
        assert json.loads(catalog.read_text())["deploy_guard.example"]["outcome"] == "deny"
    else:
        assert '"deploy_guard.example": {' in made.stdout
    again = run("new", "deploy_guard", "--dir", str(root))
    assert again.returncode == 2
    assert "exists already" in again.stderr
    assert (root / "stockade" / "deploy_guard.rego").read_text() == rule
    assert run("new", "Not-A-Name", "--dir", str(root)).returncode == 2


def test_new_adds_the_code_to_the_reason_catalog_when_there_is_one(tmp_path: Path) -> None:
    root = policy(tmp_path)
    (root / "stockade" / "reasons").mkdir()
    catalog = root / "stockade" / "reasons" / "data.json"
    catalog.write_text(json.dumps({"team.blocked": {"outcome": "deny", "message": "m", "runbook": "r"}}))
    assert run("new", "egress_extra", "--dir", str(root)).returncode == 0
    assert set(json.loads(catalog.read_text())) == {"team.blocked", "egress_extra.example"}
    assert run("test", "--dir", str(root)).returncode == 0

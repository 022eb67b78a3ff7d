"""The shipped policy as a security team meets it: every reason code catalogued, the reason-code
table of docs/policy.md generated from the catalog, and the rules docs/policy-authoring.md shows
(a deploy guard, a session label) working as written, tests and all, on the production engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policy import EmbeddedEngine, Outcome, PolicyInput
from policy.bundle import load_bundle
from policy.config import PolicySettings
from policy.errors import PolicyBundleError
from policy.reasons import END, START, emitting_files, load_reasons, regenerate, render_section
from tests.conftest import REPO, copy_policies

STOCKADE = Path(sys.executable).parent / "stockade"
GUIDE = REPO / "docs" / "policy-authoring.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def guide_blocks(lang: str) -> list[str]:
    """The fenced blocks of docs/policy-authoring.md in ``lang``, in order."""
    return [text for found, text in _FENCE.findall(GUIDE.read_text()) if found == lang]


def with_guide_rules(root: Path) -> Path:
    """A copy of the shipped policies plus the guide's rules, their tests and catalog entries,
    each where the guide says it goes."""
    policies = copy_policies(root)
    stockade = policies / "stockade"
    rules = [block for block in guide_blocks("rego") if block.startswith("package stockade\n")]
    tests = [block for block in guide_blocks("rego") if block.startswith("package stockade_test\n")]
    assert (len(rules), len(tests)) == (2, 1), "the guide shows two rule files and one test file"
    (stockade / "deploy.rego").write_text(rules[0])
    (stockade / "customer_records.rego").write_text(rules[1])
    (stockade / "deploy_test.rego").write_text(tests[0])
    [entries] = [json.loads(block) for block in guide_blocks("json")]
    catalog = stockade / "reasons" / "data.json"
    catalog.write_text(json.dumps(json.loads(catalog.read_text()) | entries, indent=2))
    return policies


def call(tool: dict[str, Any], **extra: Any) -> PolicyInput:
    """A call of ``tool`` by a developer's agent in a fresh session in production."""
    document: dict[str, Any] = {
        "subject": {"agent": "a", "principal": "p@example.com", "groups": ["dev"]},
        "session": {"id": "s-1"},
        "tool": {"capabilities": [], "risk": "low", **tool},
        "args": {},
        "now": "2026-11-23T10:00:00Z",
        "environment": {"name": "prod", "instance": "router-1"},
    }
    for key, value in extra.items():
        document[key] = document.get(key, {}) | value if isinstance(value, dict) else value
    return PolicyInput.model_validate(document)


def test_every_code_a_rule_gives_is_catalogued_and_every_other_code_is_set_by_the_router() -> None:
    bundle = load_bundle(REPO / "policies")
    catalog = load_reasons(bundle)
    given = emitting_files(bundle)
    assert set(given) <= set(catalog), f"uncatalogued: {sorted(set(given) - set(catalog))}"
    assert given["rate.exceeded"] == ("stockade/rates.rego",)
    assert given["policy.default_deny"] == ("stockade/decision.rego",)
    sources = "".join(p.read_text() for d in ("router", "policy") for p in (REPO / d).rglob("*.py"))
    router_side = set(catalog) - set(given)
    assert router_side >= {"policy.error", "audit.unavailable", "sandbox.unavailable", "store.unavailable"}
    for code in router_side:  # a catalogued code nothing gives would document a reason that never happens
        assert f'"{code}"' in sources, f"{code} is catalogued, but neither a rule nor the router gives it"
    # The shipped rules name every code that holds a call approval.*, and only those.
    assert {c for c, e in catalog.items() if e.outcome == "require_approval"} == {
        c for c in given if c.startswith("approval.")
    }


def test_the_committed_reason_code_table_is_current() -> None:
    done = subprocess.run([str(REPO / "scripts" / "policy-docs"), "--check"], capture_output=True, text=True,
                          check=False, cwd="/")  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = (REPO / "docs" / "policy.md").read_text().split(START)[1].split(END)[0]
    for code, entry in load_reasons(load_bundle(REPO / "policies")).items():
        assert f"| `{code}` | {entry.outcome} |" in table


def test_policy_docs_rewrites_a_stale_table_and_check_says_so(tmp_path: Path) -> None:
    policies = with_guide_rules(tmp_path / "p")
    doc = tmp_path / "policy.md"
    shutil.copy(REPO / "docs" / "policy.md", doc)
    script = [str(REPO / "scripts" / "policy-docs"), "--doc", str(doc), "--dir", str(policies)]
    stale = subprocess.run([*script, "--check"], capture_output=True, text=True, check=False)
    assert stale.returncode == 1, stale.stderr
    assert "stale" in stale.stderr
    assert "deploy.outside_hours" not in doc.read_text()  # --check wrote nothing
    assert subprocess.run(script, capture_output=True, text=True, check=False).returncode == 0
    text = doc.read_text()
    assert "| `deploy.outside_hours` | require_approval | `deploy.rego` |" in text
    assert "| `customer_records.external_send` | require_approval | `customer_records.rego` |" in text
    assert text.endswith((REPO / "docs" / "policy.md").read_text().split(END)[1])  # the rest is untouched
    assert subprocess.run([*script, "--check"], capture_output=True, text=True, check=False).returncode == 0


def test_policy_docs_refuses_a_document_without_markers_and_a_malformed_catalog(tmp_path: Path) -> None:
    policies = copy_policies(tmp_path / "p")
    doc = tmp_path / "plain.md"
    doc.write_text("# no markers here\n")
    with pytest.raises(ValueError, match="reason-codes:start"):
        regenerate(doc, policies)
    catalog = policies / "stockade" / "reasons" / "data.json"
    entries = json.loads(catalog.read_text())
    entries["rate.exceeded"]["outcome"] = "maybe"
    catalog.write_text(json.dumps(entries))
    with pytest.raises(PolicyBundleError, match=r"rate\.exceeded\.outcome"):
        load_reasons(load_bundle(policies))
    done = subprocess.run([str(REPO / "scripts" / "policy-docs"), "--doc", str(doc), "--dir", str(policies)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 2
    assert "rate.exceeded.outcome" in done.stderr


def test_the_section_is_bounded_by_its_markers() -> None:
    section = render_section(load_bundle(REPO / "policies"))
    assert section.startswith(START)
    assert section.endswith(END)
    assert section.count("\n| `") == len(load_reasons(load_bundle(REPO / "policies")))


def test_the_guides_rules_pass_the_guides_tests_on_both_engines(tmp_path: Path) -> None:
    policies = with_guide_rules(tmp_path)
    done = subprocess.run([str(STOCKADE), "policy", "test", "--dir", str(policies), "--json"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout)
    guide = [r for r in results if r["file"] == "stockade/deploy_test.rego"]
    assert len(guide) == 5
    assert all(r["passed"] and r["rvm"]["replayed"] >= 1 and not r["rvm"]["disagreements"] for r in guide)
    shipped = [r for r in results if r["file"] != "stockade/deploy_test.rego"]
    assert shipped
    assert all(r["passed"] for r in shipped)  # a team's rules leave the shipped tests passing


def test_a_session_label_set_by_one_call_holds_a_later_send_on_the_production_engine(tmp_path: Path) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=with_guide_rules(tmp_path)))
    read = engine.evaluate(call({"name": "crm_lookup", "capabilities": ["reads_private"]}))
    assert read.outcome is Outcome.ALLOW
    assert read.obligations.session_labels == ["customer_records"]
    mailer = {"name": "send_mail", "capabilities": ["sends_external"], "risk": "medium"}
    assert engine.evaluate(call(mailer)).outcome is Outcome.ALLOW  # a fresh session may send
    later = engine.evaluate(call(mailer, session={"labels": read.obligations.session_labels}))
    assert later.outcome is Outcome.REQUIRE_APPROVAL
    assert {r.code for r in later.reasons} == {"customer_records.external_send"}
    assert later.obligations.session_labels == []


def test_the_deploy_guard_reads_groups_environment_and_time(tmp_path: Path) -> None:
    engine = EmbeddedEngine(PolicySettings(dir=with_guide_rules(tmp_path)))
    deploy = {"name": "deploy", "capabilities": ["mutates_state"], "risk": "medium"}
    release = {"groups": ["release"]}
    assert engine.evaluate(call(deploy, subject=release)).outcome is Outcome.ALLOW
    denied = engine.evaluate(call(deploy))
    assert [r.code for r in denied.reasons] == ["deploy.not_release_manager"]
    late = engine.evaluate(call(deploy, subject=release, now="2026-11-23T19:00:00Z"))
    assert (late.outcome, [r.code for r in late.reasons]) == (Outcome.REQUIRE_APPROVAL, ["deploy.outside_hours"])
    staging = engine.evaluate(call(deploy, environment={"name": "staging"}, now="2026-11-23T23:00:00Z"))
    assert staging.outcome is Outcome.ALLOW  # the guard is about production only


def test_the_shipped_policy_labels_no_session() -> None:
    engine = EmbeddedEngine(PolicySettings(dir=REPO / "policies"))
    for caps in (["reads_private"], ["reads_untrusted"], ["executes_code"], []):
        decision = engine.evaluate(call({"name": "t", "capabilities": caps}))
        assert (decision.outcome, decision.obligations.session_labels) == (Outcome.ALLOW, [])

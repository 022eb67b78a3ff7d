"""`stockade policy`: the security team's commands (test, eval, explain, check, reload, replay).

Exit codes: 0 success; 1 the thing checked failed (a Rego test, a check, a replay gate); 2 bad
usage or input that could not be read (a policy that does not load, an unreadable file).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from policy import EmbeddedEngine, PolicyBundleError, PolicyInput, PolicySettings, RegoTestResult, run_rego_tests
from policy.tooling import check, coverage, explain
from router.interfaces.cli_common import JsonFlag, PolicyDir, emit_json, err, fail, out, settings_of
from router.interfaces.replay_cli import policy_replay

policy_app = typer.Typer(help="Test and evaluate the Rego policies.", no_args_is_help=True)


def _policysettings_of(ctx: typer.Context, directory: Path | None) -> PolicySettings:
    base = settings_of(ctx).policy
    return base.model_copy(update={"dir": directory}) if directory else base


InputFile = Annotated[Path, typer.Option("--input", "-i", help="JSON file holding a PolicyInput ('-' for stdin).")]


def _read_input(path: Path) -> PolicyInput:
    raw = sys.stdin.read() if str(path) == "-" else path.read_text()
    try:
        return PolicyInput.model_validate_json(raw)
    except ValueError as exc:
        raise fail(f"{path} is not a valid PolicyInput: {exc}") from exc


@policy_app.command("test")
def policy_test(
    ctx: typer.Context,
    directory: PolicyDir = None,
    with_coverage: Annotated[bool, typer.Option("--coverage", help="Also report line coverage per file.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Run every test_* rule in *_test.rego under the policy directory and decide every input a
    test feeds with `with input as` on the compiled RVM path too; exit 1 if any test fails or
    the two engines decide an input differently."""
    settings = _policysettings_of(ctx, directory)
    try:
        results = run_rego_tests(settings.dir, max_bytes=settings.max_policy_bytes, entrypoint=settings.entrypoint)
        covered = coverage(settings.dir) if with_coverage else []
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    failed = [r for r in results if not r.passed]
    if as_json:
        document: dict[str, Any] = {"tests": [_test_json(r) for r in results]}
        if with_coverage:
            document["coverage"] = [{"file": c.file, "percent": round(c.percent, 1), "not_covered": c.not_covered}
                                    for c in covered]  # fmt: skip
        emit_json(document if with_coverage else document["tests"])
    else:
        for r in results:
            mark = "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]"
            out.print(f"{mark} {r.file}::{r.name} ({r.duration_ms:.2f} ms{_rvm_summary(r)})")
            if r.error:
                out.print(f"     {r.error.splitlines()[-1] if r.error.splitlines() else r.error}", markup=False)
            elif r.disagreements and r.interpreter_passed:
                out.print("     passes on the interpreter, but the RVM decides differently:")
            for d in r.disagreements:
                out.print(f"     RVM disagrees at {d.describe()}", markup=False)
            for reason in r.not_replayed:
                out.print(f"     not replayed on the RVM: {reason}", markup=False)
        for c in covered:
            missing = f" (not covered: lines {', '.join(map(str, c.not_covered))})" if c.not_covered else ""
            out.print(f"coverage {c.file}: {c.percent:.1f}%{missing}")
        replayed = [r for r in results if r.replayed]
        disagreeing = [r for r in results if r.disagreements]
        not_replayed = [r for r in results if r.not_replayed]
        no_input = [r for r in results if not (r.replayed or r.disagreements or r.not_replayed)]
        out.print(
            f"{len(results) - len(failed)} passed, {len(failed)} failed; "
            f"{len(replayed)} replayed on the RVM ({sum(r.replayed for r in results)} inputs), "
            f"{len(disagreeing)} disagree, {len(not_replayed)} not (fully) replayed, {len(no_input)} fed no input"
        )
    if not results:
        raise fail(f"no test_* rules found in *_test.rego under {settings.dir}", 1)
    raise typer.Exit(1 if failed else 0)


def _rvm_summary(result: RegoTestResult) -> str:
    if result.disagreements:
        return f"; RVM disagrees on {len(result.disagreements)} of {result.replayed} inputs"
    if result.replayed:
        return f"; RVM agrees on {result.replayed} input{'s' if result.replayed > 1 else ''}"
    return "; not replayed on the RVM" if result.not_replayed else ""


def _test_json(result: RegoTestResult) -> dict[str, Any]:
    """A test for `policy test --json`; "rvm" only for a test that fed the decision an input."""
    entry: dict[str, Any] = {"file": result.file, "test": result.name, "passed": result.passed,
                             "ms": result.duration_ms, "error": result.error}  # fmt: skip
    if result.replayed or result.disagreements or result.not_replayed:
        entry["rvm"] = {
            "replayed": result.replayed,
            "disagreements": [dataclasses.asdict(d) for d in result.disagreements],
            "not_replayed": list(result.not_replayed),
        }
    return entry


@policy_app.command("eval")
def policy_eval(ctx: typer.Context, input_file: InputFile, directory: PolicyDir = None) -> None:
    """Evaluate the decision for one input on the compiled path and print it as JSON."""
    policy_input = _read_input(input_file)
    try:
        engine = EmbeddedEngine(_policysettings_of(ctx, directory))
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    emit_json(engine.evaluate(policy_input).model_dump(mode="json"))


@policy_app.command("explain")
def policy_explain(
    ctx: typer.Context, input_file: InputFile, directory: PolicyDir = None, as_json: JsonFlag = False
) -> None:
    """Show the decision for one input, where in the policy each reason comes from, and the
    helper rules it rests on."""
    policy_input = _read_input(input_file)
    try:
        why = explain(_policysettings_of(ctx, directory).dir, policy_input)
    except (PolicyBundleError, RuntimeError) as exc:
        raise fail(str(exc).strip()) from exc
    if as_json:
        emit_json({"decision": why.decision, "reasons": why.reasons, "helpers": why.helpers})
        return
    outcome = why.decision.get("outcome") if isinstance(why.decision, dict) else None
    out.print(f"outcome: [bold]{outcome}[/bold]")
    for reason in why.reasons:
        out.print(f"  {reason.get('code')}: {reason.get('message')}  ({', '.join(reason['defined_at']) or '?'})",
                  markup=False)  # fmt: skip
    out.print("helper rules:")
    for name, value in why.helpers.items():
        out.print(f"  {name} = {json.dumps(value)}", markup=False)


@policy_app.command("check")
def policy_check(ctx: typer.Context, directory: PolicyDir = None) -> None:
    """Parse and compile every rule; name builtins regorus lacks. Exit 1 on any problem."""
    root = _policysettings_of(ctx, directory).dir
    problems = check(root)
    for problem in problems:
        err.print(f"[red]problem:[/red] {problem}", markup=True)
    if not problems:
        out.print(f"[green]OK[/green] {root}: parses, compiles, and uses only builtins regorus provides")
    raise typer.Exit(1 if problems else 0)


@policy_app.command("reload")
def policy_reload(
    token: Annotated[
        str,
        typer.Option(
            envvar="STOCKADE_API_TOKEN", show_default=False, help="An admin's bearer token (or STOCKADE_API_TOKEN)."
        ),
    ],
    url: Annotated[str, typer.Option(help="The running router's base URL.")] = "http://127.0.0.1:8080",
    as_json: JsonFlag = False,
) -> None:
    """Make a running router reload its policy directory now (audited, with source "cli").
    Exit 1 if the router refused (files that do not load: the old policy stays; a token that is not
    an admin's), 2 if it cannot be reached."""
    try:
        response = httpx.post(f"{url.rstrip('/')}/v1/policy/reload", params={"source": "cli"},
                              headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip
    except httpx.HTTPError as exc:
        raise fail(f"cannot reach the router at {url}: {exc}") from exc
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {"detail": response.text[:500]}
    if as_json:
        emit_json({"status": response.status_code, **body})
    elif response.is_success:
        out.print(f"[green]reloaded[/green] revision {body.get('revision', '?')}", markup=True)
    else:
        err.print(f"[red]refused ({response.status_code}):[/red] {body.get('detail', '')}", markup=True)
    raise typer.Exit(0 if response.is_success else 1)


policy_app.command("replay")(policy_replay)

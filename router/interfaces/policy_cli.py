"""`stockade policy`: the security team's commands (test, eval, explain, check, bench, new, reload,
replay).

Exit codes: 0 success; 1 the thing checked failed (a Rego test, a coverage threshold, a check,
`eval --fail`, a replay gate); 2 bad usage or input that could not be read (a policy that does
not load, an unreadable file, a bad option). Policy text (rules, values, messages) is printed
without console markup, so ``[arg]`` in a snippet shows as written.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from router.interfaces.bundle_cli import policy_build, policy_verify_bundle
from router.interfaces.cli_common import (
    JsonFlag,
    PolicyDir,
    emit_json,
    err,
    fail,
    out,
    read_capped,
    settings_of,
    tool_specs,
)
from router.interfaces.replay_cli import policy_replay

# The engines, the checker and the tooling are imported by the commands that use them: every
# `stockade` command builds this group, and most never evaluate a policy.
if TYPE_CHECKING:
    from policy import PolicyInput, RegoTestResult
    from policy.config import PolicySettings
    from policy.tooling import BenchReport, FileCoverage, Latency

policy_app = typer.Typer(help="Test and evaluate the Rego policies.", no_args_is_help=True)

_WATCH_INTERVAL_S = 0.3  # how often --watch looks at the files' mtimes and sizes


def policy_settings(ctx: typer.Context, directory: Path | None) -> PolicySettings:
    base = settings_of(ctx).policy
    return base.model_copy(update={"dir": directory}) if directory else base


InputFile = Annotated[Path, typer.Option("--input", "-i", help="JSON file holding a PolicyInput ('-' for stdin).")]


def _read_input(path: Path) -> PolicyInput:
    from policy import PolicyInput  # noqa: PLC0415

    raw = read_capped(path, "--input")
    try:
        return PolicyInput.model_validate_json(raw)
    except ValueError as exc:
        raise fail(f"{path} is not a valid PolicyInput: {exc}") from exc


def _plain(text: str, style: str = "") -> Text:
    """Policy text for the console: never read as markup."""
    return Text(text, style=style)


@dataclasses.dataclass(frozen=True, slots=True)
class _TestOptions:
    """What one `policy test` run does (also each run of `--watch`)."""

    settings: PolicySettings
    select: re.Pattern[str] | None
    verbose: bool
    coverage: bool
    threshold: float | None
    as_json: bool


@policy_app.command("test")
def policy_test(
    ctx: typer.Context,
    directory: PolicyDir = None,
    run: Annotated[
        str | None,
        typer.Option("--run", "-r", help="Run only tests whose data.<pkg>.<name> or file::name matches this regex."),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Every test's time, prints and RVM replay, passing ones too.")
    ] = False,
    with_coverage: Annotated[bool, typer.Option("--coverage", help="Also report line coverage per file.")] = False,
    threshold: Annotated[
        float | None,
        typer.Option("--threshold", min=0, max=100, help="Exit 1 if total coverage is under this percent."),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Run again whenever a policy file changes.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Run every test_* rule in *_test.rego under the policy directory and decide every input a
    test feeds with `with input as` on the compiled RVM path too; exit 1 if any test fails, the
    two engines decide an input differently, or coverage is under --threshold."""
    try:
        select = re.compile(run) if run is not None else None
    except re.error as exc:
        raise fail(f"--run {run!r} is not a regular expression: {exc}") from exc
    options = _TestOptions(policy_settings(ctx, directory), select, verbose,
                           with_coverage or threshold is not None, threshold, as_json)  # fmt: skip
    if not watch:
        raise typer.Exit(_test_once(options))
    _watch(options)


def _test_once(options: _TestOptions) -> int:
    """One run of the tests, printed; its exit code."""
    from policy import PolicyBundleError, run_rego_tests  # noqa: PLC0415
    from policy.tooling import coverage, total_percent  # noqa: PLC0415

    settings = options.settings
    try:
        results = run_rego_tests(settings.dir, max_bytes=settings.max_policy_bytes, entrypoint=settings.entrypoint,
                                 select=options.select)  # fmt: skip
        covered = coverage(settings.dir, max_bytes=settings.max_policy_bytes, select=options.select) \
            if options.coverage else []  # fmt: skip
    except PolicyBundleError as exc:
        err.print(Text.assemble(("error: ", "red"), str(exc)))
        return 2
    failed = [r for r in results if not r.passed]
    total = total_percent(covered)
    under = options.threshold is not None and total < options.threshold
    if options.as_json:
        document: dict[str, Any] = {"tests": [_test_json(r) for r in results]}
        if options.coverage:
            document["coverage"] = [{"file": c.file, "percent": round(c.percent, 1), "not_covered": c.not_covered}
                                    for c in covered]  # fmt: skip
            document["coverage_percent"] = round(total, 1)
            document["threshold"] = options.threshold
        emit_json(document if options.coverage else document["tests"])
    else:
        for r in results:
            _print_test(r, options.verbose)
        _print_coverage(covered, total, options.threshold)
        _print_summary(results, failed)
    if not results:
        what = f"matching {options.select.pattern!r} " if options.select else ""
        err.print(Text(f"error: no test_* rules {what}found in *_test.rego under {settings.dir}"))
        return 1
    return 1 if failed or under else 0


def _print_test(r: RegoTestResult, verbose: bool) -> None:
    if r.passed:
        header = Text.assemble(("PASS", "green"), f" {r.file}::{r.name}")
        if verbose:
            header.append(f" ({r.duration_ms:.2f} ms{_rvm_summary(r)})")
        out.print(header)
    else:
        out.print(Text.assemble(("FAIL", "red"), f" {r.file}::{r.name} ({r.duration_ms:.2f} ms{_rvm_summary(r)})"))
    if r.error:
        for line in r.error.splitlines():
            out.print(_plain(f"     {line}"))
    elif r.failure is not None:
        for line in r.failure.describe():
            out.print(_plain(f"     {line}"))
    elif not r.passed and not r.disagreements:
        out.print(_plain("     the test is undefined; no single statement of it could be shown failing"))
    if r.disagreements and r.interpreter_passed:
        out.print("     passes on the interpreter, but the RVM decides differently:")
    for d in r.disagreements:
        out.print(_plain(f"     RVM disagrees at {d.describe()}"))
    for reason in r.not_replayed:
        out.print(_plain(f"     not replayed on the RVM: {reason}"))
    if r.prints and (verbose or not r.passed):
        out.print(_plain(f"     print() output of {r.name}:"))
        for printed in r.prints:
            out.print(_plain(f"       {printed}"))


def _print_coverage(covered: list[FileCoverage], total: float, threshold: float | None) -> None:
    for c in covered:
        missing = f" (not covered: lines {', '.join(map(str, c.not_covered))})" if c.not_covered else ""
        out.print(_plain(f"coverage {c.file}: {c.percent:.1f}%{missing}"))
    if covered or threshold is not None:
        verdict = ""
        if threshold is not None:
            verdict = f", under the threshold of {threshold:g}%" if total < threshold else f", at least {threshold:g}%"
        out.print(_plain(f"coverage total: {total:.1f}%{verdict}"))


def _print_summary(results: list[RegoTestResult], failed: list[RegoTestResult]) -> None:
    replayed = [r for r in results if r.replayed]
    disagreeing = [r for r in results if r.disagreements]
    not_replayed = [r for r in results if r.not_replayed]
    no_input = [r for r in results if not (r.replayed or r.disagreements or r.not_replayed)]
    out.print(
        f"{len(results) - len(failed)} passed, {len(failed)} failed; "
        f"{len(replayed)} replayed on the RVM ({sum(r.replayed for r in results)} inputs), "
        f"{len(disagreeing)} disagree, {len(not_replayed)} not (fully) replayed, {len(no_input)} fed no input"
    )


def _watch(options: _TestOptions) -> None:
    """Run the tests, then again each time a policy file changes, until Ctrl-C (exit 0)."""
    from policy.bundle import fingerprint  # noqa: PLC0415

    root = options.settings.dir
    try:
        seen = fingerprint(root)
        _test_once(options)
        while True:
            out.print(_plain(f"watching {root} for changes (Ctrl-C to stop)"), style="dim")
            sys.stdout.flush()
            while (now := fingerprint(root)) == seen:
                time.sleep(_WATCH_INTERVAL_S)
            # Run once the files stop changing: an editor (or a script) writes a file in steps
            # (truncate, then write), and tests run on a half-written file fail for nothing.
            time.sleep(_WATCH_INTERVAL_S)
            while (settled := fingerprint(root)) != now:
                now = settled
                time.sleep(_WATCH_INTERVAL_S)
            changed = sorted({entry[0] for entry in set(now) ^ set(seen)})
            seen = now
            out.print(_plain(f"\nchanged: {', '.join(changed)}; running the tests again"))
            _test_once(options)
    except KeyboardInterrupt:
        sys.stdout.flush()
        raise typer.Exit(0) from None


def _rvm_summary(result: RegoTestResult) -> str:
    if result.disagreements:
        return f"; RVM disagrees on {len(result.disagreements)} of {result.replayed} inputs"
    if result.replayed:
        return f"; RVM agrees on {result.replayed} input{'s' if result.replayed > 1 else ''}"
    return "; not replayed on the RVM" if result.not_replayed else ""


def _test_json(result: RegoTestResult) -> dict[str, Any]:
    """A test for `policy test --json`; "rvm" only for a test that fed the decision an input,
    "failure" only for one that was undefined or false, "prints" only if it printed."""
    entry: dict[str, Any] = {"file": result.file, "test": result.name, "passed": result.passed,
                             "ms": result.duration_ms, "error": result.error}  # fmt: skip
    if result.failure is not None:
        entry["failure"] = result.failure.as_json()
    if result.prints:
        entry["prints"] = list(result.prints)
    if result.replayed or result.disagreements or result.not_replayed:
        entry["rvm"] = {
            "replayed": result.replayed,
            "disagreements": [dataclasses.asdict(d) for d in result.disagreements],
            "not_replayed": list(result.not_replayed),
        }
    return entry


@policy_app.command("eval")
def policy_eval(
    ctx: typer.Context,
    rule: Annotated[
        str | None,
        typer.Argument(help="A rule to evaluate (data.stockade.deny_reasons, or deny_reasons); default: the decision."),
    ] = None,
    input_file: Annotated[
        Path | None, typer.Option("--input", "-i", help="JSON file holding a PolicyInput ('-' for stdin).")
    ] = None,
    query: Annotated[str | None, typer.Option("--query", "-q", help="The rule to evaluate (as RULE).")] = None,
    directory: PolicyDir = None,
    fail_undefined: Annotated[bool, typer.Option("--fail", help="Exit 1 if the result is undefined.")] = False,
    fail_defined: Annotated[bool, typer.Option("--fail-defined", help="Exit 1 if the result is defined.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help='Print {"query", "defined", "result", ...} instead of the bare value.')
    ] = False,
) -> None:
    """Evaluate the decision for one input as production does (the compiled RVM, confirmed on the
    interpreter) and print it as JSON; or, given a rule, that rule on the RVM compiled for it
    and on the interpreter (exit 2 if they disagree or raise)."""
    from policy import EmbeddedEngine, PolicyBundleError  # noqa: PLC0415
    from policy.tooling import evaluate_rule, rule_path  # noqa: PLC0415

    if rule is not None and query is not None:
        raise fail("give the rule either as an argument or with --query, not both")
    if fail_undefined and fail_defined:
        raise fail("--fail and --fail-defined exclude each other")
    settings = policy_settings(ctx, directory)
    policy_input = _read_input(input_file) if input_file is not None else None
    wanted = rule or query
    try:
        path = rule_path(wanted, settings.entrypoint) if wanted is not None else settings.entrypoint
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if path == settings.entrypoint:
        if policy_input is None:
            raise fail("the decision needs an input: pass --input FILE (or - for stdin)")
        try:
            engine = EmbeddedEngine(settings)
        except PolicyBundleError as exc:
            raise fail(str(exc)) from exc
        decision = engine.evaluate(policy_input).model_dump(mode="json")
        emit_json({"query": path, "defined": True, "result": decision} if as_json else decision)
        raise typer.Exit(1 if fail_defined else 0)
    try:
        value = evaluate_rule(settings.dir, path, policy_input, max_bytes=settings.max_policy_bytes)
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    if value.interpreter_error is not None or value.rvm_error is not None or not value.agree:
        err.print(Text.assemble(("error: ", "red"), f"{path} cannot be relied on for this input:"))
        err.print(_plain(f"  RVM: {_shown(value.rvm, value.rvm_error)}"))
        err.print(_plain(f"  interpreter: {_shown(value.value, value.interpreter_error)}"))
        if as_json:
            emit_json({"query": path, "defined": False, "result": None, "rvm": value.rvm, "rvm_error": value.rvm_error,
                       "interpreter": value.value, "interpreter_error": value.interpreter_error})  # fmt: skip
        raise typer.Exit(2)
    if as_json:
        emit_json({"query": path, "defined": value.defined, "result": value.value})
    elif value.defined:
        emit_json(value.value)
    else:
        err.print(_plain(f"{path} is undefined for this input"))
    raise typer.Exit(1 if (fail_undefined and not value.defined) or (fail_defined and value.defined) else 0)


def _shown(value: Any, error: str | None) -> str:
    if error is not None:
        return f"error:\n{error}"
    return "undefined" if value is None else json.dumps(value, separators=(",", ":"), sort_keys=True)


@policy_app.command("explain")
def policy_explain(
    ctx: typer.Context, input_file: InputFile, directory: PolicyDir = None, as_json: JsonFlag = False
) -> None:
    """Show the decision for one input as production makes it, where in the policy each reason
    comes from, every rule of the policy's package and, unless it allows, why not."""
    from policy import PolicyBundleError  # noqa: PLC0415
    from policy.tooling import explain  # noqa: PLC0415

    policy_input = _read_input(input_file)
    settings = policy_settings(ctx, directory)
    try:
        why = explain(settings.dir, policy_input, settings.entrypoint, max_bytes=settings.max_policy_bytes)
    except PolicyBundleError as exc:
        raise fail(str(exc).strip()) from exc
    if as_json:
        emit_json(why.as_json())
        return
    out.print(Text.assemble("outcome: ", (str(why.decision["outcome"]), "bold"), " (production path: RVM, confirmed)"))
    if why.interpreter_error is not None:
        out.print("the interpreter raised evaluating the decision:")
        for line in why.interpreter_error.splitlines():
            out.print(_plain(f"  {line}"))
    if why.reasons:
        out.print("reasons:")
    for reason in why.reasons:
        places = ", ".join(reason["defined_at"]) or "not found in the policy (the engine or router set it)"
        out.print(_plain(f"  {reason['code']}: {reason['message']}  ({places})"))
    if why.why_not_allow:
        out.print("why not allow: each rule that would allow, and its first condition that does not hold:")
    for entry in why.why_not_allow:
        failed = entry["failed"]
        if failed is None:
            out.print(_plain(f"  {entry['rule']} at {entry['where']}: every condition holds"))
            continue
        out.print(_plain(f"  {entry['rule']} at {entry['where']}, fails at {failed['where']}: {failed['statement']}"))
        for item in failed["values"]:
            shown = json.dumps(item["value"], separators=(",", ":")) if item["defined"] else "undefined"
            out.print(_plain(f"      {item['operand']} = {shown}"))
    out.print("rules:")
    for name, value in why.rules.items():
        out.print(_plain(f"  {name} = {'undefined' if value is None else json.dumps(value, separators=(',', ':'))}"))
    for name, error in why.rule_errors.items():
        out.print(_plain(f"  {name} raised:"))
        for line in error.splitlines():
            out.print(_plain(f"    {line}"))


ToolsOption = Annotated[
    Path | None,
    typer.Option("--tools", help="Tool specs (a JSON file or a directory of them, as `stockade mcp --tools` takes): "
                 "input.args and input.tool.name are then checked per tool."),
]  # fmt: skip


@policy_app.command("check")
def policy_check(
    ctx: typer.Context,
    directory: PolicyDir = None,
    tools: ToolsOption = None,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail the check too.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Check the policy against what production runs: parse and compile it, refuse builtins regorus
    lacks or stockade refuses (http.send), resolve every input.* and data.* reference against the
    input contract (`stockade policy schema`) and data.json's schema, find type mismatches and
    reason codes missing from the catalog. Each problem with file:line:col. Exit 1 on any error
    (or warning, with --strict; a file of the policy that does not parse or load is an error), 2
    if there is no policy at --dir or the tool specs cannot be read."""
    from policy.check import check_policy  # noqa: PLC0415

    settings = policy_settings(ctx, directory)
    if not settings.dir.exists():  # nothing to check: bad usage, not a finding about a policy
        raise fail(f"--dir {settings.dir}: no policy directory there; pass --dir or set STOCKADE_POLICY__DIR")
    specs = tool_specs(tools) if tools else None
    problems = check_policy(settings.dir, tools=specs, max_bytes=settings.max_policy_bytes)
    errors = [p for p in problems if p.severity == "error"]
    failed = bool(errors) or (strict and bool(problems))
    if as_json:
        emit_json({"ok": not failed, "problems": [p.as_json() for p in problems]})
        raise typer.Exit(1 if failed else 0)
    for problem in problems:
        label = Text("error: ", style="red") if problem.severity == "error" else Text("warning: ", style="yellow")
        err.print(label + Text(str(problem)))
    if not problems:
        out.print(Text(f"OK {settings.dir}: parses, compiles, and every reference, type and reason code checks"))
    else:
        summary = f"{len(errors)} error(s), {len(problems) - len(errors)} warning(s)"
        (err if failed else out).print(Text(summary))
    raise typer.Exit(1 if failed else 0)


@policy_app.command("schema")
def policy_schema(
    ctx: typer.Context,
    data: Annotated[
        bool, typer.Option("--data", help="The schema of data.json instead of the input contract.")
    ] = False,
    directory: PolicyDir = None,
    tools: ToolsOption = None,
) -> None:
    """Print the input contract (JSON Schema of `input`, generated from the router's PolicyInput and
    refined per tool with --tools), or with --data the schema of the policy's data.json: for
    editors, `opa check --schema`, and reviewers."""
    from policy import PolicyBundleError  # noqa: PLC0415
    from policy.bundle import load_bundle  # noqa: PLC0415
    from policy.schema import data_schema, input_schema  # noqa: PLC0415

    if data:
        settings = policy_settings(ctx, directory)
        try:
            bundle = load_bundle(settings.dir, max_bytes=settings.max_policy_bytes)
        except PolicyBundleError as exc:
            raise fail(str(exc)) from exc
        emit_json(data_schema(bundle))
        return
    emit_json(input_schema(tool_specs(tools) if tools else None))


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
    import httpx  # noqa: PLC0415

    # Checked here, not left to the HTTP library: its errors would print the header, token and all.
    if not token.isascii() or not token.isprintable() or " " in token:
        raise fail("--token is not a bearer token: printable ASCII without spaces, as `stockade api-token` prints")
    try:
        response = httpx.post(f"{url.rstrip('/')}/v1/policy/reload", params={"source": "cli"},
                              headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip
    except httpx.InvalidURL as exc:
        raise fail(f"--url {url!r} is not a URL the router can be reached at: {exc}") from exc
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


@policy_app.command("bench")
def policy_bench(
    ctx: typer.Context,
    directory: PolicyDir = None,
    inputs: Annotated[
        list[Path] | None,
        typer.Option("--input", "-i", help="A PolicyInput JSON file to decide (repeatable); default: built-in calls."),
    ] = None,
    iterations: Annotated[int, typer.Option("--iterations", "-n", min=1, help="Rounds over the inputs.")] = 200,
    as_json: JsonFlag = False,
) -> None:
    """Decision latency (p50/p99, µs) of the whole policy on the production path, of a one-rule
    policy on the same path (the baseline), and of each rule area (one .rego file's rules)."""
    from policy import PolicyBundleError  # noqa: PLC0415
    from policy.tooling import bench  # noqa: PLC0415

    settings = policy_settings(ctx, directory)
    chosen = {path.name: _read_input(path) for path in inputs} if inputs else None
    try:
        report = bench(settings.dir, chosen, iterations=iterations, entrypoint=settings.entrypoint,
                       max_bytes=settings.max_policy_bytes)  # fmt: skip
    except PolicyBundleError as exc:
        raise fail(str(exc)) from exc
    if as_json:
        emit_json(report.as_json())
        return
    print_bench(report)


def print_bench(report: BenchReport) -> None:
    """The bench report as a table (also what bench/policy_areas.py prints)."""
    out.print(_plain(f"inputs: {', '.join(f'{name} ({report.outcomes[name]})' for name in report.inputs)}"))
    out.print(_plain(f"  {'':44} {'n':>7} {'p50 µs':>10} {'p99 µs':>10} {'mean µs':>10}"))
    for row in (report.decision, report.baseline):
        out.print(_plain(_bench_row(row)))
    out.print("rule areas (each file's rules as entry points of an RVM program of their own):")
    for row in report.areas:
        out.print(_plain(_bench_row(row, "  ")))


def _bench_row(row: Latency, indent: str = "") -> str:
    if row.error is not None:
        return f"  {indent}{row.name:{44 - len(indent)}} not measured: {row.error}"
    return (f"  {indent}{row.name:{44 - len(indent)}} {row.n:>7} {row.p50_us:>10.1f} {row.p99_us:>10.1f} "
            f"{row.mean_us:>10.1f}")  # fmt: skip


@policy_app.command("new")
def policy_new(
    ctx: typer.Context,
    area: Annotated[str, typer.Argument(help="The rule area's name, e.g. deploy_guard.")],
    directory: PolicyDir = None,
    create: Annotated[
        bool,
        typer.Option(
            "--create", help="Scaffold into --dir even if it is not a policy directory yet (made if missing)."
        ),
    ] = False,
) -> None:
    """Scaffold a rule area: stockade/AREA.rego (a rule adding to deny_reasons, with METADATA) and
    AREA_test.rego (tests that pass as written), and the reason code's catalog entry (added to
    stockade/reasons/data.json if it exists, else printed). The directory must be a policy
    directory (one with stockade/decision.rego) unless --create is given. Never overwrites: exit 2
    if a file exists or the directory is not a policy directory."""
    from policy.tooling import new_area  # noqa: PLC0415

    root = policy_settings(ctx, directory).dir
    if not create and not (root / "stockade" / "decision.rego").is_file():
        # A mistyped --dir would otherwise grow a policy tree wherever it points.
        raise fail(f"--dir {root} is not a policy directory (no stockade/decision.rego); pass the one to add the "
                   "area to, or --create to start one there")  # fmt: skip
    try:
        made = new_area(root, area)
    except (ValueError, FileExistsError) as exc:
        raise fail(str(exc)) from exc
    out.print(_plain(f"created {made.rule_file}"))
    out.print(_plain(f"created {made.test_file}"))
    if made.catalog is not None:
        out.print(_plain(f"added {made.code} to {made.catalog}"))
    else:
        out.print(_plain(f"add this entry to {root / 'stockade' / 'reasons' / 'data.json'} (the reason catalog):"))
        out.print(_plain(json.dumps({made.code: made.entry}, indent=2)))
    out.print(_plain(f"then: stockade policy test --dir {root} -r {area}"))


policy_app.command("replay")(policy_replay)
policy_app.command("build")(policy_build)
policy_app.command("verify-bundle")(policy_verify_bundle)

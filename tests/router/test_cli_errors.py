"""What the ``stockade`` command does with input it cannot use and with its own failures: a real
process, real files, and exit codes a script can tell apart (0 done, 1 the check failed, 2 bad
input or usage, 70 an internal error), each with one line on stderr that names the thing."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from router.audit import AuditEvent, JsonlAuditLog, timestamp
from tests.conftest import REPO

STOCKADE = str(Path(sys.executable).parent / "stockade")
DEEP = '{"a":' * 3000  # past the JSON parser's recursion limit


def run(*args: str, env: dict[str, str] | None = None, limit_memory: bool = False) -> subprocess.CompletedProcess[str]:
    def cap() -> None:  # a runaway read fails fast here instead of taking the test machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([STOCKADE, *args], capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **(env or {})}, preexec_fn=cap if limit_memory else None)  # fmt: skip


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The error a command printed, asserting it is one line and no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def audit_log(tmp_path: Path) -> Path:
    """A short audit log whose tool name holds terminal control characters (an agent's choice)."""
    path = tmp_path / "audit.jsonl"

    async def write() -> None:
        log = JsonlAuditLog(path)
        for i in range(2):
            await log.append(AuditEvent(kind="decision", decision_id=f"d-{i}", timestamp=timestamp(),
                                        tool="\x1b[2J\x07evil", outcome="allow"))  # fmt: skip
        await log.aclose()

    asyncio.run(write())
    return path


# -- an error no command expected -----------------------------------------------------------

RAISING = """\
import sys
from router.interfaces.cli import app

@app.command("explode")
def explode() -> None:
    raise RuntimeError("something\\nbroke")

sys.argv = ["stockade", *sys.argv[1:]]
app()
"""


def test_an_exception_no_command_expected_is_one_line_and_exit_70(tmp_path: Path) -> None:
    """Not exit 1 (a script reads it as "the check failed") and not a traceback; --debug shows it."""
    script = tmp_path / "cli.py"
    script.write_text(RAISING)
    done = subprocess.run([sys.executable, str(script), "explode"], capture_output=True, text=True, cwd=REPO,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 70, done.stderr
    said = one_error_line(done)
    assert said.startswith("error: internal error: RuntimeError: something broke")
    assert "--debug" in said
    debug = subprocess.run([sys.executable, str(script), "--debug", "explode"], capture_output=True, text=True,
                           cwd=REPO, timeout=120, check=False)  # fmt: skip
    assert debug.returncode == 70
    assert "Traceback (most recent call last)" in debug.stderr
    assert 'raise RuntimeError("something\\nbroke")' in debug.stderr


# -- unreadable input is bad input (2), named -------------------------------------------------


def test_a_directory_given_as_the_audit_log_is_bad_input(tmp_path: Path) -> None:
    result = run("audit", "verify", "--path", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path} is a directory, not an audit log" in one_error_line(result)


def test_checkpoints_that_are_a_subdirectory_or_none_at_all_are_bad_input(audit_log: Path, tmp_path: Path) -> None:
    """A kept-checkpoints directory holding a directory named like a checkpoint, or nothing: an
    "OK" would vouch for checkpoints never read."""
    odd = tmp_path / "odd"
    (odd / "12.json").mkdir(parents=True)
    result = run("audit", "verify", "--path", str(audit_log), "--checkpoint", str(odd))
    assert result.returncode == 2, result.stderr
    assert f"--checkpoint {odd}: holds something that is not a readable stockade checkpoint" in one_error_line(result)

    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("audit", "verify", "--path", str(audit_log), "--checkpoint", str(empty))
    assert result.returncode == 2, result.stderr
    assert f"--checkpoint {empty}: holds no checkpoint" in one_error_line(result)


@pytest.mark.parametrize(
    "args",
    [
        ["policy", "check", "--tools", "{deep}"],
        ["policy", "schema", "--tools", "{deep}"],
        ["serve", "--tools", "{deep}"],
        ["mcp", "--agent", "a", "--principal", "p", "--tools", "{deep}"],
        ["policy", "replay", "--policy", "{policies}", "--baseline", "{policies}", "--path", "{log}", "--accept",
         "{deep}"],
    ],
)  # fmt: skip
def test_json_nested_past_the_parser_is_bad_input(args: list[str], audit_log: Path, tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    filled = [arg.format(deep=deep, policies=REPO / "policies", log=audit_log) for arg in args]
    result = run(*filled)
    assert result.returncode == 2, result.stderr
    assert "nest" in one_error_line(result)
    assert "too deeply" in result.stderr


def test_an_endless_input_file_is_refused_at_the_size_cap(tmp_path: Path) -> None:
    result = run("policy", "eval", "--input", "/dev/zero", limit_memory=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--input /dev/zero: larger than 16 MiB" in one_error_line(result)


# -- JSON and CSV output ----------------------------------------------------------------------


def test_sql_json_prints_non_finite_numbers_as_null(audit_log: Path) -> None:
    statement = "SELECT 'nan'::DOUBLE AS x, 'inf'::DOUBLE AS y, 1.5 AS z FROM events LIMIT 1"
    result = run("audit", "sql", "--path", str(audit_log), statement, "--json")
    assert result.returncode == 0, result.stderr

    def strict(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    assert json.loads(result.stdout, parse_constant=strict) == {"x": None, "y": None, "z": 1.5}


def test_sql_answers_with_time_zone_aware_timestamps(audit_log: Path) -> None:
    """DuckDB's Python client reads TIMESTAMPTZ values through pytz, which the install lacked: any
    answer holding one (``now()``, a cast of ``timestamp``) failed with a traceback."""
    statement = "SELECT max(timestamp)::TIMESTAMPTZ AS last, now() AS asked FROM events"
    result = run("audit", "sql", "--path", str(audit_log), statement, "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert set(answer) == {"last", "asked"}
    assert answer["last"].startswith("20")


def test_sql_csv_shows_control_characters_on_a_terminal_and_writes_them_piped(audit_log: Path) -> None:
    statement = "SELECT tool FROM events LIMIT 1"
    piped = run("audit", "sql", "--path", str(audit_log), statement, "--csv")
    assert piped.stdout.splitlines() == ["tool", "\x1b[2J\x07evil"]

    leader, follower = pty.openpty()
    try:
        done = subprocess.run([STOCKADE, "audit", "sql", "--path", str(audit_log), statement, "--csv"],
                              stdout=follower, stderr=subprocess.PIPE, timeout=120, check=False)  # fmt: skip
        os.close(follower)
        shown = b""
        while chunk := _read(leader):
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0, done.stderr
    text = shown.decode()
    assert "\x1b" not in text
    assert "\x07" not in text
    assert "\u241b[2J\u2407evil" in text


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the terminal's other end closed: all read
        return b""


# -- exit codes as documented -----------------------------------------------------------------


def test_a_policy_directory_that_is_not_there_is_bad_usage(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    result = run("policy", "check", "--json", "--dir", str(nowhere))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--dir {nowhere}: no policy directory there" in one_error_line(result)

    result = run("policy", "verify-bundle", str(nowhere))
    assert result.returncode == 2, result.stderr
    said = one_error_line(result)
    assert f"BUNDLE {nowhere}: no such file" in said
    assert "STOCKADE_POLICY__DIR" not in said


def test_a_tools_directory_with_no_specs_is_bad_input(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("no specs here")
    result = run("policy", "check", "--tools", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--tools {tmp_path}: the directory holds no *.json tool specs" in one_error_line(result)


def test_new_scaffolds_only_into_a_policy_directory_unless_asked_to_create_one(tmp_path: Path) -> None:
    elsewhere = tmp_path / "typo" / "policies"
    result = run("policy", "new", "deploy_guard", "--dir", str(elsewhere))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is not a policy directory (no stockade/decision.rego)" in one_error_line(result)
    assert not (tmp_path / "typo").exists()

    made = run("policy", "new", "deploy_guard", "--dir", str(elsewhere), "--create")
    assert made.returncode == 0, made.stderr
    assert (elsewhere / "stockade" / "deploy_guard.rego").is_file()


def test_a_setting_that_is_not_json_is_named_by_its_variable(audit_log: Path) -> None:
    result = run("audit", "verify", env={"STOCKADE_AUDIT__PATH": str(audit_log), "STOCKADE_AUDIT__MASK": "[{bad"})
    assert result.returncode == 2, result.stderr
    assert "invalid settings: STOCKADE_AUDIT__MASK is not valid JSON" in one_error_line(result)


def test_two_principals_with_one_token_are_refused_naming_both(tmp_path: Path) -> None:
    """A copied entry once made an agent's token an admin's (the entry matched last won), silently."""
    shared = "a" * 64
    principals = [{"name": "agent-1", "role": "agent", "token_sha256": shared},
                  {"name": "root", "role": "admin", "token_sha256": shared}]  # fmt: skip
    result = run("serve", "--port", "1", env={"STOCKADE_API_PRINCIPALS": json.dumps(principals),
                                               "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl")})  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert "entries 0 (agent-1, agent) and 1 (root, admin) have the same token_sha256" in line, line


@pytest.mark.parametrize(
    ("names", "said"),
    [(["gh-a", "gh.a"], "the same sandbox variable STOCKADE_CREDENTIAL_GH_A"), (["gh", "gh"], "the same name")],
)
def test_two_credentials_with_one_sandbox_variable_are_refused_naming_both(
    tmp_path: Path, names: list[str], said: str
) -> None:
    """``gh-a`` and ``gh.a`` were both accepted; a call granted both saw one placeholder in
    ``STOCKADE_CREDENTIAL_GH_A``, whichever lease was written last, with nothing said."""
    credentials = [{"name": name, "kind": "token", "hosts": ["api.example.com"]} for name in names]
    result = run("serve", "--port", "1", env={"STOCKADE_CREDENTIALS": json.dumps(credentials),
                                               "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl")})  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert f"STOCKADE_CREDENTIALS entries {names[0]!r} and {names[1]!r} have {said}" in line, line


@pytest.mark.parametrize(("args", "said"), [
    (["--token", "t\u00f6k"], "--token is not a bearer token"),
    (["--token", "secret-tok\n"], "--token is not a bearer token"),
    (["--token", "secret-tok", "--url", "http://[::1"], "is not a URL the router can be reached at"),
])  # fmt: skip
def test_policy_reload_refuses_a_token_or_url_it_cannot_send_without_echoing_the_token(
    args: list[str], said: str
) -> None:
    """A non-ASCII token or a bad URL ended in an internal error (exit 70); a token with a newline
    was reported as an unreachable router, with the token on stderr."""
    result = run("policy", "reload", *args)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert said in line, line
    assert "secret" not in result.stderr


@pytest.mark.parametrize("command", [["serve"], ["mcp", "--http", "--agent", "a", "--principal", "p"]])
def test_a_port_in_use_is_bad_usage_naming_it(command: list[str], tmp_path: Path) -> None:
    """uvicorn's own exit (3, which `stockade` gives another meaning) and its log line were all a
    busy port got."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        result = run(*command, "--port", port, env={"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl")})
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize(("args", "field"), [(["--agent", "", "--principal", "p"], "agent"),
                                             (["--agent", "a", "--principal", "\x1b[2J"], "principal")])  # fmt: skip
def test_mcp_refuses_an_agent_or_principal_no_session_can_have_at_start(
    args: list[str], field: str, tmp_path: Path
) -> None:
    """It started, and then failed every request with a traceback on stderr, and exited 0."""
    result = run("mcp", *args, env={"STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl")})
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert f"{field} must be a non-empty printable string" in line, line

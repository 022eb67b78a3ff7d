"""Logging when stockade is embedded: nothing on stdout, redacted events on stderr at
STOCKADE_LOG_LEVEL, unless the application configured structlog itself (then its configuration holds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ECHO, REPO, python_tool

SECRET = "canary-7f3a9c20d1"
# An application that uses a ControlPlane in process and configures no logging; the agent's name
# carries a registered secret into the log event of the session it opens.
EMBEDDED = """\
import asyncio
{configure}
from router import ControlPlane, InvalidCall
from router.redact import REDACTOR

async def main():
    REDACTOR.add({secret!r}, "canary")
    async with ControlPlane.from_settings() as plane:
        await plane.register({tool!r})
        session = await plane.open_session("agent-" + {secret!r}, "alice@example.com")
        assert (await plane.call(session, "echo", {{"x": 1}})).ok
        try:
            await plane.call(session, "echo", "not json")
        except InvalidCall:
            pass

asyncio.run(main())
"""
# An application that configured structlog before importing stockade: to stdout, its own renderer.
CONFIGURED = """\
import sys, structlog
structlog.configure(processors=[lambda _, __, event: "app-renders " + event["event"]],
                    logger_factory=structlog.PrintLoggerFactory(sys.stdout))
"""


def run(tmp_path: Path, configure: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "embedded.py"
    script.write_text(EMBEDDED.format(configure=configure, secret=SECRET, tool=python_tool("echo", ECHO)))
    environment = {**os.environ, "PYTHONPATH": str(REPO), "STOCKADE_AUDIT__PATH": str(tmp_path / "audit.jsonl"),
                   "STOCKADE_POLICY__DIR": str(REPO / "policies"), **env}  # fmt: skip
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip


def test_an_embedded_control_plane_prints_nothing_to_stdout_and_logs_warnings_only_by_default(tmp_path: Path) -> None:
    done = run(tmp_path)
    assert done.stdout == ""
    assert "session_opened" not in done.stderr  # info: below the default level
    assert SECRET not in done.stderr


def test_at_stockade_log_level_info_events_go_to_stderr_redacted(tmp_path: Path) -> None:
    done = run(tmp_path, STOCKADE_LOG_LEVEL="info")
    assert done.stdout == ""
    [opened] = [line for line in done.stderr.splitlines() if "session_opened" in line]
    assert "agent=agent-[REDACTED:canary]" in opened
    assert SECRET not in done.stderr


def test_an_application_that_configured_structlog_keeps_its_configuration(tmp_path: Path) -> None:
    done = run(tmp_path, CONFIGURED, STOCKADE_LOG_LEVEL="error")
    assert "app-renders session_opened" in done.stdout.splitlines()


def test_a_cached_logger_writes_to_stderr_as_it_is_now_not_as_it_was() -> None:
    # A logger structlog cached while stderr was a capture that is closed since (a test runner's, a
    # CLI runner's) wrote into the closed file and raised ValueError at the next event.
    import io  # noqa: PLC0415

    import structlog  # noqa: PLC0415

    from router.logging import configure_logging  # noqa: PLC0415

    saved_config, saved_stderr = structlog.get_config(), sys.stderr
    try:
        configure_logging("console", "info", cache=True)
        logger = structlog.get_logger("stockade.test")
        first, second = io.StringIO(), io.StringIO()
        sys.stderr = first
        logger.info("first_event")
        first.close()
        sys.stderr = second
        logger.info("second_event")
    finally:
        sys.stderr = saved_stderr
        structlog.configure(**saved_config)
    assert "second_event" in second.getvalue()

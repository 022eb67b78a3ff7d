"""Quarantined outputs are kept for `RunnerSettings.quarantine_keep_s` and then removed by the
router: every call with outputs leaves a directory, and a disk they fill would stop the audit
log, and with it every call. They used to be kept for ever."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router import ControlPlane
from router.settings import Settings
from runner import RunnerSettings
from runner.files import sweep_quarantine
from tests.conftest import python_tool

WEEK = 7 * 86400.0

WRITES_OUT = """
def main():
    open("/out/result.txt", "w").write("kept for a while")
    return "ok"
"""


def _aged(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp), follow_symlinks=False)


def test_the_sweep_removes_old_call_directories_only_and_follows_no_link(tmp_path: Path) -> None:
    root = tmp_path / "quarantine"
    old, fresh, stray = root / "c-old", root / "c-fresh", root / "stray-file"
    (old / "deep" / "er").mkdir(parents=True)
    (old / "deep" / "er" / "out.bin").write_bytes(b"x" * 100)
    fresh.mkdir()
    (fresh / "out.txt").write_text("new")
    stray.write_text("left by hand")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.txt").write_text("not the quarantine's")
    link = root / "c-link"
    link.symlink_to(outside, target_is_directory=True)
    for path in (old, stray, link):
        _aged(path, WEEK + 60)

    assert sweep_quarantine(root, WEEK) == 3
    assert sorted(p.name for p in root.iterdir()) == ["c-fresh"]
    assert (fresh / "out.txt").read_text() == "new"
    assert (outside / "precious.txt").read_text() == "not the quarantine's"  # the link went, not its target
    assert sweep_quarantine(root, WEEK) == 0
    assert sweep_quarantine(tmp_path / "never-made", WEEK) == 0


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory each sandbox's own uid can traverse (a pytest tmp_path is private)."""
    made = Path(tempfile.mkdtemp(prefix="stockade-quarantine-test-", dir="/var/lib"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _settings(settings: Settings, state_dir: Path, keep_s: float) -> Settings:
    runner = RunnerSettings(**{**settings.runner.model_dump(), "state_dir": state_dir, "quarantine_keep_s": keep_s})
    return settings.model_copy(update={"runner": runner})


async def test_a_calls_outputs_are_readable_after_it_and_gone_once_kept_long_enough(
    settings: Settings, state_dir: Path
) -> None:
    async with ControlPlane.from_settings(_settings(settings, state_dir, keep_s=3.0)) as plane:
        await plane.register(python_tool("writes_out", WRITES_OUT, sandbox={"outputs": {"max_files": 4}}))
        session = await plane.open_session("agent-1", "alice@example.com")
        result = await plane.call(session, "writes_out", {})
        assert result.ok, result.stderr[-500:]
        assert result.quarantine is not None
        kept = Path(result.quarantine)
        assert kept.parent == state_dir / "quarantine"
        assert (kept / "result.txt").read_text() == "kept for a while"  # what a framework reads after the call
        started = time.monotonic()
        while kept.exists() and time.monotonic() - started < 30:  # noqa: ASYNC110  (polling the file system)
            await asyncio.sleep(0.1)
        assert not kept.exists(), "the quarantined outputs were never removed"
        assert time.monotonic() - started >= 1.0, "removed before they were kept for quarantine_keep_s"


async def test_a_starting_router_removes_what_an_earlier_one_left_past_its_keep(
    settings: Settings, state_dir: Path
) -> None:
    root = state_dir / "quarantine"
    old, recent = root / "c-from-last-month", root / "c-from-yesterday"
    for directory in (old, recent):
        directory.mkdir(parents=True)
        (directory / "out.txt").write_text("an output")
    _aged(old, 30 * 86400)
    _aged(recent, 86400)
    async with ControlPlane.from_settings(_settings(settings, state_dir, keep_s=WEEK)):
        started = time.monotonic()
        while old.exists() and time.monotonic() - started < 10:  # noqa: ASYNC110  (polling the file system)
            await asyncio.sleep(0.05)
        assert not old.exists(), "a router's start did not sweep the quarantine"
        assert (recent / "out.txt").read_text() == "an output"
